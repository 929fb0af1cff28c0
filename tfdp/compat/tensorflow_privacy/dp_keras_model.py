"""TF-Privacy's `DPModel` and `DPSequential`, as `tfdp.DPModel`s.

TF-Privacy's DP models hold the DP-SGD hyperparameters themselves and are
compiled with a plain optimizer and an ordinary (reduced) loss; each
microbatch's mean gradient is clipped, Gaussian noise of std
`l2_norm_clip * noise_multiplier` is added to the sum, and the sum is
divided by the number of microbatches. Here the model wraps a Keras model
in a `tfdp.DPModel`, and `compile` wraps the plain optimizer in a
`DPKerasOptimizer` with the model's settings.
"""

import keras

from tfdp.compat.tensorflow_privacy import native_route
from tfdp.compat.tensorflow_privacy import packed_io
from tfdp.compat.tensorflow_privacy.dp_keras_optimizer import DPKerasOptimizer
from tfdp.compat.tensorflow_privacy.dp_keras_optimizer import validate_arguments
from tfdp.keras import DPModel as NativeDPModel
from tfdp.keras import DPOptimizer


@keras.saving.register_keras_serializable(package="tfdp.compat")
class DPModel(NativeDPModel):
    """TF-Privacy's `DPModel`: a Functional Keras model trained with DP-SGD.

    ```python
    inputs = keras.Input((28, 28, 1))
    outputs = keras.layers.Dense(10)(keras.layers.Flatten()(inputs))
    model = DPModel(l2_norm_clip=1.0, noise_multiplier=1.1,
                    inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=250, epochs=15)
    ```

    Compile it with a plain optimizer (not a DP one) and any loss; the loss
    reduction does not matter.

    Args:
        l2_norm_clip: float. Clipping bound C > 0 of each microbatch's mean
            gradient.
        noise_multiplier: float. sigma >= 0; noise std on the clipped sum
            is sigma * C, and the sum is divided by the number of
            microbatches.
        num_microbatches: int or None. Microbatches per batch (the batch
            size must be a multiple). Defaults to `None`: one per example.
        use_xla: bool. Accepted for compatibility; tfdp compiles with
            `jit_compile=False` unless `compile(jit_compile=True)`.
            Defaults to `True`.
        layer_registry: Accepted for compatibility and ignored: tfdp's
            engine covers Conv2D, Dense, Embedding and normalisation layers
            itself.
        model: `keras.Model` or None. An existing model to wrap instead of
            building one from `*args` / `**kwargs`. Defaults to `None`.
        hardened_noise: bool. tfdp's noise hardened against floating-point
            attacks (`tfdp.DPOptimizer`'s; TF-Privacy has none). Defaults to
            `False`.
        *args: passed to `keras.Model` (e.g. `inputs`, `outputs`).
        **kwargs: passed to `keras.Model`.
    """

    _inner_model_class = keras.Model

    def __init__(
        self,
        l2_norm_clip,
        noise_multiplier,
        num_microbatches=None,
        use_xla=True,
        layer_registry=None,
        *args,
        model=None,
        hardened_noise=False,
        **kwargs,
    ):
        native_route.log_native_route_once()
        if isinstance(num_microbatches, bool):
            raise ValueError(
                "Boolean value supplied for `num_microbatches`; did you mean "
                f"`use_xla`? Received: num_microbatches={num_microbatches}"
            )
        if model is None:
            if self._inner_model_class is keras.Model and "outputs" not in kwargs and len(args) < 2:
                raise ValueError(
                    "tfdp.compat's DPModel wraps a Functional model: pass "
                    "`inputs=` and `outputs=` (or `model=`). To subclass, "
                    "subclass keras.Model and use `tfdp.make_private(model)`."
                )
            model = self._inner_model_class(*args, **kwargs)
        # Several named inputs or outputs: one packed tensor each on the
        # private route (`packed_io`), as TF-Privacy's DPModel trains them.
        self.packing = packed_io.PackedIO(model) if packed_io.PackedIO.needed(model) else None
        self.unpacked_model = model
        if self.packing is not None:
            model = self.packing.packed_model()
        # C and σ live in this request alone (validated there), until
        # `compile` hands them to the optimizer it wraps.
        self.privacy_request = validate_arguments(l2_norm_clip, noise_multiplier,
                                                  num_microbatches,
                                                  hardened_noise=hardened_noise)
        super().__init__(model)
        self._num_microbatches = num_microbatches
        self._use_xla = bool(use_xla)

    @property
    def l2_norm_clip(self):
        """C, of the model's privacy request."""
        return self.privacy_request.l2_norm_clip

    @property
    def noise_multiplier(self):
        """σ of each step, as TF-Privacy's (the request's)."""
        return self.privacy_request.noise_multiplier

    @property
    def hardened_noise(self):
        """Whether the noise is hardened against floating-point attacks (the request's)."""
        return self.privacy_request.hardened_noise

    def compile(self, optimizer="rmsprop", loss=None, **kwargs):
        """Compiles with a plain optimizer, wrapped with this model's DP settings.

        With several outputs, `loss` and `loss_weights` may be dicts (or
        lists) by output: the loss of one example is Σ_k w_k · loss_k.
        """
        if self.packing is not None and not isinstance(loss, packed_io.PackedLoss):
            if kwargs.get("metrics") or kwargs.get("weighted_metrics"):
                raise ValueError(
                    "Metrics of a model with several outputs are not supported on the "
                    "private route; evaluate `model.unpacked_model` with them. Received: "
                    f"metrics={kwargs.get('metrics') or kwargs.get('weighted_metrics')!r}")
            loss = self.packing.loss(loss, kwargs.pop("loss_weights", None))
        if self._owns(optimizer):
            wrapped = optimizer  # Our own wrapper: a re-compile, or a load.
        else:
            optimizer = keras.optimizers.get(optimizer)
            if isinstance(optimizer, DPOptimizer):
                raise ValueError(
                    "A DPModel / DPSequential clips and noises itself: compile "
                    "it with a plain Keras optimizer, as in TF-Privacy. "
                    f"Received: optimizer={optimizer!r}"
                )
            wrapped = DPKerasOptimizer(
                optimizer,
                self.l2_norm_clip,
                self.noise_multiplier,
                num_microbatches=self._num_microbatches,
                hardened_noise=self.hardened_noise,
            )
        super().compile(optimizer=wrapped, loss=loss, **kwargs)

    def fit(self, x=None, y=None, *args, validation_data=None, **kwargs):
        """`DPModel.fit`; dicts (or lists) of inputs and targets are packed first."""
        if self.packing is not None:
            x, y = self.packing.pack_inputs(x), self.packing.pack_targets(y)
            if validation_data is not None:
                vx, vy = validation_data[:2]
                validation_data = (self.packing.pack_inputs(vx), self.packing.pack_targets(vy))
        return super().fit(x, y, *args, validation_data=validation_data, **kwargs)

    def evaluate(self, x=None, y=None, *args, **kwargs):
        if self.packing is not None:
            x, y = self.packing.pack_inputs(x), self.packing.pack_targets(y)
        return super().evaluate(x, y, *args, **kwargs)

    def predict(self, x, *args, **kwargs):
        if self.packing is None:
            return super().predict(x, *args, **kwargs)
        return self.packing.unpack_outputs(
            super().predict(self.packing.pack_inputs(x), *args, **kwargs))

    def _owns(self, optimizer):
        """Whether `optimizer` is the wrapper `compile` makes for this model."""
        return (
            type(optimizer) is DPKerasOptimizer
            and optimizer.l2_norm_clip == self.l2_norm_clip
            and optimizer.tf_privacy_noise_multiplier == self.noise_multiplier
            and optimizer.num_microbatches == self._num_microbatches
            and optimizer.accumulation_steps == 1
            and optimizer.hardened_noise == self.hardened_noise
        )

    def get_config(self):
        config = super().get_config()
        # The user's model: packing is redone on load.
        config["model"] = keras.saving.serialize_keras_object(self.unpacked_model)
        config.update(
            l2_norm_clip=self.l2_norm_clip,
            noise_multiplier=self.noise_multiplier,
            num_microbatches=self._num_microbatches,
            use_xla=self._use_xla,
            hardened_noise=self.hardened_noise,
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(
            config.pop("model"), custom_objects=custom_objects
        )
        config.pop("name", None)
        return cls(model=model, **config)


@keras.saving.register_keras_serializable(package="tfdp.compat")
class DPSequential(DPModel):
    """TF-Privacy's `DPSequential`: a Sequential Keras model trained with DP-SGD.

    ```python
    model = DPSequential(
        l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=None,
        layers=[keras.Input((28, 28, 1)), keras.layers.Flatten(),
                keras.layers.Dense(10)],
    )
    ```

    Args:
        l2_norm_clip: float. See `DPModel`.
        noise_multiplier: float. See `DPModel`.
        num_microbatches: int or None. See `DPModel`.
        use_xla: bool. See `DPModel`.
        layer_registry: ignored. See `DPModel`.
        *args: passed to `keras.Sequential` (`layers`, `name`).
        model: `keras.Sequential` or None. See `DPModel`.
        hardened_noise: bool. See `DPModel`.
        **kwargs: passed to `keras.Sequential`.
    """

    _inner_model_class = keras.Sequential

    def add(self, layer):
        """Appends a layer to the wrapped `keras.Sequential`."""
        self.model.add(layer)
