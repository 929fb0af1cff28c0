"""Parameter-efficient private fine-tuning: what of a pretrained model trains."""

from tfdp.finetune.bitfit import BitFitSummary
from tfdp.finetune.bitfit import bitfit
from tfdp.finetune.cached_features import cache_features
from tfdp.finetune.cached_features import check_cacheable
from tfdp.finetune.cached_features import split_last_layer
from tfdp.finetune.last_layer import LastLayerSummary
from tfdp.finetune.last_layer import last_layer
from tfdp.finetune.lora import LoraSummary
from tfdp.finetune.lora import lora
from tfdp.finetune.lora import lora_layers
from tfdp.finetune.lora import merge_lora

__all__ = ["BitFitSummary", "LastLayerSummary", "LoraSummary", "bitfit", "cache_features",
           "check_cacheable", "last_layer", "lora", "lora_layers", "merge_lora",
           "split_last_layer"]
