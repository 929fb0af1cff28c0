"""Simple VGG-style CIFAR-10 convnets."""

import gin
import keras

from tfdp.models import layer_factories


@gin.configurable(module="tfdp.models")
def vgg_cifar(
    num_classes=10,
    input_shape=(32, 32, 3),
    *,
    block_filters=((32, 32), (64, 64), (128, 128)),
    dense_units=128,
    activation="tanh",
    group_norm=False,
    groups=16,
    epsilon=1e-5,
    name="vgg_cifar",
):
    """Builds a small VGG-style convnet for CIFAR-10.

    Kurakin et al. 2022 (Appendix H) compare "simpleVGG" CIFAR-10 models of
    several sizes under DP-SGD (100 epochs, batch 500, three noise levels) and
    find that simpler models can do better as the noise grows; the exact
    layer lists are not in the material available here. This builder is the
    standard small VGG of the DP literature (Papernot et al. 2021, tempered
    sigmoids), with the sizes made configurable so that the paper's sweep
    over model size can be reproduced by changing `block_filters`:

    - for each tuple in `block_filters`: one 3x3 "same" conv with bias per
      entry, each followed by an optional GroupNorm and `activation`; then a
      2x2 stride-2 max-pool;
    - `Flatten`, then (if `dense_units`) `Dense(dense_units)` + `activation`;
    - `Dense(num_classes)` logits.

    With the defaults (conv 32-32-pool-64-64-pool-128-128-pool, dense 128,
    tanh, no norm) the model has 550,570 parameters at 32x32x3 input.

    Args:
        num_classes: int. Number of logits. Defaults to `10`.
        input_shape: tuple. `(height, width, channels)`. Defaults to
            `(32, 32, 3)`.
        block_filters: tuple of tuples of int. Conv widths per pooled block.
            Defaults to `((32, 32), (64, 64), (128, 128))`.
        dense_units: int or None. Width of the hidden dense layer; `None` or
            `0` goes straight to the logits. Defaults to `128`.
        activation: str. Keras activation; tanh is the usual DP choice since
            bounded activations keep the clipped gradients informative.
            Defaults to `"tanh"`.
        group_norm: bool. Insert GroupNorm after every conv. Defaults to
            `False`.
        groups: int. GroupNorm groups, clamped per layer to
            `gcd(groups, channels)`. Defaults to `16`.
        epsilon: float. GroupNorm epsilon. Defaults to `1e-5`.
        name: str. Model name. Defaults to `"vgg_cifar"`.

    Returns:
        A Functional `keras.Model` mapping images to logits.
    """
    if not block_filters or not all(block_filters):
        raise ValueError(
            "`block_filters` must be a non-empty tuple of non-empty tuples. "
            f"Received: block_filters={block_filters}"
        )
    inputs = keras.Input(shape=tuple(input_shape), name="image")
    x = inputs
    for b, filters in enumerate(block_filters, 1):
        for c, width in enumerate(filters, 1):
            prefix = f"block{b}_conv{c}"
            x = keras.layers.Conv2D(width, 3, padding="same", name=prefix)(x)
            if group_norm:
                x = layer_factories.group_norm(width, groups, epsilon, f"{prefix}_norm")(x)
            x = keras.layers.Activation(activation, name=f"{prefix}_act")(x)
        x = keras.layers.MaxPooling2D(2, name=f"block{b}_pool")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    if dense_units:
        x = keras.layers.Dense(dense_units, name="dense")(x)
        x = keras.layers.Activation(activation, name="dense_act")(x)
    outputs = keras.layers.Dense(num_classes, name="head_dense")(x)
    return keras.Model(inputs, outputs, name=name)
