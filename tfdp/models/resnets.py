"""Depth-specific shortcuts for `resnet_v2`."""

import gin

from tfdp.models.resnet_v2 import resnet_v2


def _alias(depth):
    def builder(num_classes=1000, input_shape=(224, 224, 3), **kwargs):
        return resnet_v2(depth, num_classes, input_shape, **kwargs)

    builder.__name__ = builder.__qualname__ = f"resnet{depth}"
    builder.__doc__ = f"""Builds a GroupNorm ResNet-{depth} v2; see `resnet_v2`.

    Args:
        num_classes: int. Number of logits. Defaults to `1000`.
        input_shape: tuple. `(height, width, channels)`. Defaults to
            `(224, 224, 3)`.
        **kwargs: Keyword arguments of `resnet_v2` (`groups`, `epsilon`,
            `width`, `weight_standardization`, `group_strides`, `name`).
    """
    return gin.configurable(f"resnet{depth}", module="tfdp.models")(builder)


resnet18 = _alias(18)
resnet34 = _alias(34)
resnet50 = _alias(50)
resnet101 = _alias(101)
resnet152 = _alias(152)
