"""`BandedNoise`: banded matrix-factorization noise, correlated across steps.

With a b-banded strategy (`tfdp.privacy.banded_mf`, coefficients
c_0 … c_{b-1}) the noise of step t is

    w_t = (z_t − Σ_{j=1}^{b-1} c_j w_{t-j}) / c_0,

row t of C⁻¹Z, with z_t DP-SGD's draw of the same key and step. The state
holds the last b − 1 w's, w_t in slot `t mod (b − 1)`.

On R replicas each replica's state holds w / R: the recursion is linear, so
from z_t / R (its share of the draw) it yields exactly w_t / R, and the
replicas' states read together (a SUM variable in a checkpoint) hold w.
"""

import tensorflow as tf

from tfdp.dp import noise as noise_lib
from tfdp.dp.noise_schemes import base


@base.register
class BandedNoise(base.NoiseScheme):
    """Banded MF noise w_t, from a state of the last b − 1 noise tensors.

    The state is as secret as the key (it reveals the last steps' noise):
    the trainer keeps it in its training checkpoints only, the Keras route
    in memory only.

    Accounting: amplified BandMF, DP-SGD over ⌈T/b⌉ rounds of a sampler
    whose units' steps are at least b apart (`tfdp.samplers.BandGroups`;
    `tfdp.privacy.banded_mf.amplified_dp_event` is its formula).

    With hardened noise the recursion runs in float64 on the hardened draws
    (the state keeps float32 w's), and the release rounds once.

    Args:
        coefficients: sequence of floats. c_0 … c_{b-1}, already checked by
            `tfdp.DPSGDConfig` (c_0 > 0, norm <= 1).
        hardened_noise: bool. As `NoiseScheme`'s. Defaults to `False`.
    """

    name = "banded"
    checkpoint_state = True

    def __init__(self, coefficients, *, hardened_noise=False):
        super().__init__(hardened_noise=hardened_noise)
        self.coefficients = tuple(float(c) for c in coefficients)
        if not self.coefficients or not self.coefficients[0] > 0:
            raise ValueError(
                "The banded strategy needs coefficients with c_0 > 0. "
                f"Received: coefficients={coefficients!r}")

    @classmethod
    def from_options(cls, *, coefficients=(1.0,), tree=None, leaves_per_step=1,
                     hardened_noise=False):
        """The scheme of `coefficients` (see `NoiseScheme.from_options`).

        Raises:
            ValueError: with a tree or several leaves per step, or for
                coefficients without c_0 > 0.
        """
        if tree is not None or leaves_per_step != 1:
            raise ValueError(
                "Tree aggregation and a banded strategy are two ways to correlate the "
                f"noise; choose one. Received: tree={tree!r}, coefficients={coefficients!r}, "
                f"leaves_per_step={leaves_per_step!r}")
        return cls(coefficients, hardened_noise=hardened_noise)

    @property
    def bands(self):
        """b: the number of strategy coefficients."""
        return len(self.coefficients)

    def state_shape(self, shape):
        """`[b - 1, *shape]` (one slot at least): the last b − 1 noise tensors w."""
        return [max(self.bands - 1, 1), *shape]

    def noise(self, like, *, stddev, noise_key, step, state=None):
        """w_t (module docstring), advancing `state` (see `NoiseScheme.noise`).

        Raises:
            ValueError: without one state variable per tensor of `like`.
        """
        if state is None or len(state) != len(like):
            raise ValueError(
                "The noise state needs one variable per accumulator. Received: "
                f"{'no' if state is None else len(state)} state variables, "
                f"{len(like)} accumulators")
        step = tf.cast(step, tf.int64)
        slots = max(self.bands - 1, 1)
        # Slot s holds w_(t-j) with j = ((t - s - 1) mod (b - 1)) + 1; weight c_j.
        lags = tf.math.floormod(step - 1 - tf.range(slots, dtype=tf.int64), slots) + 1
        tail = self.coefficients[1:] or (0.0,)
        draws = noise_lib.gaussian_noise(like, stddev, noise_lib.step_seed(noise_key, step),
                                         self.hardened_noise)
        slot = tf.math.floormod(step, slots)
        noises = []
        for draw, variable in zip(draws, state):
            # The recursion's dtype: the state's, or the hardened draw's float64.
            dtype = draw.dtype if self.hardened_noise else variable.dtype
            lag_weights = tf.gather(tf.constant(tail, dtype), lags - 1)
            previous = tf.convert_to_tensor(variable)
            history = tf.tensordot(lag_weights, tf.cast(previous, dtype), axes=1)
            noise = (tf.cast(draw, dtype) - history) / self.coefficients[0]
            # A whole assign: per-replica (ON_READ) variables take no scatter.
            variable.assign(tf.tensor_scatter_nd_update(
                previous, slot[None, None], tf.cast(noise, variable.dtype)[None]))
            noises.append(noise)
        return noises

    def accounting_options(self):
        """The strategy's b: the sampler must keep each unit's steps b apart."""
        return {"bands": self.bands}

    def __repr__(self):
        hardened = ", hardened_noise=True" if self.hardened_noise else ""
        return f"BandedNoise(coefficients={self.coefficients!r}{hardened})"
