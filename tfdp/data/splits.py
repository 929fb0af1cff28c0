"""Index arithmetic of held-out splits (test and validation sets).

Pure numpy: which indices of a training set are held out. The sources that
hold the examples are split in `tfdp.data.validation`.
"""

import numpy as np


def held_out_count(size, fraction):
    """Examples `split_validation` holds out of `size` (as scikit-learn rounds)."""
    check_fraction("validation_fraction", fraction)
    return int(np.ceil(fraction * size)) if fraction > 0 else 0


def check_fraction(name, fraction, allow_zero=True):
    """Raises a one-line error unless `fraction` is in [0, 1) (or (0, 1))."""
    low_ok = fraction >= 0 if allow_zero else fraction > 0
    if not (low_ok and fraction < 1):
        interval = "[0, 1)" if allow_zero else "(0, 1)"
        raise ValueError(f"`{name}` must be in {interval}. Received: {name}={fraction}")


def stratified_split(labels, fraction, seed):
    """Splits `range(len(labels))` into `(kept, held_out)`, stratified.

    Args:
        labels: np.ndarray. `[N]` integer labels.
        fraction: float. Fraction held out, in (0, 1).
        seed: int. Seed of the split.

    Returns:
        Two sorted int64 index arrays that partition `range(N)`.
    """
    from sklearn.model_selection import train_test_split

    labels = np.asarray(labels)
    indices = np.arange(labels.shape[0])
    try:
        kept, held_out = train_test_split(
            indices, test_size=fraction, random_state=seed, stratify=labels
        )
    except ValueError as e:
        counts = np.bincount(labels)
        raise ValueError(
            f"Cannot hold out a stratified {fraction:g} of {len(labels)} examples: every "
            "class needs at least 2 examples and the held-out set at least one per class "
            f"({e}). Received: examples per class={counts.tolist()}"
        ) from None
    return np.sort(kept), np.sort(held_out)


def user_split(user_ids, fraction, seed):
    """Splits `range(len(user_ids))` into `(kept, held_out)` by user.

    A seeded random `fraction` of the USERS (rounded up) is held out with
    all their examples, so that no user is in both parts.

    Args:
        user_ids: np.ndarray. `[N]` integer user of each example.
        fraction: float. Fraction of the users held out, in (0, 1).
        seed: int. Seed of the split.

    Returns:
        Two sorted int64 index arrays that partition `range(N)`.
    """
    check_fraction("fraction", fraction, allow_zero=False)
    user_ids = np.asarray(user_ids)
    users = np.unique(user_ids)
    count = int(np.ceil(fraction * users.size))
    if users.size < 2 or count >= users.size:
        raise ValueError(
            f"Cannot hold out {fraction:g} of the users by user: both parts need at least "
            f"one user. Received: {users.size} users"
        )
    held_users = np.random.default_rng(seed).permutation(users)[:count]
    held = np.isin(user_ids, held_users)
    return np.flatnonzero(~held).astype(np.int64), np.flatnonzero(held).astype(np.int64)


def held_out_split(source, fraction, seed):
    """`(kept, held_out)` indices of a source with labels in memory.

    By user when the source has `user_ids` (`user_split`), else stratified
    by label (`stratified_split`).
    """
    user_ids = getattr(source, "user_ids", None)
    if user_ids is not None:
        return user_split(user_ids, fraction, seed)
    return stratified_split(source.labels, fraction, seed)
