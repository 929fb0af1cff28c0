"""Rebuilding a model with GroupNorm in place of BatchNorm."""

import gin
import keras
from keras.src.models.functional import Functional

from tfdp.layers import GroupNormalization
from tfdp.models import layer_factories


def _to_group_norm(layer, groups):
    axis = layer.axis
    if isinstance(axis, (list, tuple)):
        if len(axis) != 1:
            raise ValueError(
                "Only BatchNormalization over a single axis can become "
                f"GroupNormalization. Received: axis={axis} (layer {layer.name!r})"
            )
        axis = axis[0]
    channels = int(layer.moving_mean.shape[0])
    # GroupNorm has no running statistics, so the BN's gamma/beta (which were
    # fitted to batch statistics) would be wrong here: start from 1/0.
    return GroupNormalization(
        groups=layer_factories.clamp_groups(groups, channels),
        axis=axis,
        epsilon=layer.epsilon,
        center=layer.center,
        scale=layer.scale,
        name=layer.name,
        dtype=layer.dtype_policy,
    )


def _leaves(model, path=""):
    for layer in model.layers:
        layer_path = f"{path}/{layer.name}" if path else layer.name
        if isinstance(layer, keras.Model):
            yield from _leaves(layer, layer_path)
        else:
            yield layer_path, layer


@gin.configurable(module="tfdp.models")
def replace_batchnorm(model, groups=32):
    """Returns a copy of `model` with every BatchNorm replaced by GroupNorm.

    The model is rebuilt with `keras.models.clone_model` (recursively, so
    nested Functional/Sequential sub-models are rebuilt too). Each
    `BatchNormalization` becomes a `tfdp.models.GroupNormalization` (Keras's
    layer with faster moments on CPU) with the same name,
    axis, epsilon, `center` and `scale`, `gcd(groups, channels)` groups, and
    fresh `gamma = 1`, `beta = 0`: BN's affine parameters were fitted to
    batch statistics and its running statistics have no GroupNorm
    counterpart, so nothing of it is carried over. Every other layer is
    cloned from its config and receives a copy of the original weights
    (matched by name); the original model is left untouched.

    Args:
        model: keras.Model. A built Functional or Sequential model.
        groups: int. Requested GroupNorm groups; layers whose channel count
            it does not divide get `gcd(groups, channels)`. Defaults to `32`.

    Returns:
        A new `keras.Model` of the same kind without BatchNormalization.

    Raises:
        ValueError: if `model` (or a nested model) is subclassed, since its
            `call` cannot be rebuilt layer by layer.
    """
    for path, layer in [("", model)] + [
        (p, l) for p, l in _walk_models(model)
    ]:
        if not isinstance(layer, (keras.Sequential, Functional)):
            where = f" (nested model {path!r})" if path else ""
            raise ValueError(
                "replace_batchnorm can only rebuild Functional or Sequential "
                f"models; a subclassed model's call() is opaque{where}. "
                f"Received: model={type(layer).__name__}"
            )
    if not model.built:
        raise ValueError(
            "The model must be built before BatchNorm can be replaced. "
            f"Received: model={model.name!r} (not built)"
        )

    def clone_function(layer):
        if isinstance(layer, keras.layers.BatchNormalization):
            return _to_group_norm(layer, groups)
        return layer.__class__.from_config(layer.get_config())

    def call_function(layer, *args, **kwargs):
        if isinstance(layer, keras.layers.GroupNormalization):
            # The graph recorded BatchNorm's call, whose `mask`/`training`
            # keywords GroupNormalization.call does not accept.
            kwargs.pop("mask", None)
            kwargs.pop("training", None)
        return layer(*args, **kwargs)

    # Sequential models call their layers themselves (and only pass the
    # keywords a layer accepts), so they take no call_function.
    extra = {} if isinstance(model, keras.Sequential) else {
        "call_function": call_function
    }
    new_model = keras.models.clone_model(
        model, clone_function=clone_function, recursive=True, **extra
    )
    old_leaves = dict(_leaves(model))
    for path, new_layer in _leaves(new_model):
        old_layer = old_leaves.get(path)
        if old_layer is None or isinstance(
            old_layer, keras.layers.BatchNormalization
        ):
            continue
        if old_layer.weights:
            new_layer.set_weights(old_layer.get_weights())
    return new_model


def _walk_models(model, path=""):
    for layer in getattr(model, "layers", ()):
        if isinstance(layer, keras.Model):
            layer_path = f"{path}/{layer.name}" if path else layer.name
            yield layer_path, layer
            yield from _walk_models(layer, layer_path)
