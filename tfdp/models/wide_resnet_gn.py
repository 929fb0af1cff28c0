"""CIFAR-style Wide ResNet with GroupNorm."""

import gin
import keras

from tfdp.models import layer_factories


@gin.configurable(module="tfdp.models")
def wide_resnet_gn(
    depth=16,
    width_factor=4,
    num_classes=10,
    input_shape=(32, 32, 3),
    groups=16,
    *,
    epsilon=1e-5,
    weight_standardization=False,
    name=None,
):
    """Builds a pre-activation WRN-`depth`-`width_factor` with GroupNorm.

    Zagoruyko & Komodakis 2016 with every BatchNorm replaced by GroupNorm and
    no dropout:

    - `stem`: 3x3 conv, 16 channels, no bias.
    - `block_group1..3`: `(depth - 4) / 6` basic pre-activation blocks each
      (GN -> ReLU -> 3x3 conv, twice), widths `16, 32, 64` times
      `width_factor`, group strides `(1, 2, 2)`. Unlike the ImageNet ResNet,
      the stride sits on the first conv of the **first** block of a group,
      as in the original WRN. The first block of each group has a 1x1
      projection shortcut from its pre-activated input.
    - `head`: GN, ReLU, global average pool, `Dense(num_classes)` (Xavier
      normal init).

    32x32 inputs give 32, 16, 8 feature maps after groups 1..3. Layer names
    follow the ResNet scheme (`stem_conv`, `block_group1_block1_conv1`,
    `head_dense`), so `sub_block_layers` and the transfer helpers apply.

    Args:
        depth: int. Total depth; `depth - 4` must be a positive multiple of 6.
            Defaults to `16`.
        width_factor: int. Channel multiplier. Defaults to `4`.
        num_classes: int. Number of logits. Defaults to `10`.
        input_shape: tuple. `(height, width, channels)`. Defaults to
            `(32, 32, 3)`.
        groups: int. GroupNorm groups, clamped per layer to
            `gcd(groups, channels)`. Defaults to `16`.
        epsilon: float. GroupNorm epsilon. Defaults to `1e-5`.
        weight_standardization: bool. Use `WSConv2D` for every conv.
            Defaults to `False`.
        name: str or None. Model name. Defaults to
            `"wrn_{depth}_{width_factor}_gn"`.

    Returns:
        A Functional `keras.Model` mapping images to logits.
    """
    if depth < 10 or (depth - 4) % 6:
        raise ValueError(
            "`depth - 4` must be a positive multiple of 6 (e.g. 10, 16, 22, 28). "
            f"Received: depth={depth}"
        )
    if width_factor < 1:
        raise ValueError(
            f"`width_factor` must be >= 1. Received: width_factor={width_factor}"
        )
    if num_classes < 1:
        raise ValueError(
            f"`num_classes` must be >= 1. Received: num_classes={num_classes}"
        )
    num_blocks = (depth - 4) // 6
    ws = weight_standardization

    inputs = keras.Input(shape=tuple(input_shape), name="image")
    x = layer_factories.conv(inputs, 16, 3, 1, name="stem_conv", weight_standardization=ws)
    channels = 16
    for g, (base, stride) in enumerate(zip((16, 32, 64), (1, 2, 2)), 1):
        out_channels = base * width_factor
        for b in range(1, num_blocks + 1):
            x = layer_factories.preact_block(
                x,
                channels,
                out_channels,
                stride if b == 1 else 1,
                False,
                groups,
                epsilon,
                ws,
                prefix=f"block_group{g}_block{b}",
                strided_conv=1,
            )
            channels = out_channels
    outputs = layer_factories.classifier_head(x, channels, num_classes, groups, epsilon)
    return keras.Model(
        inputs, outputs, name=name or f"wrn_{depth}_{width_factor}_gn"
    )
