"""Locating BatchNormalization layers."""

import gin
import keras


def _walk(layer, path):
    # Nested models are layers too; `layers` exists on Functional and
    # Sequential models and on most subclassed ones.
    for sub in getattr(layer, "layers", ()):
        sub_path = f"{path}/{sub.name}" if path else sub.name
        yield sub_path, sub
        yield from _walk(sub, sub_path)


@gin.configurable(module="tfdp.models")
def find_batchnorm(model):
    """Returns the names of all BatchNormalization layers in `model`.

    BatchNorm mixes the statistics of different examples, which breaks the
    per-example sensitivity bound that DP-SGD relies on, so tfdp refuses to
    train models that still contain it.

    Args:
        model: keras.Model or keras.layers.Layer. The model to inspect;
            nested models are searched recursively.

    Returns:
        list of str, in layer order. Top-level layers are given by name,
        layers inside nested models by their `/`-joined path (e.g.
        `"backbone/conv1_bn"`). Empty when there is none.
    """
    names = []
    if isinstance(model, keras.layers.BatchNormalization):
        names.append(model.name)
    names.extend(
        path
        for path, layer in _walk(model, "")
        if isinstance(layer, keras.layers.BatchNormalization)
    )
    return names
