"""`DPOptimizer`: the DP-SGD hyperparameters and state of a private Keras model.

A `DPOptimizer` wraps any Keras 3 optimizer. It holds the clipping bound,
the noise multiplier, the number of virtual steps and what the privacy
accountant needs, plus the state of a logical step (gradient accumulators and
a micro-step counter). It is only a half of DP-SGD: the per-example clipping
happens in the train step of a private model (`tfdp.make_private` /
`tfdp.DPModel`), which hands it clipped gradient sums. Its own `apply` and
`apply_gradients` always raise, so that a model whose default Keras
`train_step` would apply plain (unclipped, noiseless) gradients fails loudly
instead of training non-privately.

Checkpointing: `iterations` is the wrapped optimizer's step counter, i.e. the
number of noisy updates taken. It, the accumulators and the micro-step counter
are optimizer variables, so `model.save_weights`, `ModelCheckpoint` and
`BackupAndRestore` carry them, and a resumed run reports the right epsilon.
"""

import math

import keras
import tensorflow as tf
from keras.src.utils import tracking

from tfdp import secret_key as secret_key_lib
from tfdp.dp import clipping
from tfdp.dp import noise as noise_lib

_NOT_PLAIN = (
    "DPOptimizer cannot be used as a plain optimizer: it was asked to apply "
    "gradients that were not clipped per example nor noised (this happens "
    "when a model whose `train_step` is Keras' default is compiled with a "
    "DPOptimizer). Make the model private first: "
    "`model = tfdp.make_private(model)` (or build a `tfdp.DPModel`), then "
    "compile it with the DPOptimizer."
)


@keras.saving.register_keras_serializable(package="tfdp")
class DPOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer with DP-SGD clipping, noise and virtual steps.

    Use it with a private model only:

    ```python
    model = tfdp.make_private(tfdp.models.small_convnet())
    model.compile(
        optimizer=tfdp.DPOptimizer(
            keras.optimizers.SGD(0.5, momentum=0.9),
            l2_norm_clip=1.0, noise_multiplier=1.1,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(x, y, batch_size=250, epochs=15)
    ```

    One logical (noisy) step covers `gradient_accumulation_steps` consecutive
    `fit` batches: their per-example clipped gradient sums are accumulated,
    Gaussian noise of std `noise_multiplier * l2_norm_clip` is added once, the
    result is divided by the expected logical batch size and the wrapped
    optimizer updates once. `iterations` counts these logical steps.

    Args:
        optimizer: `keras.optimizers.Optimizer` (or its identifier, e.g.
            `"sgd"`). The optimizer applied once per logical step.
        l2_norm_clip: float. Per-example clipping bound C > 0.
        noise_multiplier: float. sigma >= 0; the noise std on the clipped sum
            of a logical batch is sigma * C. This is the effective multiplier
            the accountant uses.
        gradient_accumulation_steps: int. Virtual steps k >= 1: number of
            `fit` batches per noisy update. Defaults to `1`.
        method: str. Clipping method of `tfdp.dp.clipped_grad_sum`
            (`"auto"`, `"bk"`, `"mixed"`, `"ghost"`, `"vectorized"`,
            `"naive"`). Defaults to `"auto"`.
        expected_batch_size: float or None. Divisor of the noisy sum: the
            expected logical batch size (q * N under Poisson sampling). Fixed
            and public; never the realised size. Defaults to `None`: the
            `fit` batch size times k (taken from `fit(batch_size=...)`, a
            batched `tf.data.Dataset`'s static batch dimension, Keras' default
            of 32 for arrays, or else the first batch).
        weight_decay: float. In-loss L2 coefficient on conv/dense kernels,
            clipped with the gradient (Kurakin et al. 2022). Defaults to `0`.
        insecure_reproducible_seed: int or None. INSECURE, for tests and
            reproducible research: derive the noise from this public seed.
            No epsilon holds against anyone who knows it; it warns. Defaults
            to `None`: the noise comes from a secret key drawn from the OS's
            entropy when the optimizer is created. That key is never saved
            (not in `.keras` files, weights or configs), so a run resumed
            from a Keras checkpoint continues with fresh secret noise.
        dataset_size: int or None. N, for the privacy ledger. Defaults to
            `None`: inferred by `fit` from array inputs.
        delta: float or None. Target delta of the ledger. Defaults to `None`:
            the largest power of ten below 1/N.
        sampler: str. How batches are drawn, for accounting: `"shuffle"`
            (fixed-size batches of a shuffled dataset, which is what
            `fit(x, y, shuffle=True)` does) or `"poisson"`. Defaults to
            `"shuffle"`.
        accountant: str. `"rdp"` or `"pld"` (Poisson only). Defaults to
            `"rdp"`.
        num_microbatches: must be `None`. tfdp always clips per example
            (TF-Privacy's `num_microbatches == batch_size`); use
            `gradient_accumulation_steps` for virtual steps.
        name: str or None. Optimizer name.
    """

    def __init__(
        self,
        optimizer,
        l2_norm_clip,
        noise_multiplier,
        *,
        gradient_accumulation_steps=1,
        method="auto",
        expected_batch_size=None,
        weight_decay=0.0,
        insecure_reproducible_seed=None,
        dataset_size=None,
        delta=None,
        sampler="shuffle",
        accountant="rdp",
        num_microbatches=None,
        name=None,
        **kwargs,
    ):
        if "seed" in kwargs:
            raise ValueError(
                "DPOptimizer takes no `seed`: the noise comes from a secret key "
                "drawn from the OS's entropy, so that no one who knows the "
                "configuration can subtract it. For tests only, pass "
                "`insecure_reproducible_seed=`. "
                f"Received: seed={kwargs['seed']!r}"
            )
        if kwargs:
            raise ValueError(
                "DPOptimizer does not take base optimizer arguments; set them "
                f"on the wrapped optimizer. Received: {sorted(kwargs)}"
            )
        if num_microbatches is not None:
            raise ValueError(
                "tfdp always clips per example (num_microbatches equal to the "
                "batch size). For several batches per noisy update use "
                "`gradient_accumulation_steps`. "
                f"Received: num_microbatches={num_microbatches}"
            )
        optimizer = keras.optimizers.get(optimizer)
        if isinstance(optimizer, DPOptimizer):
            raise ValueError("DPOptimizer cannot wrap another DPOptimizer.")
        if getattr(optimizer, "gradient_accumulation_steps", None):
            raise ValueError(
                "Set virtual steps on the DPOptimizer "
                "(`gradient_accumulation_steps=`), not on the wrapped "
                "optimizer, whose accumulation would average noisy updates. "
                "Received: optimizer.gradient_accumulation_steps="
                f"{optimizer.gradient_accumulation_steps}"
            )
        if not (isinstance(l2_norm_clip, (int, float)) and l2_norm_clip > 0):
            raise ValueError(
                f"l2_norm_clip must be > 0. Received: l2_norm_clip={l2_norm_clip}"
            )
        if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0):
            raise ValueError(
                "noise_multiplier must be >= 0. "
                f"Received: noise_multiplier={noise_multiplier}"
            )
        k = gradient_accumulation_steps
        if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
            raise ValueError(
                "gradient_accumulation_steps must be an int >= 1. "
                f"Received: gradient_accumulation_steps={k}"
            )
        if method not in clipping.METHODS:
            raise ValueError(
                f"Unknown clipping method. Expected one of {clipping.METHODS}. "
                f"Received: method={method!r}"
            )
        if expected_batch_size is not None and not expected_batch_size > 0:
            raise ValueError(
                "expected_batch_size must be > 0. "
                f"Received: expected_batch_size={expected_batch_size}"
            )
        if sampler not in ("shuffle", "poisson"):
            raise ValueError(
                "sampler must be 'shuffle' or 'poisson'. "
                f"Received: sampler={sampler!r}"
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = optimizer
        self.l2_norm_clip = float(l2_norm_clip)
        self.noise_multiplier = float(noise_multiplier)
        self.accumulation_steps = k
        self.method = method
        self.expected_batch_size = (
            None if expected_batch_size is None else float(expected_batch_size)
        )
        self.weight_decay = float(weight_decay)
        self.insecure_reproducible_seed = insecure_reproducible_seed
        key = secret_key_lib.SecretKey.resolve(insecure_seed=insecure_reproducible_seed)
        # A graph constant, not an optimizer variable: optimizer variables are
        # written into `.keras` files and weights, which may be released.
        self._noise_key = tf.constant(key.derive("noise"), tf.int64)
        self.dataset_size = None if dataset_size is None else int(dataset_size)
        self.delta = None if delta is None else float(delta)
        self.sampler = sampler
        self.accountant = accountant
        # Set by `DPModel.fit` from its arguments; not configuration.
        self.inferred_dataset_size = None
        # Run-time controls, deliberately not optimizer variables (so not in
        # checkpoints): the divisor actually used (0: take it from the first
        # batch) and the step cap set by `tfdp.callbacks.PrivacyBudget`
        # (-1: none).
        self._batch_size_var = tf.Variable(
            self.expected_batch_size or 0.0, trainable=False, dtype=tf.float32,
            name="dp_expected_batch_size",
        )
        self._max_steps_var = tf.Variable(
            -1, trainable=False, dtype=tf.int64, name="dp_max_steps"
        )

    # ------------------------------------------------------------------
    # Variables and delegation.
    # ------------------------------------------------------------------

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        self.micro_step = self.add_variable(
            shape=(), dtype="int", initializer="zeros", name="dp_micro_step"
        )
        self.accumulators = [
            self.add_variable_from_reference(v, name="dp_accumulator")
            for v in var_list
        ]
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def iterations(self):
        """Logical (noisy) steps taken: the wrapped optimizer's counter."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def scale_loss(self, loss):
        return loss

    # ------------------------------------------------------------------
    # Never a plain optimizer.
    # ------------------------------------------------------------------

    def apply_gradients(self, grads_and_vars):
        raise RuntimeError(_NOT_PLAIN)

    def apply(self, grads, trainable_variables=None):
        raise RuntimeError(_NOT_PLAIN)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise RuntimeError(_NOT_PLAIN)

    # ------------------------------------------------------------------
    # The DP step (called by `DPModel.train_step` only).
    # ------------------------------------------------------------------

    def _set_fit_batch_size(self, physical_batch_size):
        """Fixes the divisor for a `fit` call (eager)."""
        if self.expected_batch_size is not None:
            value = self.expected_batch_size
        elif physical_batch_size:
            value = float(physical_batch_size * self.accumulation_steps)
        else:
            value = 0.0  # Taken from the first batch in the train step.
        self._batch_size_var.assign(value)

    @property
    def logical_batch_size(self):
        """The expected logical batch size in use, or None if not known yet."""
        value = float(self._batch_size_var.numpy())
        return value if value > 0 else None

    def _dp_accumulate(self, clipped_sum, variables, batch_size):
        """Adds one batch's clipped sum; on the k-th batch, noise and update.

        Runs inside the model's (traced) train step.
        """
        if not self.built:
            raise RuntimeError(
                "DPOptimizer is not built; it is built by `fit` (or call "
                "`optimizer.build(model.trainable_variables)`)."
            )
        for acc, g in zip(self.accumulators, clipped_sum):
            acc.assign_add(tf.cast(g, acc.dtype))
        self.micro_step.assign_add(1)
        ebs = self._batch_size_var
        tf.cond(
            ebs > 0,
            lambda: tf.constant(0.0),
            lambda: ebs.assign(
                tf.cast(batch_size * self.accumulation_steps, tf.float32)
            ),
        )
        step = tf.cast(self.iterations, tf.int64)
        allowed = tf.logical_or(self._max_steps_var < 0, step < self._max_steps_var)

        def update():
            seed = noise_lib.step_seed(self._noise_key, step)
            noisy = noise_lib.add_noise(
                [tf.convert_to_tensor(a) for a in self.accumulators],
                l2_norm_clip=self.l2_norm_clip,
                noise_multiplier=self.noise_multiplier,
                seed=seed,
            )
            divisor = tf.convert_to_tensor(ebs)
            self.inner_optimizer.apply(
                [g / tf.cast(divisor, g.dtype) for g in noisy], variables
            )
            return tf.constant(True)

        def end_logical_step():
            # Over budget: the logical step is dropped (nothing released).
            tf.cond(allowed, update, lambda: tf.constant(False))
            for acc in self.accumulators:
                acc.assign(tf.zeros_like(acc))
            self.micro_step.assign(0)
            return tf.constant(True)

        tf.cond(
            tf.cast(self.micro_step, tf.int64) >= self.accumulation_steps,
            end_logical_step,
            lambda: tf.constant(False),
        )

    # ------------------------------------------------------------------
    # Privacy accounting.
    # ------------------------------------------------------------------

    def ledger(self, *, dataset_size=None, delta=None, steps=None):
        """The `tfdp.privacy.PrivacyLedger` of this run so far.

        Args:
            dataset_size: int or None. Overrides the configured/inferred N.
            delta: float or None. Overrides the configured delta.
            steps: int or None. Defaults to `iterations` (noisy updates).

        Returns:
            A `PrivacyLedger` whose `epsilon()` is epsilon after `steps`.
        """
        from tfdp import privacy

        n = dataset_size or self.dataset_size or self.inferred_dataset_size
        if not n:
            raise ValueError(
                "The privacy ledger needs the dataset size N. Pass "
                "`dataset_size=` to the DPOptimizer or the callback (it is "
                "only inferred when `fit` is given arrays)."
            )
        batch = self.logical_batch_size
        if batch is None:
            raise ValueError(
                "The privacy ledger needs the logical batch size; pass "
                "`expected_batch_size=` to the DPOptimizer, or "
                "`batch_size=` to `fit`, or a dataset with a static batch size."
            )
        delta = delta or self.delta or default_delta(n)
        if steps is None:
            steps = int(self.iterations.numpy())
        batch = int(round(batch))
        return privacy.PrivacyLedger(
            self.noise_multiplier,
            min(1.0, batch / n) if self.sampler == "poisson" else None,
            delta=delta,
            steps=steps,
            sampler=self.sampler,
            accountant=self.accountant,
            dataset_size=int(n),
            batch_size=min(batch, int(n)),
        )

    # ------------------------------------------------------------------
    # Serialisation.
    # ------------------------------------------------------------------

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "gradient_accumulation_steps": self.accumulation_steps,
            "method": self.method,
            "expected_batch_size": self.expected_batch_size,
            "weight_decay": self.weight_decay,
            "insecure_reproducible_seed": self.insecure_reproducible_seed,
            "dataset_size": self.dataset_size,
            "delta": self.delta,
            "sampler": self.sampler,
            "accountant": self.accountant,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        # Files saved before the noise became secret hold a public `seed`;
        # the restored optimizer draws a fresh secret key instead.
        config.pop("seed", None)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(optimizer, **config)


def default_delta(dataset_size):
    """The largest power of ten strictly below 1/N."""
    return 10.0 ** -(math.floor(math.log10(dataset_size)) + 1)
