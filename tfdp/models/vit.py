"""Vision transformers (Dosovitskiy et al. 2021) from Keras layers."""

import gin
import keras

from tfdp.layers import AddPositionEmbedding
from tfdp.layers import ClassToken
from tfdp.layers import LayerScale
from tfdp.models import layer_factories

# (width, depth, heads) of the named sizes (Touvron et al. 2021's Ti and S,
# Dosovitskiy et al.'s B); the MLP is 4x the width.
VIT_SIZES = {
    "ti": (192, 12, 3),
    "s": (384, 12, 6),
    "b": (768, 12, 12),
}


@gin.configurable(module="tfdp.models")
def vit(
    num_classes=1000,
    input_shape=(224, 224, 3),
    *,
    patch_size=16,
    width=384,
    depth=12,
    num_heads=6,
    mlp_dim=None,
    dropout=0.0,
    layer_scale=None,
    epsilon=1e-6,
    name=None,
):
    """Builds a vision transformer with pre-norm blocks.

    - `stem_patch_embed`: a `patch_size` x `patch_size` conv of stride
      `patch_size` ([H/p · W/p] tokens of `width` channels), reshaped to a
      sequence; `stem_class_token` prepends a learned token and
      `stem_position_embedding` adds a learned embedding per position.
    - `depth` blocks `block{i}_*`, each pre-norm:
      x + MHA(LN(x)), then x + MLP(LN(x)) with the MLP
      Dense(`mlp_dim`) → GELU → Dense(`width`). With `layer_scale`, each
      branch is multiplied by a learned per-channel γ before the residual
      sum (CaiT; `LayerScale`).
    - `head_norm` (LayerNorm) and `head_dense` on the class token's output.

    Every layer is a standard Keras layer (`Conv2D`, `MultiHeadAttention`,
    `LayerNormalization`, `Dense`) or one of `tfdp.layers`, so a
    saved model loads after `import tfdp.models`. There is no BatchNorm, and
    no layer mixes examples.

    Args:
        num_classes: int. Number of logits. Defaults to `1000`.
        input_shape: tuple. `(height, width, channels)`; height and width
            must be multiples of `patch_size`. Defaults to `(224, 224, 3)`.
        patch_size: int. Side of the square patches. Defaults to `16`.
        width: int. Token width D. Defaults to `384` (ViT-S).
        depth: int. Number of transformer blocks. Defaults to `12`.
        num_heads: int. Attention heads; must divide `width`. Defaults to
            `6`.
        mlp_dim: int or None. Hidden width of the MLP. Defaults to
            `4 * width`.
        dropout: float. Dropout rate after the attention and in the MLP.
            Defaults to `0.0`.
        layer_scale: float or None. Initial γ of a `LayerScale` on each
            branch; `None` for none. Defaults to `None`.
        epsilon: float. LayerNorm epsilon. Defaults to `1e-6`.
        name: str or None. Model name. Defaults to `"vit_{width}_{depth}_p{patch_size}"`.

    Returns:
        A Functional `keras.Model` mapping images to logits.
    """
    height, image_width = int(input_shape[0]), int(input_shape[1])
    if patch_size < 1 or height % patch_size or image_width % patch_size:
        raise ValueError(
            "The image height and width must be positive multiples of `patch_size`. "
            f"Received: input_shape={tuple(input_shape)}, patch_size={patch_size}"
        )
    if width < 1 or num_heads < 1 or width % num_heads:
        raise ValueError(
            "`num_heads` must divide `width`. "
            f"Received: width={width}, num_heads={num_heads}"
        )
    if depth < 1 or num_classes < 1:
        raise ValueError(
            f"`depth` and `num_classes` must be >= 1. Received: depth={depth}, "
            f"num_classes={num_classes}"
        )
    mlp_dim = mlp_dim or 4 * width
    tokens = (height // patch_size) * (image_width // patch_size)

    inputs = keras.Input(shape=tuple(input_shape), name="image")
    x = keras.layers.Conv2D(
        width, patch_size, strides=patch_size, padding="valid", name="stem_patch_embed"
    )(inputs)
    x = keras.layers.Reshape((tokens, width), name="stem_tokens")(x)
    x = ClassToken(name="stem_class_token")(x)
    x = AddPositionEmbedding(name="stem_position_embedding")(x)
    for i in range(1, depth + 1):
        prefix = f"block{i}"
        y = keras.layers.LayerNormalization(epsilon=epsilon, name=f"{prefix}_norm1")(x)
        y = keras.layers.MultiHeadAttention(
            num_heads, width // num_heads, name=f"{prefix}_attention"
        )(y, y)
        x = _branch_sum(x, y, dropout, layer_scale, f"{prefix}_attention")
        y = keras.layers.LayerNormalization(epsilon=epsilon, name=f"{prefix}_norm2")(x)
        y = keras.layers.Dense(mlp_dim, name=f"{prefix}_mlp_dense1")(y)
        y = keras.layers.Activation("gelu", name=f"{prefix}_mlp_gelu")(y)
        if dropout:
            y = keras.layers.Dropout(dropout, name=f"{prefix}_mlp_dropout1")(y)
        y = keras.layers.Dense(width, name=f"{prefix}_mlp_dense2")(y)
        x = _branch_sum(x, y, dropout, layer_scale, f"{prefix}_mlp")
    x = keras.layers.LayerNormalization(epsilon=epsilon, name="head_norm")(x)
    # The class token's output, as a layer of its own so the graph serialises.
    x = keras.layers.Cropping1D((0, tokens), name="head_class_token")(x)
    x = keras.layers.Flatten(name="head_flatten")(x)
    outputs = keras.layers.Dense(
        num_classes, kernel_initializer=layer_factories.xavier_normal(), name="head_dense"
    )(x)
    return keras.Model(inputs, outputs, name=name or f"vit_{width}_{depth}_p{patch_size}")


def _branch_sum(x, y, dropout, layer_scale, prefix):
    if dropout:
        y = keras.layers.Dropout(dropout, name=f"{prefix}_dropout")(y)
    if layer_scale is not None:
        y = LayerScale(layer_scale, name=f"{prefix}_scale")(y)
    return keras.layers.Add(name=f"{prefix}_add")([x, y])


def _alias(size, patch_size):
    width, depth, num_heads = VIT_SIZES[size]
    name = f"vit_{size}{patch_size}"

    def builder(num_classes=1000, input_shape=(224, 224, 3), **kwargs):
        kwargs.setdefault("name", name)
        return vit(num_classes, input_shape, patch_size=patch_size, width=width,
                   depth=depth, num_heads=num_heads, **kwargs)

    builder.__name__ = builder.__qualname__ = name
    builder.__doc__ = f"""Builds ViT-{size.upper()}/{patch_size}: width {width}, {depth} blocks, {num_heads} heads; see `vit`.

    Args:
        num_classes: int. Number of logits. Defaults to `1000`.
        input_shape: tuple. `(height, width, channels)`, multiples of
            {patch_size}. Defaults to `(224, 224, 3)`.
        **kwargs: Keyword arguments of `vit` (`mlp_dim`, `dropout`,
            `layer_scale`, `epsilon`, `name`).
    """
    return gin.configurable(name, module="tfdp.models")(builder)


vit_ti16 = _alias("ti", 16)
vit_s16 = _alias("s", 16)
vit_b16 = _alias("b", 16)
