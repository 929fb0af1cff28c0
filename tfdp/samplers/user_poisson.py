"""`UserPoissonSampler`: user-level DP-SGD; each user joins each step with probability q.

The privacy unit is a user: everything one user contributed. Each logical
step draws users (not examples) by Poisson sampling, and each drawn user
brings at most k = `max_examples_per_user` of their examples, laid out as a
block of exactly k rows so that the clipping engine treats the block as one
group (`tfdp.dp.user_groups`).
"""

import hashlib

import numpy as np

from tfdp.samplers import base
from tfdp.samplers import keys
from tfdp.samplers import poisson

# Keeps the per-example scores that choose a user's examples independent of
# the users' Poisson mask (`keys.SALT_POISSON`).
SALT_USER_EXAMPLES = 0x5EED0004


@base.register
class UserPoissonSampler(poisson.PoissonSampler):
    """Poisson sampling of users, accounted with amplification by sampling.

    Step s includes user u independently with probability q = B_u / N_u
    (the Poisson mask of `PoissonSampler`, over users), from the secret
    sampling key folded with s. For each drawn user with n_u examples,
    c_u = min(k, n_u) of them are chosen uniformly at random without
    replacement, from the same key: every example gets a uniform score
    keyed by (key, s) and a user's c_u lowest-scored examples are chosen.

    Layout: each drawn user is a block of exactly k rows, their c_u chosen
    examples then k − c_u padding rows (index -1). Row weights are k / c_u
    on real rows and 0 on padding, so that `clipped_grad_sum(...,
    augmentation_multiplicity=k)`, which scales row losses by weight / k
    and clips each group of k rows once, clips the MEAN of the user's
    chosen examples' gradients to C as one vector. The blocks are split
    over the hosts (drawn user number i goes to host i mod H) and padded
    with whole padding blocks to the same positive multiple of the granule
    on every host.

    Accounting: Poisson's event with the users' rate q, composed once per
    step, under add-or-remove-one-user adjacency: the neighbouring dataset
    has one user's examples added or removed, which moves one step's
    clipped sum by at most C (the user's one clipped group). `dataset_size`
    is N_u, the number of USERS, and `expected_batch_size` B_u = q·N_u is
    the divisor of the noisy sum (it counts users).

    Args:
        dataset_size: int. N_u, the number of users. User ids are
            0 … N_u − 1 (`tfdp.dp.user_groups.compact_user_ids` maps any
            ids to these); a user with no example is allowed.
        logical_batch_size: int. B_u, the expected users per logical step.
        physical_batch_size: int or None. P, rows per physical batch per
            host: a multiple of k. Defaults to B_u / H users' blocks.
        num_hosts: int. Input pipelines. Defaults to 1.
        user_ids: int array `[n]` or None. The user of each example of the
            source, in [0, N_u). None makes a sampler for accounting only
            (it cannot draw batches).
        max_examples_per_user: int. k, the most examples a user brings to
            one step. Defaults to 1.
    """

    name = "user_poisson"
    user_form = "user_poisson"
    banded_form = "banded_user_poisson"
    privacy_unit = "user"
    adjacency = "add_or_remove_one_user"
    adjacency_description = "add or remove one user's data"

    def __init__(self, dataset_size, logical_batch_size, physical_batch_size=None, num_hosts=1,
                 *, user_ids=None, max_examples_per_user=1):
        self.max_examples_per_user = base.positive_int(
            "max_examples_per_user", max_examples_per_user)
        users = base.positive_int("dataset_size", dataset_size)
        if physical_batch_size is None:
            hosts = base.positive_int("num_hosts", num_hosts)
            per_host = max(base.positive_int("logical_batch_size", logical_batch_size) // hosts, 1)
            physical_batch_size = per_host * self.max_examples_per_user
        self.user_ids = None if user_ids is None else self._check_user_ids(user_ids, users)
        self._tensors = None
        super().__init__(dataset_size, logical_batch_size, physical_batch_size, num_hosts)

    @staticmethod
    def _check_user_ids(user_ids, users):
        ids = np.asarray(user_ids)
        if ids.ndim != 1 or ids.shape[0] == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                "`user_ids` must be a non-empty [n] integer array (the user of each example). "
                f"Received: shape={ids.shape}, dtype={ids.dtype}"
            )
        if ids.min() < 0 or ids.max() >= users:
            raise ValueError(
                "Every user id must be in [0, number of users). Map arbitrary ids with "
                "`tfdp.dp.user_groups.compact_user_ids`. Received: user ids in "
                f"[{ids.min()}, {ids.max()}], number of users (dataset_size)={users}"
            )
        return ids.astype(np.int64)

    def _validate(self):
        k = self.max_examples_per_user
        if self.physical_batch_size % k:
            raise ValueError(
                f"For sampler={self.name!r}, `physical_batch_size` (rows) must be a multiple "
                "of `max_examples_per_user`, so that no user's block straddles two physical "
                f"batches. Received: physical_batch_size={self.physical_batch_size}, "
                f"max_examples_per_user={k}"
            )

    # ------------------------------------------------------------------
    # Sizes.
    # ------------------------------------------------------------------

    @property
    def num_examples(self):
        """The examples of the source it draws from (None: accounting only)."""
        return None if self.user_ids is None else int(self.user_ids.shape[0])

    @property
    def max_step_rows(self):
        """Rows of the largest step: every user's block of k rows."""
        return self.dataset_size * self.max_examples_per_user

    @property
    def physical_batches_per_step(self):
        """Expected physical batches per step and host (k rows per drawn user)."""
        return (self.expected_batch_size * self.max_examples_per_user
                / self.num_hosts / self.physical_batch_size)

    @property
    def group_size(self):
        """Rows per privacy unit in each physical batch: k."""
        return self.max_examples_per_user

    # ------------------------------------------------------------------
    # Batches.
    # ------------------------------------------------------------------

    def _user_tables(self):
        """(examples ordered by user, first position of each user, examples per user)."""
        if self.user_ids is None:
            raise ValueError(
                f"This {self.name} sampler was made for accounting only: it needs the "
                "user of every example to draw batches. Received: user_ids=None"
            )
        if self._tensors is None:
            import tensorflow as tf

            order = np.argsort(self.user_ids, kind="stable")
            counts = np.bincount(self.user_ids, minlength=self.dataset_size)
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            with tf.init_scope():
                self._tensors = tuple(
                    tf.constant(a, tf.int64) for a in (order, starts, counts))
        return self._tensors

    def step_indices(self, sampling_key, step, host=0, granule=None):
        import tensorflow as tf

        k = self.max_examples_per_user
        g = self.physical_batch_size if granule is None else int(granule)
        if g % k:
            raise ValueError(
                f"For sampler={self.name!r}, the padding granule must be a multiple of "
                f"`max_examples_per_user`. Received: granule={g}, max_examples_per_user={k}"
            )
        order, starts, counts = self._user_tables()
        sampled = tf.where(self.mask(sampling_key, step))[:, 0]
        n = tf.shape(sampled, out_type=tf.int64)[0]
        mine = sampled[host::self.num_hosts]
        # Each drawn user's examples, in their user's order of the sort:
        # one ragged row per user.
        user_counts = tf.gather(counts, mine)
        positions = tf.ragged.range(tf.gather(starts, mine), tf.gather(starts, mine) + user_counts)
        examples = tf.gather(order, positions.flat_values)
        scores = tf.random.stateless_uniform(
            [self.num_examples], seed=keys.fold(sampling_key, SALT_USER_EXAMPLES, step),
            dtype=tf.float64,
        )
        # Sorting by (row, score) shuffles each user's examples within their row.
        row = tf.cast(positions.value_rowids(), tf.float64)
        shuffled = tf.gather(examples, tf.argsort(row + tf.gather(scores, examples), stable=True))
        chosen = tf.minimum(user_counts, k)
        slot = tf.range(k, dtype=tf.int64)[None, :]
        real = slot < chosen[:, None]
        at = tf.minimum(positions.row_starts()[:, None] + slot,
                        tf.maximum(tf.shape(shuffled, out_type=tf.int64)[0] - 1, 0))
        padded = tf.concat([shuffled, -tf.ones([1], tf.int64)], 0)  # Never empty.
        blocks = tf.where(real, tf.gather(padded, at), -tf.ones_like(at))
        weights = tf.where(
            real, float(k) / tf.cast(tf.maximum(chosen, 1), tf.float32)[:, None],
            tf.zeros(tf.shape(real), tf.float32))
        # From the global count, so that every host pads to the same length.
        per_host_rows = (n + self.num_hosts - 1) // self.num_hosts * k
        length = tf.maximum((per_host_rows + g - 1) // g, 1) * g
        pad = length - tf.shape(mine, out_type=tf.int64)[0] * k
        indices = tf.concat([tf.reshape(blocks, [-1]), -tf.ones([pad], tf.int64)], 0)
        weights = tf.concat([tf.reshape(weights, [-1]), tf.zeros([pad], tf.float32)], 0)
        return indices, weights

    def check_source(self, source):
        super().check_source(source)
        if self.num_examples is not None and len(source) != self.num_examples:
            raise ValueError(
                "The sampler's user ids are for another source: it needs one user id per "
                f"example. Received: {self.num_examples} user ids, source of {len(source)} "
                "examples"
            )

    def with_hosts(self, num_hosts, physical_batch_size=None):
        return type(self)(self.dataset_size, self.logical_batch_size,
                          physical_batch_size or self.physical_batch_size, num_hosts,
                          user_ids=self.user_ids,
                          max_examples_per_user=self.max_examples_per_user)

    # ------------------------------------------------------------------

    def describe(self):
        return (super().describe().replace(" N=", " N_users=", 1)
                + f" unit=user max_examples_per_user={self.max_examples_per_user}")

    def __repr__(self):
        digest = (None if self.user_ids is None
                  else hashlib.sha256(self.user_ids.tobytes()).hexdigest()[:16])
        return (f"{type(self).__name__}(dataset_size={self.dataset_size}, "
                f"logical_batch_size={self.logical_batch_size}, "
                f"physical_batch_size={self.physical_batch_size}, num_hosts={self.num_hosts}, "
                f"max_examples_per_user={self.max_examples_per_user}, user_ids={digest})")
