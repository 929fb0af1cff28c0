"""Model builders for DP-SGD: GroupNorm ResNets, vision transformers, small convnets, BN surgery.

All builders return Functional Keras models made of standard leaf layers
(Conv2D, Dense, ...), which is what the DP engine taps, and tfdp's
`GroupNormalization`: Keras's layer with faster moments on CPU.
No builder has a trainable BatchNormalization: the `keras.applications`
backbones (`keras_application`) get GroupNorm instead, or frozen BatchNorm.
"""

from tfdp.dp.freezing import freeze_unclippable
from tfdp.layers import AddPositionEmbedding
from tfdp.layers import ClassToken
from tfdp.layers import GroupNormalization
from tfdp.layers import LayerScale
from tfdp.layers import WSConv2D
from tfdp.models.applications import APPLICATIONS
from tfdp.models.applications import convnext_tiny
from tfdp.models.applications import densenet121
from tfdp.models.applications import efficientnet_b0
from tfdp.models.applications import freeze_batchnorm
from tfdp.models.applications import keras_application
from tfdp.models.applications import mobilenet_v2
from tfdp.models.find_batchnorm import find_batchnorm
from tfdp.models.replace_batchnorm import replace_batchnorm
from tfdp.models.resnet_v2 import resnet_v2
from tfdp.models.resnets import resnet101
from tfdp.models.resnets import resnet152
from tfdp.models.resnets import resnet18
from tfdp.models.resnets import resnet34
from tfdp.models.resnets import resnet50
from tfdp.models.small_convnet import small_convnet
from tfdp.models.sub_blocks import SUB_BLOCKS
from tfdp.models.sub_blocks import sub_block_layers
from tfdp.models.transfer import FREEZABLE_SUB_BLOCKS
from tfdp.models.transfer import freeze_sub_blocks
from tfdp.models.transfer import load_pretrained
from tfdp.models.transfer import load_weights_matching
from tfdp.models.transfer import pretrained
from tfdp.models.transfer import replace_head
from tfdp.models.vgg_cifar import vgg_cifar
from tfdp.models.vit import vit
from tfdp.models.vit import vit_b16
from tfdp.models.vit import vit_s16
from tfdp.models.vit import vit_ti16
from tfdp.models.wide_resnet_gn import wide_resnet_gn

__all__ = [
    "APPLICATIONS",
    "AddPositionEmbedding",
    "ClassToken",
    "FREEZABLE_SUB_BLOCKS",
    "GroupNormalization",
    "LayerScale",
    "SUB_BLOCKS",
    "WSConv2D",
    "convnext_tiny",
    "densenet121",
    "efficientnet_b0",
    "find_batchnorm",
    "freeze_batchnorm",
    "freeze_sub_blocks",
    "freeze_unclippable",
    "keras_application",
    "load_pretrained",
    "load_weights_matching",
    "mobilenet_v2",
    "pretrained",
    "replace_batchnorm",
    "replace_head",
    "resnet101",
    "resnet152",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet_v2",
    "small_convnet",
    "sub_block_layers",
    "vgg_cifar",
    "vit",
    "vit_b16",
    "vit_s16",
    "vit_ti16",
    "wide_resnet_gn",
]
