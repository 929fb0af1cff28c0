"""`ModelConfig`: the trainer's model, as gin binds it (`ModelConfig.model_fn = ...`)."""

import dataclasses

import gin

from tfdp import validation

FINETUNE_MODES = ("full", "last_layer", "bitfit", "lora")
DEFAULT_LORA_RANK = 8


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
        finetune: str. What of the (pretrained) model trains, after
            `init_checkpoint` and `freeze_sub_blocks`: "full" (every
            trainable variable); "last_layer" (the head alone, `head_dense`
            or the last Dense layer); "bitfit" (the biases, normalisation
            offsets and the head, `tfdp.finetune.bitfit`); "lora" (low-rank
            factors of every Dense, EinsumDense and Conv kernel but the
            head's, and the head, `tfdp.finetune.lora`). The run logs what
            trains and how many parameters before training
            (docs/FINETUNING.md). Defaults to "full".
        lora_rank: int or None. The factors' rank under finetune="lora";
            None: 8. Defaults to None.
    """

    model_fn: object = gin.REQUIRED
    init_checkpoint: object = None
    freeze_sub_blocks: int = 0
    ema_decay: object = None
    finetune: str = "full"
    lora_rank: object = None

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
        if self.finetune not in FINETUNE_MODES:
            raise ValueError(f"finetune must be one of {FINETUNE_MODES}. "
                             f"Received: finetune={self.finetune!r}")
        rank = self.lora_rank
        if rank is not None and (self.finetune != "lora" or not validation.is_int(rank)
                                 or rank < 1):
            raise ValueError(
                "lora_rank is a positive integer, for finetune='lora' only. Received: "
                f"lora_rank={rank!r}, finetune={self.finetune!r}")
