"""Optimizers, learning-rate schedules and weight-decay targets."""

from tfdp.optim.make_optimizer import make_optimizer
from tfdp.optim.parameter_ema import ParameterEMA
from tfdp.optim.warmup_cosine_schedule import WarmupCosineSchedule
from tfdp.optim.warmup_cosine_schedule import warmup_cosine_schedule
from tfdp.optim.weight_decay_variables import weight_decay_variables

__all__ = [
    "ParameterEMA",
    "WarmupCosineSchedule",
    "make_optimizer",
    "warmup_cosine_schedule",
    "weight_decay_variables",
]
