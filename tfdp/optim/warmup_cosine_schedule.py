"""Linear-warmup, cosine-decay learning rate with batch-size scaling."""

import math

import gin
import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfdp")
class WarmupCosineSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to a batch-scaled peak, then cosine decay to zero.

    With `peak = base_lr * logical_batch_size / 256` (the linear scaling rule
    of the paper's code):

    - `lr(step) = peak * step / warmup_steps` for `step < warmup_steps`;
    - `lr(step) = peak * 0.5 * (1 + cos(pi * t))` afterwards, with
      `t = (step - warmup_steps) / (total_steps - warmup_steps)` clipped to
      `[0, 1]`, so `lr(total_steps) = 0` and it stays 0 after.

    `step` counts optimizer updates, i.e. logical (noised) batches, not
    micro-batches of gradient accumulation.

    Args:
        base_lr: float. Learning rate for a logical batch of 256.
        logical_batch_size: int. Examples per noised update.
        total_steps: int. Number of updates of the whole run.
        warmup_steps: int. Updates of linear warmup, in
            `[0, total_steps)`. Defaults to `0`.
    """

    def __init__(self, base_lr, logical_batch_size, total_steps, warmup_steps=0):
        if base_lr < 0:
            raise ValueError(f"`base_lr` must be >= 0. Received: base_lr={base_lr}")
        if logical_batch_size < 1:
            raise ValueError(
                "`logical_batch_size` must be >= 1. "
                f"Received: logical_batch_size={logical_batch_size}"
            )
        if total_steps < 1:
            raise ValueError(
                f"`total_steps` must be >= 1. Received: total_steps={total_steps}"
            )
        if not 0 <= warmup_steps < total_steps:
            raise ValueError(
                "`warmup_steps` must be in [0, total_steps). "
                f"Received: warmup_steps={warmup_steps}, total_steps={total_steps}"
            )
        self.base_lr = float(base_lr)
        self.logical_batch_size = int(logical_batch_size)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)

    @property
    def peak_learning_rate(self):
        return self.base_lr * self.logical_batch_size / 256.0

    def __call__(self, step):
        step = ops.cast(step, "float32")
        peak = self.peak_learning_rate
        # max(.., 1) keeps the division defined when warmup_steps == 0; that
        # branch is then never selected.
        warmup = peak * step / max(self.warmup_steps, 1)
        progress = (step - self.warmup_steps) / (
            self.total_steps - self.warmup_steps
        )
        progress = ops.clip(progress, 0.0, 1.0)
        cosine = peak * 0.5 * (1.0 + ops.cos(math.pi * progress))
        return ops.where(step < self.warmup_steps, warmup, cosine)

    def get_config(self):
        return {
            "base_lr": self.base_lr,
            "logical_batch_size": self.logical_batch_size,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
        }


@gin.configurable(module="tfdp.optim")
def warmup_cosine_schedule(base_lr, logical_batch_size, total_steps, warmup_steps=0):
    """Builds a `WarmupCosineSchedule`; see the class for the formula.

    Args:
        base_lr: float. Learning rate for a logical batch of 256 (the paper's
            best run: 0.03 at batch 65,536, i.e. a peak of 7.68).
        logical_batch_size: int. Examples per noised update.
        total_steps: int. Number of updates of the whole run.
        warmup_steps: int. Updates of linear warmup. Defaults to `0`.

    Returns:
        A `WarmupCosineSchedule`.
    """
    return WarmupCosineSchedule(base_lr, logical_batch_size, total_steps, warmup_steps)
