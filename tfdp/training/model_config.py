"""`ModelConfig`: the trainer's model, as gin binds it (`ModelConfig.model_fn = ...`)."""

import dataclasses

import gin

from tfdp import validation


@gin.configurable(module="tfdp.training")
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model a run trains: its architecture, initialisation and evaluated average.

    Read by the model stage (`tfdp.training.model_setup.build_model`).

    Args:
        model_fn: callable. `(num_classes=, input_shape=) -> keras.Model`,
            e.g. `@tfdp.models.small_convnet`. Required.
        init_checkpoint: str or None. A `.keras` model of another run (e.g.
            the non-private Places365 pretraining) whose weights initialise
            every layer but the head (`head_dense`), which starts fresh. A
            mismatch is an error listing what did not match. Defaults to
            None.
        freeze_sub_blocks: int. Freeze the first k of (stem, block_group1,
            ..., block_group4); the paper's "3 frozen block groups" is k=4.
            Frozen variables get no per-example work. Defaults to 0.
        ema_decay: float or None. Evaluate (and export) an exponential
            moving average of the parameters with this decay. Defaults to
            None (off).
    """

    model_fn: object = gin.REQUIRED
    init_checkpoint: object = None
    freeze_sub_blocks: int = 0
    ema_decay: object = None

    def __post_init__(self):
        if not callable(self.model_fn):
            raise ValueError(
                "model_fn must be a callable `(num_classes=, input_shape=) -> keras.Model`, "
                "e.g. ModelConfig.model_fn = @tfdp.models.small_convnet. "
                f"Received: model_fn={self.model_fn!r}")
        k = self.freeze_sub_blocks
        if not validation.is_int(k) or k < 0:
            raise ValueError(
                f"freeze_sub_blocks must be an integer >= 0. Received: freeze_sub_blocks={k!r}")
