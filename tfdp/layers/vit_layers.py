"""Layers with weights that are added or multiplied elementwise: ViT's and ConvNeXt's.

Each layer owns one trainable variable and reads it only inside its own
`call`, so the DP engine's per-layer rules see every use of it.
"""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfdp")
class ClassToken(keras.layers.Layer):
    """Prepends a learned token to a sequence: [B, T, D] → [B, T + 1, D].

    The token (variable `token`, shape [1, 1, D]) is the same for every
    example; the vision transformer's head reads the output at position 0.

    Args:
        initializer: str or initializer. Initialiser of the token.
            Defaults to `"zeros"`, as in Dosovitskiy et al. 2021.
        **kwargs: Any other `keras.layers.Layer` argument.
    """

    def __init__(self, initializer="zeros", **kwargs):
        super().__init__(**kwargs)
        self.initializer = keras.initializers.get(initializer)

    def build(self, input_shape):
        if len(input_shape) != 3 or input_shape[-1] is None:
            raise ValueError(
                "ClassToken expects inputs of shape [batch, tokens, width] with a known "
                f"width. Received: input_shape={input_shape}"
            )
        self.token = self.add_weight(
            shape=(1, 1, input_shape[-1]), initializer=self.initializer, name="token"
        )

    def call(self, inputs):
        batch = ops.shape(inputs)[0]
        token = ops.broadcast_to(
            ops.cast(self.token, inputs.dtype), (batch, 1, ops.shape(inputs)[-1])
        )
        return ops.concatenate([token, inputs], axis=1)

    def compute_output_shape(self, input_shape):
        tokens = None if input_shape[1] is None else input_shape[1] + 1
        return (input_shape[0], tokens, input_shape[2])

    def get_config(self):
        config = super().get_config()
        config["initializer"] = keras.initializers.serialize(self.initializer)
        return config


@keras.saving.register_keras_serializable(package="tfdp")
class AddPositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding per position: x + E, E of shape [1, T, D].

    Args:
        initializer: str or initializer. Initialiser of the embedding
            (variable `embedding`). Defaults to a normal of std 0.02,
            truncated at two standard deviations, as in Dosovitskiy et al.
        **kwargs: Any other `keras.layers.Layer` argument.
    """

    def __init__(self, initializer=None, **kwargs):
        super().__init__(**kwargs)
        self.initializer = keras.initializers.get(
            initializer or keras.initializers.TruncatedNormal(stddev=0.02)
        )

    def build(self, input_shape):
        if len(input_shape) != 3 or None in input_shape[1:]:
            raise ValueError(
                "AddPositionEmbedding expects inputs of shape [batch, tokens, width] "
                f"with a known number of tokens and width. Received: input_shape={input_shape}"
            )
        self.embedding = self.add_weight(
            shape=(1,) + tuple(input_shape[1:]), initializer=self.initializer,
            name="embedding",
        )

    def call(self, inputs):
        return inputs + ops.cast(self.embedding, inputs.dtype)

    def get_config(self):
        config = super().get_config()
        config["initializer"] = keras.initializers.serialize(self.initializer)
        return config


@keras.saving.register_keras_serializable(package="tfdp")
class LayerScale(keras.layers.Layer):
    """Scales each channel by a learned weight: γ ⊙ x, γ of shape [D].

    The layer-scale of CaiT (Touvron et al. 2021) and ConvNeXt, on the last
    axis of inputs of any rank.

    Args:
        init_value: float. Initial value of every entry of γ (variable
            `gamma`). Defaults to `1e-6`, ConvNeXt's.
        **kwargs: Any other `keras.layers.Layer` argument.
    """

    def __init__(self, init_value=1e-6, **kwargs):
        super().__init__(**kwargs)
        self.init_value = float(init_value)

    def build(self, input_shape):
        if input_shape[-1] is None:
            raise ValueError(
                "LayerScale needs a known last dimension. "
                f"Received: input_shape={input_shape}"
            )
        self.gamma = self.add_weight(
            shape=(input_shape[-1],),
            initializer=keras.initializers.Constant(self.init_value),
            name="gamma",
        )

    def call(self, inputs):
        return inputs * ops.cast(self.gamma, inputs.dtype)

    def get_config(self):
        config = super().get_config()
        config["init_value"] = self.init_value
        return config
