"""Parameter-efficient private fine-tuning: what of a pretrained model trains."""

from tfdp.finetune.bitfit import BitFitSummary
from tfdp.finetune.bitfit import bitfit
from tfdp.finetune.cached_features import cache_features
from tfdp.finetune.cached_features import check_cacheable
from tfdp.finetune.cached_features import split_last_layer

__all__ = ["BitFitSummary", "bitfit"]
__all__ += ["cache_features", "check_cacheable", "split_last_layer"]
