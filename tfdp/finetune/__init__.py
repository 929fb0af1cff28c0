"""Parameter-efficient private fine-tuning: what of a pretrained model trains."""

from tfdp.finetune.bitfit import BitFitSummary
from tfdp.finetune.bitfit import bitfit

__all__ = ["BitFitSummary", "bitfit"]
