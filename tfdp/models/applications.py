"""`keras.applications` backbones made trainable with DP-SGD.

A `keras.applications` CNN has BatchNormalization, which mixes the examples
of a batch. `keras_application` builds one with a fresh classifier and
either replaces its BatchNorm by GroupNorm (Bu et al. 2022 use 16 groups) or
freezes it, so that it runs in inference mode: an affine map per example,
with statistics and weights fixed.
"""

import gin
import keras

from tfdp.models import layer_factories
from tfdp.models.find_batchnorm import find_batchnorm
from tfdp.models.replace_batchnorm import replace_batchnorm

# tfdp's name -> the `keras.applications` constructor.
APPLICATIONS = {
    "convnext_tiny": "ConvNeXtTiny",
    "densenet121": "DenseNet121",
    "efficientnet_b0": "EfficientNetB0",
    "mobilenet_v2": "MobileNetV2",
}
BATCHNORM_CHOICES = ("group_norm", "freeze", "keep")


@gin.configurable(module="tfdp.models")
def freeze_batchnorm(model):
    """Freezes every BatchNormalization layer of `model`, in place.

    A Keras 3 BatchNormalization with `trainable=False` runs in inference
    mode, also while training: it normalises with its moving statistics and
    leaves them as they are, so each example's output depends on that
    example alone (an affine map per channel), and its γ and β are not
    trained. The DP engine accepts such a layer; a trainable BatchNorm it
    refuses.

    Args:
        model: keras.Model. Nested models are searched too.

    Returns:
        list of str: the names of the frozen layers, in layer order.
    """
    frozen = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False
            frozen.append(layer.name)
    return frozen


def prepare_batchnorm(model, batchnorm, groups):
    """Replaces (`"group_norm"`), freezes (`"freeze"`) or keeps the BatchNorm of `model`.

    Args:
        model: keras.Model. A Functional or Sequential model.
        batchnorm: str. One of `BATCHNORM_CHOICES`. `"keep"` leaves a
            trainable BatchNorm, which the DP engine refuses: it is for
            loading weights before the conversion.
        groups: int. GroupNorm groups, per layer `gcd(groups, channels)`.

    Returns:
        `(model, frozen)`: the model (a new one for `"group_norm"` where
        there is BatchNorm, else `model` itself) and the names of the frozen
        BatchNorm layers.
    """
    if batchnorm == "group_norm":
        if not find_batchnorm(model):
            return model, []
        return replace_batchnorm(model, groups=groups), []
    if batchnorm == "freeze":
        return model, freeze_batchnorm(model)
    if batchnorm == "keep":
        return model, []
    raise ValueError(
        f"`batchnorm` must be one of {BATCHNORM_CHOICES}. Received: batchnorm={batchnorm!r}"
    )


@gin.configurable(module="tfdp.models")
def keras_application(
    architecture,
    num_classes=1000,
    input_shape=(224, 224, 3),
    *,
    weights=None,
    batchnorm="group_norm",
    groups=16,
    name=None,
    **kwargs,
):
    """Builds a `keras.applications` CNN with a new head and no trainable BatchNorm.

    The backbone is the application without its top (`include_top=False`,
    global average pooling), built on the model's own input so that the
    result is one flat Functional model; `head_dense`, a
    `Dense(num_classes)` with Xavier-normal kernel and logits out, follows.

    Args:
        architecture: str. A key of `APPLICATIONS` (`"mobilenet_v2"`,
            `"efficientnet_b0"`, `"convnext_tiny"`, `"densenet121"`) or the
            name of any other `keras.applications` constructor (e.g.
            `"MobileNetV3Small"`, `"ResNet50"`).
        num_classes: int. Number of logits. Defaults to `1000`.
        input_shape: tuple. `(height, width, channels)`. Defaults to
            `(224, 224, 3)`.
        weights: None, `"imagenet"` or a path. Passed to the constructor:
            `"imagenet"` lets Keras download its weights as usual; a path
            must be a weights file of the backbone without its top. Defaults
            to `None` (random initialisation).
        batchnorm: str. `"group_norm"` replaces every BatchNorm by GroupNorm
            with fresh γ = 1, β = 0 (`replace_batchnorm`); `"freeze"` keeps
            BatchNorm in inference mode with its loaded statistics
            (`freeze_batchnorm`); `"keep"` leaves it trainable, which the
            DP engine refuses (for loading weights before converting).
            Defaults to `"group_norm"`.
        groups: int. GroupNorm groups for `"group_norm"`. Defaults to `16`,
            as in Bu et al. 2022.
        name: str or None. Model name. Defaults to `architecture`.
        **kwargs: Other arguments of the constructor (e.g. `alpha` of
            MobileNetV2).

    Returns:
        A Functional `keras.Model` mapping images to logits.
    """
    constructor_name = APPLICATIONS.get(architecture, architecture)
    constructor = getattr(keras.applications, constructor_name, None)
    if not callable(constructor):
        raise ValueError(
            f"Unknown keras.applications architecture. Expected one of "
            f"{sorted(APPLICATIONS)} or a keras.applications constructor name. "
            f"Received: architecture={architecture!r}"
        )
    if num_classes < 1:
        raise ValueError(f"`num_classes` must be >= 1. Received: num_classes={num_classes}")
    inputs = keras.Input(shape=tuple(input_shape), name="image")
    backbone = constructor(
        include_top=False, weights=weights, input_tensor=inputs, pooling="avg", **kwargs
    )
    outputs = keras.layers.Dense(
        num_classes, kernel_initializer=layer_factories.xavier_normal(), name="head_dense"
    )(backbone.output)
    model = keras.Model(inputs, outputs, name=name or architecture)
    model, _ = prepare_batchnorm(model, batchnorm, groups)
    return model


def _alias(architecture):
    def builder(num_classes=1000, input_shape=(224, 224, 3), **kwargs):
        return keras_application(architecture, num_classes, input_shape, **kwargs)

    builder.__name__ = builder.__qualname__ = architecture
    builder.__doc__ = f"""Builds `keras.applications.{APPLICATIONS[architecture]}`; see `keras_application`.

    Its BatchNorm becomes GroupNorm (16 groups) unless `batchnorm="freeze"`.

    Args:
        num_classes: int. Number of logits. Defaults to `1000`.
        input_shape: tuple. `(height, width, channels)`. Defaults to
            `(224, 224, 3)`.
        **kwargs: Keyword arguments of `keras_application` (`weights`,
            `batchnorm`, `groups`, `name`, and the constructor's own).
    """
    return gin.configurable(architecture, module="tfdp.models")(builder)


convnext_tiny = _alias("convnext_tiny")
densenet121 = _alias("densenet121")
efficientnet_b0 = _alias("efficientnet_b0")
mobilenet_v2 = _alias("mobilenet_v2")
