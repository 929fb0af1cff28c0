"""`NoisyAggregator`: accumulate clipped sums, add the noise once, divide.

The one implementation of the end of a DP-SGD step, shared by the trainer's
`PrivateTrainStep` and Keras' `DPOptimizer`, so that both release exactly

    (Σ_i clip(g_i) + N(0, (σC)²)) / B

per logical step, with B the public expected batch size (never the realised
one, which would leak it) and the noise drawn once from
`step_seed(noise_key, step)`.
"""

import tensorflow as tf

from tfdp.dp import noise as noise_lib


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
    """

    def __init__(self, *, noise_stddev, expected_batch_size, noise_key):
        if not noise_stddev >= 0:
            raise ValueError(f"noise_stddev must be >= 0. Received: noise_stddev={noise_stddev}")
        if not expected_batch_size > 0:
            raise ValueError(
                f"expected_batch_size must be > 0. Received: expected_batch_size={expected_batch_size}"
            )
        self.noise_stddev = float(noise_stddev)
        self.expected_batch_size = float(expected_batch_size)
        # A graph constant, never a variable: nothing that saves the model or
        # the optimizer may hold the key.
        self._noise_key = tf.constant(noise_key, tf.int64)

    @classmethod
    def for_mechanism(cls, mechanism):
        """The aggregator of a `tfdp.DPSGD` contract: its σ·C, divisor and noise key."""
        return cls(
            noise_stddev=mechanism.noise_stddev,
            expected_batch_size=mechanism.expected_batch_size,
            noise_key=mechanism.secret_key.derive("noise"),
        )

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

    def noisy_mean(self, accumulators, step, num_replicas=1, empty=None):
        """`(Σ + noise / R) / B`, to hand to the optimizer.

        On R replicas each replica holds its partial sum and adds `noise / R`
        of one common draw (same key, same step), so the optimizer's
        cross-replica SUM adds back exactly one N(0, (σC)²).

        Args:
            accumulators: list of variables. The logical step's sums.
            step: int scalar (tensor). The logical step: seeds the noise.
            num_replicas: int. R. Defaults to 1.
            empty: bool scalar tensor or None. True when no batch was
                accumulated (the accumulators hold stale sums): the sum is
                taken as zero. Defaults to None.
        """
        zeroed = []
        if empty is not None:
            zeroed = [tf.cond(empty, lambda: self._zero(accumulators, empty), lambda: tf.constant(0))]
        with tf.control_dependencies(zeroed):
            sums = [tf.convert_to_tensor(a) for a in accumulators]
        if self.noise_stddev > 0:
            # noise / R drawn directly as N(0, (σC/R)²) from the same words.
            return noise_lib.noisy_divided(
                sums, self.noise_stddev / float(num_replicas),
                noise_lib.step_seed(self._noise_key, step), self.expected_batch_size,
            )
        return [s / self.expected_batch_size for s in sums]

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
