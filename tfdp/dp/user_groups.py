"""User-level clipping as groups of rows: the layout and its row weights.

`clipped_grad_sum(..., augmentation_multiplicity=k)` treats rows
i·k … i·k+k−1 as one group: their losses are scaled by weight / k, the
group's gradient is clipped once, and a group of weight-0 rows is padding.
So a user is one group when their c ≤ k rows are laid out as a block of
exactly k rows (the c real rows, then k − c padding rows of weight 0) and
each real row has weight k / c: the group's gradient is then the MEAN of the
user's c per-example gradients, clipped to C as one vector, by every
clipping method. Augmentation multiplicity K repeats each row K times in
place (`tf.repeat`), which keeps the blocks: groups of k·K rows, the same
weights.

`tfdp.samplers.UserPoissonSampler` draws batches in this layout;
`user_blocks` makes it from any batch with a user id per row.

What example-level DP says about a user of at most k examples, for
comparison with a user-level run, is `tfdp.privacy.group_privacy`'s.
"""

import numpy as np

from tfdp import validation


def compact_user_ids(user_ids, num_examples=None):
    """Maps user ids to 0 … N_u − 1, once `tfdp.validation.validate_user_ids` accepts them.

    Args:
        user_ids: array-like `[n]` of integers or of names: the user of each
            example. Missing (None, NaN), infinite or mixed ids are refused.
        num_examples: int or None. n, checked when given. Defaults to `None`.

    Returns:
        `(ids, num_users)`: int64 `[n]` ids in [0, N_u) (in the sorted order
        of the distinct original ids) and N_u.

    Raises:
        ValueError: as `tfdp.validation.validate_user_ids`.
    """
    user_ids = validation.validate_user_ids(user_ids, num_examples)
    distinct, ids = np.unique(user_ids, return_inverse=True)
    return ids.astype(np.int64), int(distinct.shape[0])


def split_last_users(user_ids, fraction, name="validation_split"):
    """Keras' `validation_split` by user: the last users are held out with all their rows.

    Keras holds out the last rows; here the users are taken in the order of
    their first row and the last ones are held out, all their rows with
    them, so that no user is on both sides. The kept users are
    floor(N_u · (1 − fraction)), as Keras keeps floor(n · (1 − fraction))
    rows. Deterministic: the split is public, like Keras'.

    Args:
        user_ids: int array `[n]` (e.g. from `compact_user_ids`).
        fraction: float in (0, 1). The fraction of the users held out.
        name: str. The argument's name, for the message. Defaults to
            `"validation_split"`.

    Returns:
        `(kept, held_out)`: sorted int64 row indices that partition
        `range(n)`.

    Raises:
        ValueError: when a side would have no user.
    """
    user_ids = np.asarray(user_ids).reshape(-1)
    users, first = np.unique(user_ids, return_index=True)
    kept_count = int(np.floor(users.size * (1.0 - fraction)))
    if not 0 < kept_count < users.size:
        raise ValueError(
            f"{name} with user_ids holds out whole users, and both sides need at least one "
            f"user. Received: {name}={fraction}, {users.size} users")
    held_users = users[np.argsort(first, kind="stable")[kept_count:]]
    held = np.isin(user_ids, held_users)
    return np.flatnonzero(~held).astype(np.int64), np.flatnonzero(held).astype(np.int64)


def block_weights(counts, max_examples_per_user):
    """The row weights of user blocks: k / c on each user's c real rows, 0 after.

    Args:
        counts: int array `[U]`. Each user's real rows c, in [0, k].
        max_examples_per_user: int. k, the rows of a block.

    Returns:
        float32 `[U·k]`.
    """
    k = int(max_examples_per_user)
    counts = np.asarray(counts, np.int64)
    if k < 1 or np.any(counts < 0) or np.any(counts > k):
        raise ValueError(
            "Each user's rows must be in [0, max_examples_per_user]. Received: "
            f"counts in [{counts.min()}, {counts.max()}], max_examples_per_user={k}")
    slot = np.arange(k)[None, :]
    weights = np.where(slot < counts[:, None], k / np.maximum(counts, 1)[:, None], 0.0)
    return weights.reshape(-1).astype(np.float32)


def user_blocks(user_ids, max_examples_per_user):
    """Lays a batch's rows out as user blocks of k rows (see the module docstring).

    Args:
        user_ids: int array `[n]`. The user of each row of a batch; -1 marks
            a padding row (left out).
        max_examples_per_user: int. k. No user may have more than k rows
            (choosing which is the sampler's job).

    Returns:
        `(rows, weights)`: int64 `[U·k]`, the batch row of each block row
        (-1 for padding), users in order of first appearance; float32
        `[U·k]` weights (k / c real, 0 padding). Pass `x[rows]` (padding
        rows zeroed) with these weights and `augmentation_multiplicity=k`
        to `clipped_grad_sum`.
    """
    k = int(max_examples_per_user)
    user_ids = np.asarray(user_ids).reshape(-1)
    real = np.flatnonzero(user_ids >= 0)
    users, first, counts = np.unique(user_ids[real], return_index=True, return_counts=True)
    if counts.size and counts.max() > k:
        raise ValueError(
            "A user has more rows than `max_examples_per_user`. Received: user "
            f"{users[counts.argmax()]} with {counts.max()} rows, max_examples_per_user={k}")
    users = users[np.argsort(first)]
    rows = -np.ones([users.size, k], np.int64)
    count_of = {}
    for u in users:
        mine = real[user_ids[real] == u]
        rows[len(count_of), :mine.size] = mine
        count_of[u] = mine.size
    weights = block_weights([count_of[u] for u in users], k)
    return rows.reshape(-1), weights
