"""`NoisyAggregator`: accumulate clipped sums, add the noise once, divide.

The one implementation of the end of a DP-SGD step, shared by the trainer's
`PrivateTrainStep` and Keras' `DPOptimizer`, so that both release exactly

    (Σ_i clip(g_i) + N(0, (σC)²)) / B

per logical step, with B the public expected batch size (never the realised
one, which would leak it) and the noise drawn once from
`step_seed(noise_key, step)`.

The noise itself is the aggregator's noise scheme's
(`tfdp.dp.noise_schemes`), chosen once from its arguments
(`_choose_scheme`): DP-SGD's independent draw ("gaussian"); with a
b-banded matrix-factorization strategy (`coefficients`), noise correlated
across steps from a state of the last b − 1 noise tensors, which the caller
keeps (`noise_state_shape`), as it keeps the accumulators ("banded"); with
tree aggregation (DP-FTRL, `tree=` a
`tfdp.privacy.tree_aggregation.TreeRestarts`), the increment of its tree's
noisy prefix sum, drawn from the same key by tree node, with no state; with
`leaves_per_step=k` a step holds k leaves of the tree (one per accumulated
batch) and releases the sum of their increments ("tree"). Any registered
scheme can be named instead (`scheme=`).

With `hardened_noise=True` every scheme draws the hardened noise (float64,
summed draws) and releases each coordinate on a public grid with one
rounding (`tfdp.dp.noise`; docs/PRIVACY.md, "Floating-point noise").
"""

import tensorflow as tf

from tfdp import validation
from tfdp.dp import noise_schemes


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
        scheme: str, `tfdp.dp.noise_schemes.NoiseScheme` or None. A
            registered noise scheme's name, built from the options above
            (`NoiseScheme.from_options`), or a scheme. Defaults to `None`:
            chosen from `coefficients` and `tree`.
        hardened_noise: bool. The hardened noise, against floating-point
            attacks (`tfdp.dp.noise`), for whichever scheme. A scheme
            passed as an object carries its own. Defaults to `False`.

    Raises:
        ValueError: for a negative std, a divisor not > 0, coefficients
            without c_0 > 0, both a tree and a banded strategy, a bad
            `leaves_per_step`, an unknown scheme, or `hardened_noise`
            that is not a bool.
    """

    def __init__(self, *, noise_stddev, expected_batch_size, noise_key, coefficients=(1.0,),
                 tree=None, leaves_per_step=1, scheme=None, hardened_noise=False):
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
        self.scheme = self._choose_scheme(scheme, validation.validate_hardened_noise(
            hardened_noise))
        # A graph constant, never a variable: nothing that saves the model or
        # the optimizer may hold the key.
        self._noise_key = tf.constant(noise_key, tf.int64)

    def _choose_scheme(self, scheme, hardened_noise):
        """The noise scheme of the constructor's arguments: the one place it is chosen."""
        if isinstance(scheme, noise_schemes.NoiseScheme):
            if (self.coefficients != (1.0,) or self.tree is not None
                    or (hardened_noise and not scheme.hardened_noise)):
                raise ValueError(
                    "A scheme passed as an object carries its own options. Received: "
                    f"scheme={scheme!r}, coefficients={self.coefficients!r}, tree={self.tree!r}, "
                    f"hardened_noise={hardened_noise!r}")
            return scheme
        if scheme is None:
            if self.tree is not None:
                scheme = "tree"
            elif self.coefficients != (1.0,):
                scheme = "banded"
            else:
                scheme = "gaussian"
        return noise_schemes.scheme_class(scheme).from_options(
            coefficients=self.coefficients, tree=self.tree,
            leaves_per_step=self.leaves_per_step, hardened_noise=hardened_noise)

    @classmethod
    def for_mechanism(cls, mechanism, tree=None, leaves_per_step=1, scheme=None):
        """The aggregator of a `tfdp.DPSGD` contract: its σ·C, divisor, noise key,
        noise scheme, banded strategy and `hardened_noise`.

        Args:
            mechanism: `tfdp.DPSGD`.
            tree: `TreeRestarts` or None, as the constructor's. Defaults to `None`.
            leaves_per_step: int, as the constructor's. Defaults to `1`.
            scheme: str, `NoiseScheme` or None, as the constructor's.
                Defaults to `None`: the contract's `noise_scheme`, unless
                `tree` is given.

        Returns:
            A `NoisyAggregator`.
        """
        if scheme is None and tree is None:
            scheme = mechanism.noise_scheme
        return cls(
            noise_stddev=mechanism.noise_stddev,
            expected_batch_size=mechanism.expected_batch_size,
            noise_key=mechanism.secret_key.derive("noise"),
            coefficients=mechanism.band_coefficients,
            tree=tree,
            leaves_per_step=leaves_per_step,
            scheme=scheme,
            hardened_noise=mechanism.hardened_noise,
        )

    @property
    def hardened_noise(self):
        """Whether the noise is hardened against floating-point attacks (the scheme's)."""
        return self.scheme.hardened_noise

    @property
    def bands(self):
        """b: the number of strategy coefficients (1 for DP-SGD)."""
        return len(self.coefficients)

    @property
    def correlated(self):
        """Whether the noise is correlated across steps through a state (the scheme's)."""
        return self.scheme.has_state

    def noise_state_shape(self, shape):
        """The shape of the noise state of one variable of `shape`, or None without one.

        The scheme's (`NoiseScheme.state_shape`): for banded noise the last
        b − 1 noise tensors w, each in slot `t mod (b − 1)` of its step t.
        The caller creates it as zeros (w_t = 0 before the first step),
        float32 like the accumulators, one per variable, and keeps it in the
        training checkpoints only (`NoiseScheme.checkpoint_state`): it is as
        secret as the key, since it reveals the noise of the last steps.
        None when the noise needs no state.

        Args:
            shape: list of ints (or a `TensorShape`). The variable's shape.

        Returns:
            list of ints (`[b - 1, *shape]` for banded noise), or None.
        """
        return self.scheme.state_shape(shape)

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

        The noise is the scheme's (`NoiseScheme.noise`), drawn with std
        σC / R: with banded noise each replica's state then holds w / R
        (`tfdp.dp.noise_schemes.banded`).

        Args:
            accumulators: list of variables. The logical step's sums.
            step: int scalar (tensor). The logical step: seeds the noise.
            num_replicas: int. R. Defaults to 1.
            empty: bool scalar tensor or None. True when no batch was
                accumulated (the accumulators hold stale sums): the sum is
                taken as zero. Defaults to None.
            noise_state: list of float variables or None. With a scheme
                that keeps a state (banded noise), one per accumulator,
                shaped by `noise_state_shape`; read and advanced here.
                Defaults to None (DP-SGD).

        Returns:
            A list of tensors, one per accumulator.

        Raises:
            ValueError: without the noise state its scheme keeps, or with
                a state of the wrong length.
        """
        if self.correlated and noise_state is None:
            raise ValueError(
                f"The noise scheme {self.scheme!r} correlates the noise across steps: "
                "noisy_mean needs the noise state (`noise_state_shape`). "
                "Received: noise_state=None")
        zeroed = []
        if empty is not None:
            zeroed = [tf.cond(empty, lambda: self._zero(accumulators, empty), lambda: tf.constant(0))]
        with tf.control_dependencies(zeroed):
            sums = [tf.convert_to_tensor(a) for a in accumulators]
        if self.noise_stddev > 0:
            return self.scheme.noisy_mean(
                sums, stddev=self.noise_stddev / float(num_replicas), noise_key=self._noise_key,
                step=step, divisor=self.expected_batch_size,
                state=noise_state if self.correlated else None)
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
