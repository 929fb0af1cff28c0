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
`minimize`), nor the model or the batch: Keras' `train_step` hands them the
gradients of the reduced loss only, which cannot be clipped per example. So
the model is made private, with one line before `compile`:

```python
model = tfdp.make_private(model)   # the DP train step; the optimizer is unchanged
model.compile(optimizer=DPKerasSGDOptimizer(...), loss=..., metrics=[...])
```

A plain Keras model compiled with one of these optimizers gets an error
naming that fix at its first train step, before any update.

`DPKerasOptimizer` takes TF-Privacy's microbatches from `microbatches` and
its custom-loop methods (and the refusal of plain gradients) from
`custom_loop_methods`; `make_keras_optimizer_class` makes the
`DPKeras<cls>` classes from it.
"""

import math

import keras
import tensorflow as tf

from tfdp import dpsgd_config
from tfdp import validation
from tfdp.compat.tensorflow_privacy import native_route
from tfdp.compat.tensorflow_privacy.custom_loop_methods import CustomLoopMethods
from tfdp.compat.tensorflow_privacy.microbatches import Microbatches
from tfdp.keras import DPOptimizer
from tfdp.keras import dp_optimizer

# Raised when a TF-Privacy optimizer is asked to apply gradients it did not
# noise: `apply_gradients` and `apply` take only the noised gradients that
# `_compute_gradients` has just returned (once), and the wrapped optimizer
# takes only releases. The Keras engine's class (one class, so that code
# catching either name catches every refusal): a `RuntimeError`, tfdp's error
# for an operation that cannot be made private, and an `AssertionError`, the
# error TF-Privacy's optimizers raise without their DP gradients.
PlainGradientsError = dp_optimizer.PlainGradientsError


def validate_arguments(l2_norm_clip, noise_multiplier, num_microbatches=None,
                       gradient_accumulation_steps=1, hardened_noise=False):
    """TF-Privacy's arguments as a privacy request, or a ValueError naming the first invalid one.

    C, σ and `hardened_noise` are validated by `tfdp.DPSGDConfig`, as on
    every route.

    Returns:
        A `tfdp.DPSGDConfig` of C, σ (TF-Privacy's, of each step) and
        `hardened_noise`.
    """
    if noise_multiplier is None:
        # TF-Privacy has no target ε to calibrate σ from: σ is required.
        validation.validate_noise_multiplier(noise_multiplier)
    request = dpsgd_config.DPSGDConfig(l2_norm_clip, noise_multiplier,
                                       hardened_noise=hardened_noise)
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
    return request


@keras.saving.register_keras_serializable(package="tfdp.compat")
class DPKerasOptimizer(CustomLoopMethods, Microbatches, DPOptimizer):
    """A `tfdp.DPOptimizer` with TF-Privacy's arguments and semantics.

    Usually built through `DPKerasSGDOptimizer`, `DPKerasAdamOptimizer` or
    `DPKerasAdagradOptimizer`. Compile it into a `tfdp.make_private(model)`
    model (any loss reduction; the per-example loss comes from it); a plain
    Keras model refuses it at its first train step, naming that fix.

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
      that effective multiplier, and it is what the ledger accounts
      (`tf_privacy_noise_multiplier` is TF-Privacy's). A logical step never
      spans two epochs.
    - Batches: fixed-size shuffled ones, accounted once per pass
      (`sampler="shuffle"`); a private model's `fit` on arrays takes N // B
      full batches per pass in a secret random order.
    - Accounting: `ledger()` and `describe_epsilon()` account the batches
      `fit` really drew, under zero-out adjacency. With microbatches of
      several examples one example moves its microbatch's clipped mean
      from one vector of norm <= C to another, by up to 2C, so the ledger
      has sensitivity 2 and accounts noise multiplier sigma / 2, as
      TF-Privacy's statement does with `used_microbatching=True`.

    - Custom training loops: `minimize(loss, var_list, tape=tape)` and
      `_compute_gradients(loss, var_list, tape=tape)` take TF-Privacy's
      vector of per-example losses (or a callable returning it); see
      `tfdp.compat.tensorflow_privacy.custom_loop` for their accounting
      (`ledger(dataset_size=N)`).

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
        unconnected_gradients_to_zero: bool. In a custom loop, variables the
            loss does not reach get zero gradients instead of an error.
            Defaults to `False`.
        name: str or None. Optimizer name.
        hardened_noise: bool. tfdp's noise hardened against floating-point
            attacks (`tfdp.DPOptimizer`'s; TF-Privacy has none). Defaults to
            `False`.
    """

    def __init__(
        self,
        optimizer,
        l2_norm_clip,
        noise_multiplier,
        num_microbatches=None,
        gradient_accumulation_steps=1,
        unconnected_gradients_to_zero=False,
        name=None,
        *,
        hardened_noise=False,
    ):
        native_route.log_native_route_once()
        validate_arguments(
            l2_norm_clip, noise_multiplier, num_microbatches, gradient_accumulation_steps,
            hardened_noise,
        )
        k = gradient_accumulation_steps
        # TF-Privacy's batches are Keras' fixed-size shuffled ones: the
        # shuffle sampler's route, accounted once per pass.
        super().__init__(
            optimizer,
            l2_norm_clip,
            float(noise_multiplier) * self.accumulation_noise_scale(k),
            gradient_accumulation_steps=k,
            sampler="shuffle",
            hardened_noise=hardened_noise,
            name=name,
        )
        # TF-Privacy divides by the number of microbatches, not examples.
        self.mechanism_builder.set_noise_divisor(
            None if num_microbatches is None else num_microbatches * k)
        self.num_microbatches = num_microbatches
        self.unconnected_gradients_to_zero = bool(unconnected_gradients_to_zero)
        # The batch size of a custom loop, fixed by its first call.
        self.custom_loop_rows = None
        # The noised gradients `_compute_gradients` last returned, until applied.
        self.released_gradients = None
        # The model and loss a custom loop trains (`declare_model`), probed
        # before its first release.
        self.declared_model = None

    @staticmethod
    def accumulation_noise_scale(k):
        """√k: the one noise of an update of k batches stands for TF-Privacy's k noises.

        A subclass whose update releases noise of another structure (DP-FTRL's
        tree leaves) overrides it.
        """
        return math.sqrt(k)

    @property
    def tf_privacy_noise_multiplier(self):
        """TF-Privacy's σ of each of the k accumulated batches (σ of the ledger / √k)."""
        return self.noise_multiplier / self.accumulation_noise_scale(self.accumulation_steps)

    # TF-Privacy's own attribute names, read by some user code; they read
    # the mechanism, as every other figure does.
    _l2_norm_clip = property(lambda self: self.l2_norm_clip)
    _noise_multiplier = property(lambda self: self.tf_privacy_noise_multiplier)
    _num_microbatches = property(lambda self: self.num_microbatches)

    # ------------------------------------------------------------------
    # Layer weight regularizers, as TF-Privacy's DP models apply them.
    # ------------------------------------------------------------------

    applies_weight_regularizers = True

    def final_gradients(self, noisy_mean, variables):
        """The noisy mean plus the gradient of the layers' weight regularizers.

        As TF-Privacy's `DPModel`: the regularization loss is left out of the
        clipped per-example loss and its gradient is added to the noisy mean.
        It depends on the weights only, never on the data, so it adds no
        sensitivity (an activity regularizer, which would, is refused).
        """
        regularized = [(i, v) for i, v in enumerate(variables)
                       if getattr(v, "regularizer", None) is not None]
        if not regularized:
            return noisy_mean
        with tf.GradientTape() as tape:
            penalties = [v.regularizer(v) for _, v in regularized]
        grads = tape.gradient(penalties, [v for _, v in regularized])
        context = tf.distribute.get_replica_context()
        # Each replica's share; the wrapped optimizer's all-reduce sums them.
        replicas = 1 if context is None else context.num_replicas_in_sync
        grads_out = list(noisy_mean)
        for (i, _), grad in zip(regularized, grads):
            grads_out[i] = grads_out[i] + tf.cast(grad, grads_out[i].dtype) / replicas
        return grads_out

    # ------------------------------------------------------------------
    # Serialisation.
    # ------------------------------------------------------------------

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.tf_privacy_noise_multiplier,
            "num_microbatches": self.num_microbatches,
            "gradient_accumulation_steps": self.accumulation_steps,
            "unconnected_gradients_to_zero": self.unconnected_gradients_to_zero,
            "hardened_noise": self.hardened_noise,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return DPKerasOptimizer(optimizer, **config)


def flat_config(optimizer, **extra):
    """TF-Privacy's config of a `DPKeras<cls>` optimizer: the wrapped optimizer's, then its own.

    Args:
        optimizer: `DPKerasOptimizer`.
        **extra: further constructor arguments of a subclass.
    """
    config = optimizer.inner_optimizer.get_config()
    config.update(
        l2_norm_clip=optimizer.l2_norm_clip,
        noise_multiplier=optimizer.tf_privacy_noise_multiplier,
        num_microbatches=optimizer.num_microbatches,
        gradient_accumulation_steps=optimizer.accumulation_steps,
        unconnected_gradients_to_zero=optimizer.unconnected_gradients_to_zero,
        hardened_noise=optimizer.hardened_noise,
        **extra,
    )
    return config


def from_flat_config(klass, config, custom_objects=None):
    """The optimizer of class `klass` from `flat_config`'s dict."""
    config = dict(config)
    if isinstance(config.get("learning_rate"), dict):
        config["learning_rate"] = keras.saving.deserialize_keras_object(
            config["learning_rate"], custom_objects=custom_objects
        )
    return klass(**config)


def make_keras_optimizer_class(cls):
    """Returns TF-Privacy's `DPKeras<cls>` for a Keras optimizer class.

    The class takes `(l2_norm_clip, noise_multiplier, num_microbatches=None,
    gradient_accumulation_steps=1, *args, unconnected_gradients_to_zero=False,
    hardened_noise=False, **kwargs)`; `args` and `kwargs` go to `cls`.

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
        unconnected_gradients_to_zero=False,
        hardened_noise=False,
        **kwargs,
    ):
        DPKerasOptimizer.__init__(
            self,
            cls(*args, **kwargs),
            l2_norm_clip,
            noise_multiplier,
            num_microbatches=num_microbatches,
            gradient_accumulation_steps=gradient_accumulation_steps,
            unconnected_gradients_to_zero=unconnected_gradients_to_zero,
            name=kwargs.get("name"),
            hardened_noise=hardened_noise,
        )

    def get_config(self):
        return flat_config(self)

    @classmethod
    def from_config(klass, config, custom_objects=None):
        return from_flat_config(klass, config, custom_objects)

    name = f"DPKeras{cls.__name__}Optimizer"
    doc = (
        f"TF-Privacy's `{name}`: `keras.optimizers.{cls.__name__}` with DP-SGD.\n\n"
        f"`{name}(l2_norm_clip, noise_multiplier, num_microbatches=None,\n"
        "gradient_accumulation_steps=1, unconnected_gradients_to_zero=False,\n"
        "hardened_noise=False, **optimizer_kwargs)`. Compile it into\n"
        "`tfdp.make_private(model)` and call `fit`, or call\n"
        "`minimize(loss, var_list, tape=tape)` in a custom loop. See\n"
        "`DPKerasOptimizer` for the semantics.\n"
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
