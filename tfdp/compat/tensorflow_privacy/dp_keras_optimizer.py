"""TF-Privacy's `DPKeras*Optimizer` classes, as `tfdp.DPOptimizer`s.

TF-Privacy's Keras optimizers take `l2_norm_clip`, `noise_multiplier`,
`num_microbatches`, `gradient_accumulation_steps` and then the wrapped
optimizer's own arguments. Each step they split the per-example loss vector
into `num_microbatches` consecutive microbatches, clip each microbatch's mean
gradient to `l2_norm_clip`, add Gaussian noise of std
`l2_norm_clip * noise_multiplier` to the sum and divide by the number of
microbatches. Here the clipping runs on tfdp's engine (book-keeping, or
whatever `method="auto"` picks) and the noise is tfdp's.

Keras 3 optimizers never see the loss vector (Keras 2 handed it to
`minimize`), so a plain Keras model compiled with one of these optimizers is
made private at its first train step: the optimizer recognises Keras' own
`train_step` as its caller, takes the batch from it and runs tfdp's DP update
in place of the plain gradients, which are discarded. A model with its own
`train_step` gets an error naming the fix.
"""

import math
import sys

import keras
from keras.src.backend.tensorflow import trainer as keras_tf_trainer

from tfdp import validation
from tfdp.compat.tensorflow_privacy import native_route
from tfdp.keras import DPOptimizer
from tfdp.keras import dp_model as dp_model_lib

# Keras' stock TensorFlow train step: the only caller whose locals
# (`self`, `x`, `y`, `sample_weight`) this module reads.
_KERAS_TRAIN_STEP = keras_tf_trainer.TensorFlowTrainer.train_step.__code__

_PER_EXAMPLE_REDUCTIONS = (None, "none")


def validate_arguments(l2_norm_clip, noise_multiplier, num_microbatches=None,
                       gradient_accumulation_steps=1):
    """Raises a ValueError naming the first invalid TF-Privacy argument."""
    validation.validate_l2_norm_clip(l2_norm_clip)
    validation.validate_noise_multiplier(noise_multiplier)
    if num_microbatches is not None and (
        isinstance(num_microbatches, bool)
        or not isinstance(num_microbatches, int)
        or num_microbatches < 1
    ):
        raise ValueError(
            "num_microbatches must be None or an int >= 1. "
            f"Received: num_microbatches={num_microbatches!r}"
        )
    k = gradient_accumulation_steps
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(
            "gradient_accumulation_steps must be an int >= 1. "
            f"Received: gradient_accumulation_steps={k!r}"
        )


@keras.saving.register_keras_serializable(package="tfdp.compat")
class DPKerasOptimizer(DPOptimizer):
    """A `tfdp.DPOptimizer` with TF-Privacy's arguments and semantics.

    Usually built through `DPKerasSGDOptimizer`, `DPKerasAdamOptimizer` or
    `DPKerasAdagradOptimizer`. Compile it into a plain Keras model (as in
    TF-Privacy, with a per-example loss, `reduction="none"`) or into a
    `tfdp.make_private` model.

    - Microbatches: a batch of `B` rows is split into `num_microbatches`
      consecutive groups; each group's mean gradient is clipped.
    - Noise: std `l2_norm_clip * noise_multiplier` on the clipped sum,
      which is divided by the number of microbatches (the batch size when
      `num_microbatches` is None).
    - `gradient_accumulation_steps=k`: TF-Privacy noised each of the k
      steps and applied their mean. tfdp adds noise once per update, so the
      same update distribution is obtained with noise multiplier
      `noise_multiplier * sqrt(k)` on the sum of the k batches, divided by
      k times the per-step divisor. `noise_multiplier` (the attribute) is
      that effective multiplier, and it is what the ledger accounts. A
      logical step never spans two epochs, which needs a private model's
      `fit`: a plain Keras model refuses k > 1.
    - Batches: fixed-size shuffled ones, accounted once per pass
      (`sampler="shuffle"`); a private model's `fit` on arrays takes N // B
      full batches per pass in a secret random order.

    Args:
        optimizer: `keras.optimizers.Optimizer`. Applied once per update.
        l2_norm_clip: float. Clipping bound C > 0 of each microbatch's mean
            gradient.
        noise_multiplier: float. sigma >= 0 of each step, as in TF-Privacy.
        num_microbatches: int or None. Microbatches per batch; the batch
            size must be a multiple of it. Defaults to `None`: one per
            example.
        gradient_accumulation_steps: int. Batches per update, k >= 1.
            Defaults to `1`.
        name: str or None. Optimizer name.
    """

    def __init__(
        self,
        optimizer,
        l2_norm_clip,
        noise_multiplier,
        num_microbatches=None,
        gradient_accumulation_steps=1,
        name=None,
    ):
        native_route.log_native_route_once()
        validate_arguments(
            l2_norm_clip, noise_multiplier, num_microbatches, gradient_accumulation_steps
        )
        k = gradient_accumulation_steps
        # TF-Privacy's batches are Keras' fixed-size shuffled ones: the
        # shuffle sampler's route, accounted once per pass.
        super().__init__(
            optimizer,
            l2_norm_clip,
            float(noise_multiplier) * math.sqrt(k),
            gradient_accumulation_steps=k,
            sampler="shuffle",
            name=name,
        )
        # TF-Privacy divides by the number of microbatches, not examples.
        self._noise_divisor = None if num_microbatches is None else num_microbatches * k
        self.num_microbatches = num_microbatches
        # TF-Privacy's own attribute names, read by some user code.
        self._l2_norm_clip = self.l2_norm_clip
        self._noise_multiplier = float(noise_multiplier)
        self._num_microbatches = num_microbatches

    # ------------------------------------------------------------------
    # A plain Keras model compiled with this optimizer.
    # ------------------------------------------------------------------

    def apply_gradients(self, grads_and_vars):
        """Runs tfdp's DP update for Keras' stock `train_step`; else raises.

        The gradients Keras computed (of the reduced loss) are not used:
        they are neither clipped nor noised.
        """
        caller = sys._getframe(1)
        model = caller.f_locals.get("self")
        if (
            caller.f_code is not _KERAS_TRAIN_STEP
            or not isinstance(model, keras.Model)
            or getattr(model, "optimizer", None) is not self
        ):
            raise RuntimeError(
                "A TF-Privacy optimizer was asked to apply gradients that were "
                "not computed per microbatch (a custom `train_step`, or a call "
                "outside `fit`). Keras 3 optimizers never see the per-example "
                "loss, so only Keras' own `train_step` is supported. Use "
                "`tfdp.make_private(model)` (or "
                "tfdp.compat.tensorflow_privacy.DPModel / DPSequential) instead."
            )
        _check_per_example_loss(model.loss)
        if self.accumulation_steps > 1:
            # Keras' own fit gives no hook at epoch starts, so a logical step
            # could span two epochs and hold an example twice.
            raise ValueError(
                "gradient_accumulation_steps > 1 needs a private model's fit, which "
                "keeps each logical step inside one epoch: use "
                "`tfdp.make_private(model)` (compiled with this optimizer) or "
                "tensorflow_privacy.DPSequential / DPModel. Received: "
                f"gradient_accumulation_steps={self.accumulation_steps} on a plain "
                "Keras model"
            )
        x = caller.f_locals["x"]
        # Traced once per `fit` train function: fixes the divisor and the key.
        physical = _fit_batch_size(x)
        self.plan_fit(arrays=False, physical_batch_size=physical)
        if (
            self.num_microbatches is not None
            and getattr(x, "shape", (None,))[0] is None
            and model.jit_compile
        ):
            # The batch-size assertion that guards microbatching is dropped
            # by XLA; refuse rather than clip with the wrong grouping.
            raise ValueError(
                "num_microbatches with XLA needs a static batch size, which "
                "Keras did not trace here. Compile with `jit_compile=False`, or "
                "use tensorflow_privacy.DPSequential / DPModel. Received: "
                f"num_microbatches={self.num_microbatches}, jit_compile=True"
            )
        compile_config = getattr(model, "_compile_config", None)
        loss_weights = compile_config.config.get("loss_weights") if compile_config else None
        loss_fn = dp_model_lib.per_example_loss_fn(model.loss, loss_weights)
        dp_model_lib.private_update(
            model, self, loss_fn, x, caller.f_locals["y"], caller.f_locals["sample_weight"],
            physical_batch_size=physical,
        )

    # ------------------------------------------------------------------
    # Accounting and serialisation.
    # ------------------------------------------------------------------

    def ledger(self, **kwargs):
        """The run's `tfdp.privacy.PrivacyLedger` (per-example clipping only).

        With microbatches of several examples the sensitivity doubles under
        add/remove adjacency, which the ledger does not model, so this raises
        when `num_microbatches` is set; use `compute_dp_sgd_privacy_statement`
        with `used_microbatching=True` then.
        """
        if self.num_microbatches is not None:
            raise NotImplementedError(
                "The tfdp ledger accounts per-example clipping; with "
                "num_microbatches set, use tfdp.compat.tensorflow_privacy."
                "compute_dp_sgd_privacy_statement(..., used_microbatching=True). "
                f"Received: num_microbatches={self.num_microbatches}"
            )
        return super().ledger(**kwargs)

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self._noise_multiplier,
            "num_microbatches": self.num_microbatches,
            "gradient_accumulation_steps": self.accumulation_steps,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return DPKerasOptimizer(optimizer, **config)


def _fit_batch_size(x):
    """The `fit` batch size of a plain model's train step (at trace time).

    The traced batch dimension when static, else the batch size of the data
    adapter of the `fit` call on the stack (Keras traces a dynamic one when
    N is not a multiple of it). TF-Privacy divided by the batch size too.
    """
    static = getattr(x, "shape", (None,))[0]
    if static:
        return int(static)
    adapter = getattr(dp_model_lib.keras_fit_epoch_iterator(), "data_adapter", None)
    size = getattr(adapter, "batch_size", None)
    if size:
        return int(size)
    raise ValueError(
        "The batch size of this fit is unknown, and it is the divisor of the "
        "noisy sum. Pass `batch_size=` to fit or use a dataset with a static "
        "batch dimension. Received: x with a dynamic batch dimension"
    )


def _check_per_example_loss(loss):
    """TF-Privacy's optimizers need `reduction=NONE`; so do these."""
    reduction = getattr(loss, "reduction", None)
    if isinstance(loss, str) or (
        isinstance(loss, keras.losses.Loss) and reduction not in _PER_EXAMPLE_REDUCTIONS
    ):
        raise ValueError(
            "TF-Privacy's Keras optimizers take a per-example loss vector: "
            "build the loss with `reduction=tf.keras.losses.Reduction.NONE` "
            "(or `reduction=None`), e.g. `keras.losses.CategoricalCrossentropy("
            "from_logits=True, reduction=None)`. TF-Privacy failed on a reduced "
            f"loss as well. Received: loss={loss!r} (reduction={reduction!r})"
        )


def make_keras_optimizer_class(cls):
    """Returns TF-Privacy's `DPKeras<cls>` for a Keras optimizer class.

    The class takes `(l2_norm_clip, noise_multiplier, num_microbatches=None,
    gradient_accumulation_steps=1, *args, **kwargs)`; `args` and `kwargs` go
    to `cls`.

    Args:
        cls: a `keras.optimizers.Optimizer` subclass.

    Returns:
        A `DPKerasOptimizer` subclass named `DPKeras<cls.__name__>`.
    """
    if not (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)):
        raise ValueError(
            f"Expected a keras.optimizers.Optimizer subclass. Received: cls={cls!r}"
        )

    def __init__(
        self,
        l2_norm_clip,
        noise_multiplier,
        num_microbatches=None,
        gradient_accumulation_steps=1,
        *args,
        **kwargs,
    ):
        DPKerasOptimizer.__init__(
            self,
            cls(*args, **kwargs),
            l2_norm_clip,
            noise_multiplier,
            num_microbatches=num_microbatches,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=kwargs.get("name"),
        )

    def get_config(self):
        config = self.inner_optimizer.get_config()
        config.update(
            l2_norm_clip=self.l2_norm_clip,
            noise_multiplier=self._noise_multiplier,
            num_microbatches=self.num_microbatches,
            gradient_accumulation_steps=self.accumulation_steps,
        )
        return config

    @classmethod
    def from_config(klass, config, custom_objects=None):
        config = dict(config)
        if isinstance(config.get("learning_rate"), dict):
            config["learning_rate"] = keras.saving.deserialize_keras_object(
                config["learning_rate"], custom_objects=custom_objects
            )
        return klass(**config)

    name = f"DPKeras{cls.__name__}Optimizer"
    doc = (
        f"TF-Privacy's `{name}`: `keras.optimizers.{cls.__name__}` with DP-SGD.\n\n"
        f"`{name}(l2_norm_clip, noise_multiplier, num_microbatches=None,\n"
        "gradient_accumulation_steps=1, **optimizer_kwargs)`. Compile it into a\n"
        "Keras model with a per-example loss (`reduction=None`) and call `fit`.\n"
        "See `DPKerasOptimizer` for the semantics.\n"
    )
    klass = type(
        name,
        (DPKerasOptimizer,),
        {
            "__init__": __init__,
            "get_config": get_config,
            "from_config": from_config,
            "__doc__": doc,
            "__module__": __name__,
            "__qualname__": name,
        },
    )
    return keras.saving.register_keras_serializable(package="tfdp.compat")(klass)


DPKerasSGDOptimizer = make_keras_optimizer_class(keras.optimizers.SGD)
DPKerasAdamOptimizer = make_keras_optimizer_class(keras.optimizers.Adam)
DPKerasAdagradOptimizer = make_keras_optimizer_class(keras.optimizers.Adagrad)

# TF-Privacy's vectorized variants differ only in how they compute the
# microbatch gradients; tfdp's engine is already batched.
make_vectorized_keras_optimizer_class = make_keras_optimizer_class
VectorizedDPKerasSGDOptimizer = DPKerasSGDOptimizer
VectorizedDPKerasAdamOptimizer = DPKerasAdamOptimizer
VectorizedDPKerasAdagradOptimizer = DPKerasAdagradOptimizer
