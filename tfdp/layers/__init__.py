"""tfdp's own Keras layers, below both the model builders and the DP engine.

`tfdp.models` builds networks from them and re-exports them;
`tfdp.dp.rules` knows how to clip them. Each is registered for Keras
serialization under the package name "tfdp" (e.g. "tfdp>GroupNormalization"),
so saved `.keras` files load wherever the class is defined.
"""

from tfdp.layers.group_normalization import GroupNormalization
from tfdp.layers.vit_layers import AddPositionEmbedding
from tfdp.layers.vit_layers import ClassToken
from tfdp.layers.vit_layers import LayerScale
from tfdp.layers.ws_conv2d import WSConv2D

__all__ = [
    "AddPositionEmbedding",
    "ClassToken",
    "GroupNormalization",
    "LayerScale",
    "WSConv2D",
]
