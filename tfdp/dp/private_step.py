"""Virtual-step DP-SGD: accumulate, noise once, normalise, update.

A logical step is one or more physical batches. Each physical batch adds its
sum of clipped per-example gradients to accumulators; at the end of the
logical step, Gaussian noise of std σ·C is added once to the total, which is
divided by the *expected* logical batch size (fixed, public; dividing by the
realised Poisson batch size would leak it), and the optimizer updates once.
"""

import tensorflow as tf

from tfdp.dp import clipping
from tfdp.dp import noise as noise_lib


class PrivateTrainStep:
    """DP-SGD train step with virtual steps.

    Args:
        model: keras.Model. Built; trained in place.
        optimizer: keras.optimizers.Optimizer. Applied once per logical step.
        per_example_loss_fn: callable. `(y_true, y_pred) -> [B]`.
        l2_norm_clip: float. Clipping bound C.
        noise_multiplier: float. σ; the noise std on the sum is σ·C.
        expected_batch_size: float. Divides the noisy sum (q·N for Poisson).
        method: str. Clipping method (see `clipped_grad_sum`). Defaults to
            "auto".
        weight_decay: float. In-loss L2 coefficient, clipped with the
            gradient. Defaults to 0.
        seed: int. Run seed; step s uses the noise seed (seed, s).
            Defaults to 0.
        jit_compile: bool. XLA-compile the physical step. Defaults to False
            (on CPU, XLA slowed every DP path).
    """

    def __init__(
        self,
        model,
        optimizer,
        per_example_loss_fn,
        *,
        l2_norm_clip,
        noise_multiplier,
        expected_batch_size,
        method="auto",
        weight_decay=0.0,
        seed=0,
        jit_compile=False,
    ):
        if not l2_norm_clip > 0:
            raise ValueError(f"l2_norm_clip must be > 0. Received: l2_norm_clip={l2_norm_clip}")
        if noise_multiplier is None or noise_multiplier < 0:
            raise ValueError(
                f"noise_multiplier must be >= 0. Received: noise_multiplier={noise_multiplier}"
            )
        if not expected_batch_size > 0:
            raise ValueError(
                f"expected_batch_size must be > 0. Received: expected_batch_size={expected_batch_size}"
            )
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = per_example_loss_fn
        self.l2_norm_clip = float(l2_norm_clip)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = float(expected_batch_size)
        self.method = clipping.resolve_method(model, method)
        self.weight_decay = float(weight_decay)
        self.seed = int(seed)
        self.variables = model.trainable_variables
        self.optimizer.build(self.variables)
        self.accumulators = [
            tf.Variable(tf.zeros_like(v), trainable=False, name="dp_accumulator")
            for v in self.variables
        ]
        self.stats = {
            name: tf.Variable(0.0, trainable=False, name=f"dp_{name}")
            for name in ("examples", "norm_sum", "clipped", "nonfinite")
        }
        self._accumulate_fn = tf.function(self._accumulate, jit_compile=jit_compile)
        self._apply_fn = tf.function(self._apply)

    def _grad_sum(self, x, y, weights):
        return clipping.clipped_grad_sum(
            self.model,
            self.loss_fn,
            x,
            y,
            l2_norm_clip=self.l2_norm_clip,
            method=self.method,
            sample_weight=weights,
            weight_decay=self.weight_decay,
        )

    def _accumulate(self, x, y, weights):
        grads, norms = self._grad_sum(x, y, weights)
        for acc, g in zip(self.accumulators, grads):
            acc.assign_add(tf.convert_to_tensor(g))
        real = tf.cast(weights > 0, tf.float32)
        finite = tf.cast(tf.math.is_finite(norms), tf.float32)
        safe_norms = tf.where(tf.math.is_finite(norms), norms, tf.zeros_like(norms))
        self.stats["examples"].assign_add(tf.reduce_sum(real))
        self.stats["norm_sum"].assign_add(tf.reduce_sum(safe_norms * real))
        self.stats["clipped"].assign_add(
            tf.reduce_sum(real * finite * tf.cast(norms > self.l2_norm_clip, tf.float32))
        )
        self.stats["nonfinite"].assign_add(tf.reduce_sum(real * (1.0 - finite)))

    def _apply(self):
        seed = noise_lib.step_seed(self.seed, self.optimizer.iterations)
        noisy = noise_lib.add_noise(
            [tf.convert_to_tensor(a) for a in self.accumulators],
            l2_norm_clip=self.l2_norm_clip,
            noise_multiplier=self.noise_multiplier,
            seed=seed,
        )
        grads = [g / self.expected_batch_size for g in noisy]
        self.optimizer.apply(grads, self.variables)
        for acc in self.accumulators:
            acc.assign(tf.zeros_like(acc))

    def accumulate(self, x, y, weights):
        """Adds one physical batch's clipped gradient sum."""
        self._accumulate_fn(x, y, weights)

    def apply(self):
        """Ends the logical step: noise once, normalise, update."""
        self._apply_fn()

    def pop_stats(self):
        """Mean norm, clipped and non-finite fractions since the last call."""
        values = {k: float(v.numpy()) for k, v in self.stats.items()}
        for v in self.stats.values():
            v.assign(0.0)
        n = max(values["examples"], 1.0)
        return {
            "examples": values["examples"],
            "mean_grad_norm": values["norm_sum"] / n,
            "clipped_fraction": values["clipped"] / n,
            "nonfinite": values["nonfinite"],
        }


class NonPrivateTrainStep(PrivateTrainStep):
    """The same virtual-step loop without clipping or noise (e.g. pretraining).

    The gradient is Σ_i w_i ∇L_i divided by the expected logical batch size,
    so with σ=0 and a huge C it equals the private step exactly.
    """

    def __init__(self, model, optimizer, per_example_loss_fn, *, expected_batch_size,
                 weight_decay=0.0, seed=0, jit_compile=False):
        super().__init__(
            model, optimizer, per_example_loss_fn,
            l2_norm_clip=1.0, noise_multiplier=0.0,
            expected_batch_size=expected_batch_size, method="naive",
            weight_decay=weight_decay, seed=seed, jit_compile=jit_compile,
        )
        self._decayed = clipping.default_weight_decay_variables(model) if weight_decay else []

    def _grad_sum(self, x, y, weights):
        with tf.GradientTape() as tape:
            losses = tf.reshape(self.loss_fn(y, self.model(x, training=True)), [-1])
            total = tf.reduce_sum(tf.cast(losses, tf.float32) * weights)
            if self._decayed:
                real = tf.reduce_sum(tf.cast(weights > 0, tf.float32))
                total += real * 0.5 * self.weight_decay * tf.add_n(
                    [tf.reduce_sum(tf.square(v)) for v in self._decayed]
                )
        grads = tape.gradient(
            total, self.variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        return grads, tf.zeros_like(weights)
