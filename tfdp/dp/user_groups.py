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


def compact_user_ids(user_ids):
    """Maps arbitrary user ids to 0 … N_u − 1.

    Args:
        user_ids: array `[n]` of ints or strings. The user of each example.

    Returns:
        `(ids, num_users)`: int64 `[n]` ids in [0, N_u) (in the sorted order
        of the distinct original ids) and N_u.
    """
    user_ids = np.asarray(user_ids)
    if user_ids.ndim != 1 or user_ids.shape[0] == 0:
        raise ValueError(
            f"`user_ids` must be a non-empty [n] array. Received: shape={user_ids.shape}")
    distinct, ids = np.unique(user_ids, return_inverse=True)
    return ids.astype(np.int64), int(distinct.shape[0])


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
