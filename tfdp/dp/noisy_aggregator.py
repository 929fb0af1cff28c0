"""`NoisyAggregator`: accumulate clipped sums, add the noise once, divide.

The one implementation of the end of a DP-SGD step, shared by the trainer's
`PrivateTrainStep` and Keras' `DPOptimizer`, so that both release exactly

    (Σ_i clip(g_i) + N(0, (σC)²)) / B

per logical step, with B the public expected batch size (never the realised
one, which would leak it) and the noise drawn once from
`step_seed(noise_key, step)`.

With a b-banded matrix-factorization strategy (`tfdp.privacy.banded_mf`,
coefficients c_0 … c_{b-1}), the noise of step t is correlated instead:

    w_t = (z_t − Σ_{j=1}^{b-1} c_j w_{t-j}) / c_0,

row t of C⁻¹Z, with z_t that same draw. The caller keeps the last b − 1 w's
(`noise_state_shape`), as it keeps the accumulators.

With tree aggregation (DP-FTRL, `tree=` a
`tfdp.privacy.tree_aggregation.TreeRestarts`) the noise of step t is the
increment of its tree's noisy prefix sum (`tfdp.dp.tree_noise`), drawn from
the same key by tree node, with no state; with `leaves_per_step=k` a step
holds k leaves of the tree (one per accumulated batch) and releases the sum
of their increments.
"""

import tensorflow as tf

from tfdp.dp import noise as noise_lib
from tfdp.dp import tree_noise


class NoisyAggregator:
    """The accumulate → noise → divide stages of a logical step.

    It holds no variables: the caller owns the accumulators (per-replica
    variables in the trainer, optimizer variables in Keras), so each keeps
    its own checkpointing and distribution, and both share the arithmetic.

    Args:
        noise_stddev: float. σ·C, the std of the noise on the summed clipped
            gradients of one logical step.
        expected_batch_size: float. B, the divisor.
        noise_key: int64 `[2]`. The run's secret noise sub-key
            (`SecretKey.derive("noise")`).
        coefficients: sequence of floats. The banded strategy's c_0 … c_{b-1},
            already checked by `tfdp.DPSGDConfig` (c_0 > 0, norm <= 1).
            Defaults to `(1.0,)`: DP-SGD, with no state.
        tree: `tfdp.privacy.tree_aggregation.TreeRestarts` or None. DP-FTRL's
            tree aggregation with these restarts: the noise of a step is the
            increment of its tree's noisy prefix sum, each node N(0, (σC)²).
            Defaults to `None`: independent noise each step.
        leaves_per_step: int. With `tree`, the tree leaves of one logical
            step (its accumulated batches): step u releases the increments
            of leaves u·k … u·k + k − 1, and the restarts count leaves.
            Defaults to `1`.
    """

    def __init__(self, *, noise_stddev, expected_batch_size, noise_key, coefficients=(1.0,),
                 tree=None, leaves_per_step=1):
        if not noise_stddev >= 0:
            raise ValueError(f"noise_stddev must be >= 0. Received: noise_stddev={noise_stddev}")
        if not expected_batch_size > 0:
            raise ValueError(
                f"expected_batch_size must be > 0. Received: expected_batch_size={expected_batch_size}"
            )
        self.noise_stddev = float(noise_stddev)
        self.expected_batch_size = float(expected_batch_size)
        self.coefficients = tuple(float(c) for c in coefficients)
        if not self.coefficients or not self.coefficients[0] > 0:
            raise ValueError(
                "The banded strategy needs coefficients with c_0 > 0. "
                f"Received: coefficients={coefficients!r}")
        if tree is not None and self.coefficients != (1.0,):
            raise ValueError(
                "Tree aggregation and a banded strategy are two ways to correlate the "
                f"noise; choose one. Received: tree={tree!r}, coefficients={coefficients!r}")
        if (isinstance(leaves_per_step, bool) or not isinstance(leaves_per_step, int)
                or leaves_per_step < 1 or (tree is None and leaves_per_step != 1)):
            raise ValueError(
                "leaves_per_step must be an int >= 1, and 1 without a tree. Received: "
                f"leaves_per_step={leaves_per_step!r}, tree={tree!r}")
        self.tree = tree
        self.leaves_per_step = leaves_per_step
        # A graph constant, never a variable: nothing that saves the model or
        # the optimizer may hold the key.
        self._noise_key = tf.constant(noise_key, tf.int64)

    @classmethod
    def for_mechanism(cls, mechanism, tree=None, leaves_per_step=1):
        """The aggregator of a `tfdp.DPSGD` contract: its σ·C, divisor and noise key.

        Args:
            mechanism: `tfdp.DPSGD`.
            tree: `TreeRestarts` or None, as the constructor's. Defaults to `None`.
            leaves_per_step: int, as the constructor's. Defaults to `1`.
        """
        return cls(
            noise_stddev=mechanism.noise_stddev,
            expected_batch_size=mechanism.expected_batch_size,
            noise_key=mechanism.secret_key.derive("noise"),
            coefficients=mechanism.band_coefficients,
            tree=tree,
            leaves_per_step=leaves_per_step,
        )

    @property
    def bands(self):
        """b: the number of strategy coefficients (1 for DP-SGD)."""
        return len(self.coefficients)

    @property
    def correlated(self):
        """Whether the noise is correlated across steps (it needs a state)."""
        return self.coefficients != (1.0,)

    def noise_state_shape(self, shape):
        """The shape of the noise state of one variable of `shape`: `[b - 1, *shape]`.

        It holds the last b − 1 noise tensors w, each in slot `t mod (b − 1)`
        of its step t. The caller creates it as zeros (w_t = 0 before the
        first step), float32 like the accumulators, one per variable, and
        keeps it in the training checkpoints only: it is as secret as the
        key, since it reveals the noise of the last steps. None when the
        noise needs no state.
        """
        if not self.correlated:
            return None
        return [max(self.bands - 1, 1), *shape]

    def accumulate(self, accumulators, clipped_sum, first):
        """Adds one physical batch's clipped sum.

        Args:
            accumulators: list of float variables, one per trainable variable.
            clipped_sum: list of tensors. Σ_i clip(g_i) over the batch.
            first: bool scalar tensor. True on the first physical batch of a
                logical step: the sum overwrites the accumulators, so no pass
                is spent zeroing them.
        """
        clipped_sum = [tf.cast(g, a.dtype) for a, g in zip(accumulators, clipped_sum)]

        def overwrite():
            for acc, g in zip(accumulators, clipped_sum):
                acc.assign(g)
            return tf.constant(0)

        def add():
            for acc, g in zip(accumulators, clipped_sum):
                acc.assign_add(g)
            return tf.constant(0)

        tf.cond(first, overwrite, add)

    def noisy_mean(self, accumulators, step, num_replicas=1, empty=None, noise_state=None):
        """`(Σ + noise / R) / B`, to hand to the optimizer.

        On R replicas each replica holds its partial sum and adds `noise / R`
        of one common draw (same key, same step), so the optimizer's
        cross-replica SUM adds back exactly one N(0, (σC)²).

        With a banded strategy the noise is w_t (module docstring). Each
        replica's state holds w / R: the recursion is linear, so from z_t / R
        (its share of the draw) it yields exactly w_t / R, and the replicas'
        states read together (a SUM variable in a checkpoint) hold w.

        Args:
            accumulators: list of variables. The logical step's sums.
            step: int scalar (tensor). The logical step: seeds the noise.
            num_replicas: int. R. Defaults to 1.
            empty: bool scalar tensor or None. True when no batch was
                accumulated (the accumulators hold stale sums): the sum is
                taken as zero. Defaults to None.
            noise_state: list of float variables or None. With a banded
                strategy, one per accumulator, shaped by `noise_state_shape`;
                read and advanced here. Defaults to None (DP-SGD).
        """
        if self.correlated and noise_state is None:
            raise ValueError(
                f"A {self.bands}-banded strategy correlates the noise across steps: "
                "noisy_mean needs the noise state (`noise_state_shape`). "
                "Received: noise_state=None")
        zeroed = []
        if empty is not None:
            zeroed = [tf.cond(empty, lambda: self._zero(accumulators, empty), lambda: tf.constant(0))]
        with tf.control_dependencies(zeroed):
            sums = [tf.convert_to_tensor(a) for a in accumulators]
        if self.noise_stddev > 0 and self.correlated:
            return self._banded_noisy_mean(sums, step, num_replicas, noise_state)
        if self.noise_stddev > 0 and self.tree is not None:
            noise = tree_noise.step_noise(
                sums, self.noise_stddev / float(num_replicas), self._noise_key, step, self.tree,
                self.leaves_per_step)
            return [(s + tf.cast(n, s.dtype)) / self.expected_batch_size
                    for s, n in zip(sums, noise)]
        if self.noise_stddev > 0:
            # noise / R drawn directly as N(0, (σC/R)²) from the same words.
            return noise_lib.noisy_divided(
                sums, self.noise_stddev / float(num_replicas),
                noise_lib.step_seed(self._noise_key, step), self.expected_batch_size,
            )
        return [s / self.expected_batch_size for s in sums]

    def _banded_noisy_mean(self, sums, step, num_replicas, noise_state):
        """`(Σ + w_t / R) / B`, with w_t / R from the state, which then holds it."""
        if len(noise_state) != len(sums):
            raise ValueError(
                "The noise state needs one variable per accumulator. Received: "
                f"{len(noise_state)} state variables, {len(sums)} accumulators")
        step = tf.cast(step, tf.int64)
        slots = max(self.bands - 1, 1)
        # Slot s holds w_(t-j) with j = ((t - s - 1) mod (b - 1)) + 1; weight c_j.
        lags = tf.math.floormod(step - 1 - tf.range(slots, dtype=tf.int64), slots) + 1
        tail = self.coefficients[1:] or (0.0,)
        draws = noise_lib.gaussian_noise(
            sums, self.noise_stddev / float(num_replicas),
            noise_lib.step_seed(self._noise_key, step))
        slot = tf.math.floormod(step, slots)
        means = []
        for total, draw, state in zip(sums, draws, noise_state):
            lag_weights = tf.gather(tf.constant(tail, state.dtype), lags - 1)
            previous = tf.convert_to_tensor(state)
            history = tf.tensordot(lag_weights, previous, axes=1)
            noise = (tf.cast(draw, state.dtype) - history) / self.coefficients[0]
            # A whole assign: per-replica (ON_READ) variables take no scatter.
            state.assign(tf.tensor_scatter_nd_update(previous, slot[None, None], noise[None]))
            means.append((total + tf.cast(noise, total.dtype)) / self.expected_batch_size)
        return means

    @staticmethod
    def _zero(accumulators, empty):
        """Zeroes the accumulators' stale sums (an empty step only).

        Only an empty step pays for it: a select on every step was a pass
        over all the parameters (17 ms of ResNet-18's 32-px step on 2 cores).
        The zero is a runtime value, because Grappler folds zeros of a static
        shape into constants that the step then holds for good (24 MiB for
        ResNet-18).
        """
        for acc in accumulators:
            zero = tf.cast(tf.logical_not(empty), acc.dtype)
            acc.assign(tf.fill(tf.shape(acc), zero))
        return tf.constant(0)
