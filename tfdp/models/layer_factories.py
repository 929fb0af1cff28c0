"""Layer factories shared by the tfdp model builders.

Every builder makes its layers here so that padding, initialisation and
GroupNorm group clamping behave the same across architectures.
"""

import math

import keras

from tfdp.layers import GroupNormalization
from tfdp.layers import WSConv2D


def clamp_groups(groups, channels):
    """Returns the number of GroupNorm groups actually used for `channels`.

    `gcd(groups, channels)` equals `groups` whenever `groups` divides
    `channels` (every layer of the standard-width models), and otherwise is the
    largest count not above `groups` that still divides both, so narrow test
    models (width 8 or 16) get a valid GroupNorm instead of an error.
    """
    if groups < 1:
        raise ValueError(f"`groups` must be >= 1. Received: groups={groups}")
    if channels < 1:
        raise ValueError(
            f"`channels` must be >= 1. Received: channels={channels}"
        )
    return math.gcd(int(groups), int(channels))


def group_norm(channels, groups, epsilon, name):
    return GroupNormalization(
        groups=clamp_groups(groups, channels), epsilon=epsilon, name=name
    )


def he_normal_fan_out():
    # N(0, 2 / (k*k*c_out)), untruncated: the initialiser of the paper's
    # (objax) ResNet v2 convolutions.
    return keras.initializers.VarianceScaling(
        scale=2.0, mode="fan_out", distribution="untruncated_normal"
    )


def xavier_normal():
    # Untruncated Glorot normal, as objax's `xavier_normal` used for the head.
    return keras.initializers.VarianceScaling(
        scale=1.0, mode="fan_avg", distribution="untruncated_normal"
    )


def conv(
    x,
    filters,
    kernel_size,
    strides=1,
    *,
    name,
    use_bias=False,
    weight_standardization=False,
    kernel_initializer=None,
):
    """Applies a conv with symmetric `(k - 1) // 2` padding.

    Strided convs get an explicit `ZeroPadding2D` and VALID padding: Keras's
    "same" pads an even input asymmetrically (0 before, 1 after) at stride 2,
    whereas the reference models pad one pixel on both sides. At stride 1 the
    two agree, so plain "same" keeps the graph smaller.
    """
    conv_cls = WSConv2D if weight_standardization else keras.layers.Conv2D
    pad = (kernel_size - 1) // 2
    padding = "same"
    if strides > 1:
        padding = "valid"
        if pad:
            x = keras.layers.ZeroPadding2D(pad, name=f"{name}_pad")(x)
    return conv_cls(
        filters,
        kernel_size,
        strides=strides,
        padding=padding,
        use_bias=use_bias,
        kernel_initializer=kernel_initializer or he_normal_fan_out(),
        name=name,
    )(x)


def preact_block(
    x,
    in_channels,
    out_channels,
    stride,
    bottleneck,
    groups,
    epsilon,
    weight_standardization,
    prefix,
    strided_conv=2,
):
    """Pre-activation residual block; `strided_conv` is the 1-based index of the
    conv that carries `stride` in a basic block (bottlenecks: the 3x3 conv).
    """
    use_projection = in_channels != out_channels
    shortcut = x
    if stride > 1 and not use_projection:
        # A 1x1 max-pool is plain subsampling: the identity path of a strided
        # block without a projection, exactly as the reference code does it.
        shortcut = keras.layers.MaxPooling2D(
            pool_size=1, strides=stride, name=f"{prefix}_subsample"
        )(x)
    if bottleneck:
        mid = out_channels // 4
        specs = ((mid, 1, 1), (mid, 3, stride), (out_channels, 1, 1))
    else:
        specs = tuple(
            (out_channels, 3, stride if i == strided_conv else 1) for i in (1, 2)
        )
    y = x
    channels = in_channels
    for i, (filters, kernel_size, strides) in enumerate(specs, start=1):
        y = group_norm(channels, groups, epsilon, f"{prefix}_norm{i}")(y)
        y = keras.layers.ReLU(name=f"{prefix}_relu{i}")(y)
        if i == 1 and use_projection:
            # v2 projects the pre-activated input, so the shortcut also sees
            # a normalised signal.
            shortcut = conv(
                y,
                out_channels,
                1,
                stride,
                name=f"{prefix}_proj",
                weight_standardization=weight_standardization,
            )
        y = conv(
            y,
            filters,
            kernel_size,
            strides,
            name=f"{prefix}_conv{i}",
            weight_standardization=weight_standardization,
        )
        channels = filters
    return keras.layers.Add(name=f"{prefix}_add")([shortcut, y])


def classifier_head(x, channels, num_classes, groups, epsilon):
    """The pre-activation head: GroupNorm, ReLU, global mean, Dense (Xavier)."""
    x = group_norm(channels, groups, epsilon, "head_norm")(x)
    x = keras.layers.ReLU(name="head_relu")(x)
    x = keras.layers.GlobalAveragePooling2D(name="head_pool")(x)
    return keras.layers.Dense(
        num_classes, kernel_initializer=xavier_normal(), name="head_dense"
    )(x)
