"""Selecting the variables that weight decay applies to."""

import gin
import keras

_DECAYED_LAYERS = (
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
    keras.layers.Dense,
    keras.layers.EinsumDense,
)
_KERNEL_NAMES = ("kernel", "depthwise_kernel", "pointwise_kernel")


def _leaf_layers(layer):
    for sub in getattr(layer, "layers", ()):
        if isinstance(sub, keras.Model):
            yield from _leaf_layers(sub)
        else:
            yield sub


@gin.configurable(module="tfdp.optim")
def weight_decay_variables(model, trainable_only=True):
    """Returns the conv and dense kernels of `model`, the weight-decay targets.

    The paper decays only convolution and dense kernels: biases and
    GroupNorm/LayerNorm `gamma`/`beta` are left alone. Subclasses count (e.g.
    `WSConv2D`, whose raw kernel is what gets decayed).

    Args:
        model: keras.Model. The model; nested models are searched.
        trainable_only: bool. Leave out kernels of frozen layers: with the
            decay inside the loss they get no gradient anyway, and with
            decoupled decay a frozen layer must not move. Defaults to `True`.

    Returns:
        list of `keras.Variable`, in layer order, without duplicates (shared
        layers are listed once).
    """
    result = []
    seen = set()
    for layer in _leaf_layers(model):
        if not isinstance(layer, _DECAYED_LAYERS):
            continue
        variables = layer.trainable_weights if trainable_only else layer.weights
        for variable in variables:
            if variable.name in _KERNEL_NAMES and id(variable) not in seen:
                seen.add(id(variable))
                result.append(variable)
    return result
