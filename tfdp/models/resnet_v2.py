"""Pre-activation ResNet (v2) with GroupNorm, as in Kurakin et al. 2022."""

import gin
import keras

from tfdp.models import layer_factories

BLOCKS_PER_GROUP = {
    18: (2, 2, 2, 2),
    34: (3, 4, 6, 3),
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
}

# The paper's code (objax's ResNet v2 zoo) keeps the default strides
# (1, 2, 2, 2) for ResNet-18/34 and passes (2, 2, 2, 1) for the bottleneck
# nets. Both put the stride on the last block of a group and both reach 7x7
# at 224 input; they differ only in where the resolution drops.
DEFAULT_GROUP_STRIDES = {
    18: (1, 2, 2, 2),
    34: (1, 2, 2, 2),
    50: (2, 2, 2, 1),
    101: (2, 2, 2, 1),
    152: (2, 2, 2, 1),
}


@gin.configurable(module="tfdp.models")
def resnet_v2(
    depth,
    num_classes,
    input_shape=(224, 224, 3),
    *,
    groups=32,
    epsilon=1e-5,
    width=64,
    weight_standardization=False,
    group_strides=None,
    name=None,
):
    """Builds a pre-activation ResNet with GroupNorm as a Functional model.

    The architecture is the one of the paper's public (objax) code:

    - `stem`: `ZeroPadding2D(3)`, 7x7 stride-2 VALID conv with `width`
      channels and no bias, `ZeroPadding2D(1)`, 3x3 stride-2 VALID max-pool.
      No normalisation in the stem. 224 -> 112 -> 56.
    - `block_group1..4`: widths `width * (1, 2, 4, 8)`, times 4 at the output
      of bottleneck blocks (depth >= 50). Blocks are pre-activation:
      GN -> ReLU -> conv, twice (basic) or three times (bottleneck, 1x1, 3x3,
      1x1). **The stride of a group sits on its last block** (on the second
      3x3 conv of a basic block, on the 3x3 conv of a bottleneck). The first
      block of a group gets a 1x1 projection shortcut, taken from the
      pre-activated input, when the channel count changes; a strided block
      whose channels do not change keeps an identity shortcut subsampled by a
      1x1 max-pool with the same stride. Group strides default to
      `(1, 2, 2, 2)` for depth 18/34 and `(2, 2, 2, 1)` for 50/101/152, so a
      224x224 input gives feature maps of 56, 28, 14, 7 (depth 18/34) or
      28, 14, 7, 7 (depth >= 50) after groups 1..4.
    - `head`: GN, ReLU, global average pool, `Dense(num_classes)` with
      Xavier (Glorot) normal init and zero bias.

    All convs have no bias and use He-normal (fan-out) init; every GN uses
    `epsilon` (1e-5, not Keras's 1e-3 default). 3x3 convs pad one pixel on
    each side; strided ones do so with an explicit `ZeroPadding2D` so that
    even inputs are padded symmetrically like the reference.

    Every layer name starts with its sub-block (see `SUB_BLOCKS`), e.g.
    `stem_conv`, `block_group1_block1_norm1`, `block_group1_block1_conv1`,
    `block_group2_block1_proj`, `head_norm`, `head_dense`.

    Args:
        depth: int. One of 18, 34, 50, 101, 152.
        num_classes: int. Number of logits.
        input_shape: tuple. `(height, width, channels)`; spatial sizes may be
            `None`. Defaults to `(224, 224, 3)`.
        groups: int. GroupNorm groups. Layers whose channel count it does not
            divide use `gcd(groups, channels)` groups instead, which leaves the
            standard widths at exactly 32 groups and keeps narrow test widths
            (8, 16) valid. Defaults to `32`.
        epsilon: float. GroupNorm epsilon. Defaults to `1e-5`.
        width: int. Channels of the stem and of the first block group.
            Defaults to `64`.
        weight_standardization: bool. Use `WSConv2D` for every conv.
            Defaults to `False`.
        group_strides: tuple of 4 ints or None. Stride of the last block of
            each group; `None` uses the depth's default described above.
            Defaults to `None`.
        name: str or None. Model name. Defaults to `"resnet{depth}_v2_gn"`.

    Returns:
        A Functional `keras.Model` mapping images to logits.
    """
    if depth not in BLOCKS_PER_GROUP:
        raise ValueError(
            f"`depth` must be one of {sorted(BLOCKS_PER_GROUP)}. "
            f"Received: depth={depth}"
        )
    if num_classes < 1:
        raise ValueError(
            f"`num_classes` must be >= 1. Received: num_classes={num_classes}"
        )
    if width < 1:
        raise ValueError(f"`width` must be >= 1. Received: width={width}")
    if group_strides is None:
        group_strides = DEFAULT_GROUP_STRIDES[depth]
    group_strides = tuple(int(s) for s in group_strides)
    if len(group_strides) != 4 or min(group_strides) < 1:
        raise ValueError(
            "`group_strides` must be 4 positive ints. "
            f"Received: group_strides={group_strides}"
        )
    bottleneck = depth >= 50
    blocks = BLOCKS_PER_GROUP[depth]
    expansion = 4 if bottleneck else 1
    ws = weight_standardization

    inputs = keras.Input(shape=tuple(input_shape), name="image")
    x = layer_factories.conv(
        inputs, width, 7, 2, name="stem_conv", weight_standardization=ws
    )
    x = keras.layers.ZeroPadding2D(1, name="stem_pool_pad")(x)
    x = keras.layers.MaxPooling2D(3, strides=2, name="stem_pool")(x)

    channels = width
    for g, (num_blocks, stride) in enumerate(zip(blocks, group_strides), 1):
        out_channels = width * 2 ** (g - 1) * expansion
        for b in range(1, num_blocks + 1):
            x = layer_factories.preact_block(
                x,
                channels,
                out_channels,
                stride if b == num_blocks else 1,
                bottleneck,
                groups,
                epsilon,
                ws,
                prefix=f"block_group{g}_block{b}",
                strided_conv=2,
            )
            channels = out_channels

    outputs = layer_factories.classifier_head(x, channels, num_classes, groups, epsilon)
    return keras.Model(inputs, outputs, name=name or f"resnet{depth}_v2_gn")
