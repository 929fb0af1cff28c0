"""Parameter-efficient private fine-tuning: what of a pretrained model trains."""

from tfdp.finetune.bitfit import BitFitSummary
from tfdp.finetune.bitfit import bitfit
from tfdp.finetune.lora import LoraSummary
from tfdp.finetune.lora import lora
from tfdp.finetune.lora import lora_layers
from tfdp.finetune.lora import merge_lora

__all__ = ["BitFitSummary", "LoraSummary", "bitfit", "lora", "lora_layers", "merge_lora"]
