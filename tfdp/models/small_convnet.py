"""Small GroupNorm convnet for 28x28 MNIST-like images."""

import gin
import keras

from tfdp.models import layer_factories


@gin.configurable(module="tfdp.models")
def small_convnet(
    num_classes=10,
    input_shape=(28, 28, 1),
    *,
    filters=(16, 32),
    dense_units=32,
    activation="tanh",
    groups=4,
    epsilon=1e-5,
    name="small_convnet",
):
    """Builds the small DP-SGD convnet used for the offline MNIST run.

    The layout is the MNIST network of Papernot et al. 2021 (tempered
    sigmoids) with a GroupNorm after each conv:

    - `conv1`: `filters[0]` 8x8 stride-2 "same" conv (28 -> 14), GN,
      `activation`, 2x2 stride-1 max-pool (14 -> 13);
    - `conv2`: `filters[1]` 4x4 stride-2 "valid" conv (13 -> 5), GN,
      `activation`, 2x2 stride-1 max-pool (5 -> 4);
    - `Flatten`, `Dense(dense_units)` + `activation`, `Dense(num_classes)`.

    With the defaults it has 26,106 parameters at 28x28x1 input: small
    enough that DP noise stays tolerable and a DP-SGD epoch over 5,000 images
    takes seconds on two CPU cores.

    Smaller images (e.g. the 8x8 scikit-learn digits) also work: `conv2`
    falls back to "same" padding when its input is smaller than its kernel
    (8 -> 4 -> 3 -> 2 -> 1 for 8x8 input; 1,040 + 32 + 8,224 + 64 + 1,056 +
    330 = 10,746 parameters with the defaults).

    Args:
        num_classes: int. Number of logits. Defaults to `10`.
        input_shape: tuple. `(height, width, channels)`. Defaults to
            `(28, 28, 1)`.
        filters: tuple of 2 ints. Widths of the two convs. Defaults to
            `(16, 32)`.
        dense_units: int. Width of the hidden dense layer. Defaults to `32`.
        activation: str. Keras activation. Defaults to `"tanh"`.
        groups: int or None. GroupNorm groups, clamped per layer to
            `gcd(groups, channels)`; `None` or `0` drops the norms.
            Defaults to `4`.
        epsilon: float. GroupNorm epsilon. Defaults to `1e-5`.
        name: str. Model name. Defaults to `"small_convnet"`.

    Returns:
        A Functional `keras.Model` mapping images to logits.
    """
    if len(filters) != 2 or min(filters) < 1:
        raise ValueError(
            f"`filters` must be 2 positive ints. Received: filters={filters}"
        )
    inputs = keras.Input(shape=tuple(input_shape), name="image")
    x = inputs
    specs = ((filters[0], 8, "same"), (filters[1], 4, "valid"))
    for i, (width, kernel_size, padding) in enumerate(specs, 1):
        size = x.shape[1:3]
        if padding == "valid" and any(
            d is not None and d < kernel_size for d in size
        ):
            padding = "same"
        x = keras.layers.Conv2D(
            width, kernel_size, strides=2, padding=padding, name=f"conv{i}"
        )(x)
        if groups:
            x = layer_factories.group_norm(width, groups, epsilon, f"conv{i}_norm")(x)
        x = keras.layers.Activation(activation, name=f"conv{i}_act")(x)
        x = keras.layers.MaxPooling2D(2, strides=1, name=f"conv{i}_pool")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dense(dense_units, name="dense")(x)
    x = keras.layers.Activation(activation, name="dense_act")(x)
    outputs = keras.layers.Dense(num_classes, name="head_dense")(x)
    return keras.Model(inputs, outputs, name=name)
