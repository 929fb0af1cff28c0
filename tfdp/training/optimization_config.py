"""`OptimizationConfig`: the trainer's optimisation recipe, as gin binds it."""

import dataclasses

import gin

from tfdp import validation

LR_SCHEDULES = ("cosine", "constant")


@gin.configurable(module="tfdp.training")
@dataclasses.dataclass(frozen=True)
class OptimizationConfig:
    """How long a run trains, on how many examples per update, and how it steps.

    The logical batch and the epochs also fix the sampling rate and the
    steps that the privacy accounting counts. Read by the run's contract
    (`tfdp.training.run_contract`) and the model stage (`tfdp.training.model_setup.make_optimizer`).

    Args:
        epochs: float. Passes over the data (expected, for Poisson).
            Defaults to 10.
        logical_batch_size: int. Expected (Poisson) or exact (shuffle)
            examples per noisy update. Defaults to 256.
        base_lr: float. Learning rate per 256 examples of the logical batch.
            Defaults to 0.1.
        lr_schedule: str. "cosine" (warmup + cosine to 0) or "constant".
            Defaults to "cosine".
        warmup_epochs: float. Linear warmup length. Defaults to 0.
        weight_decay: float. In-loss L2 (clipped with the gradient).
            Defaults to 0.
        optimizer_fn: callable or None. `(learning_rate) -> optimizer`.
            Defaults to None: `tfdp.optim.make_optimizer` (SGD, Nesterov
            0.9).
    """

    epochs: float = 10.0
    logical_batch_size: int = 256
    base_lr: float = 0.1
    lr_schedule: str = "cosine"
    warmup_epochs: float = 0.0
    weight_decay: float = 0.0
    optimizer_fn: object = None

    def __post_init__(self):
        if not (validation.is_real(self.epochs) and self.epochs > 0):
            raise ValueError(f"epochs must be > 0. Received: epochs={self.epochs!r}")
        if not validation.is_int(self.logical_batch_size) or self.logical_batch_size < 1:
            raise ValueError("logical_batch_size must be an integer >= 1. "
                             f"Received: logical_batch_size={self.logical_batch_size!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}. "
                             f"Received: lr_schedule={self.lr_schedule!r}")
        for name in ("warmup_epochs", "weight_decay"):
            value = getattr(self, name)
            if not (validation.is_real(value) and value >= 0):
                raise ValueError(f"{name} must be >= 0. Received: {name}={value!r}")
