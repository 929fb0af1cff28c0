"""The trainer's model stage: the model, its optimizer and schedule, the train step."""

import os

from tfdp import distribute
from tfdp import dp
from tfdp import finetune
from tfdp import models
from tfdp import optim
from tfdp.training import evaluation
from tfdp.training import model_config
from tfdp.training import reporting


def build_model(strategy, info, config, *, mixed_precision, dry_run):
    """`config.model_fn`'s model in the strategy's scope, initialised and frozen as asked.

    Args:
        strategy: `tf.distribute.Strategy`.
        info: `tfdp.data.DatasetInfo`. Classes and input shape.
        config: `tfdp.training.ModelConfig`. The model function, the
            checkpoint that initialises every layer but the head, and the
            sub-blocks to freeze.
        mixed_precision: bool. Build under Keras' "mixed_bfloat16".
        dry_run: bool. A missing `init_checkpoint` is then only reported.
    """
    model_fn, init_checkpoint = config.model_fn, config.init_checkpoint
    freeze_sub_blocks = config.freeze_sub_blocks
    with strategy.scope(), distribute.precision_policy(mixed_precision):
        model = model_fn(num_classes=info.num_classes, input_shape=tuple(info.image_shape))
    if init_checkpoint:
        if dry_run and not os.path.exists(init_checkpoint):
            reporting.log(
                f"dry run: init checkpoint {init_checkpoint} not found; a real run loads it")
        else:
            models.load_weights_matching(model, init_checkpoint, skip=("head_dense",))
            reporting.log(f"initialised from {init_checkpoint} (new head)")
    if freeze_sub_blocks:
        models.freeze_sub_blocks(model, freeze_sub_blocks)
        reporting.log(f"froze the first {freeze_sub_blocks} of {models.FREEZABLE_SUB_BLOCKS}")
    apply_finetune(model, config, strategy)
    return model


def apply_finetune(model, config, strategy):
    """Narrows what trains to `config.finetune`'s share and logs it (nothing for "full").

    Args:
        model: keras.Model. Built, initialised and frozen as asked.
        config: `tfdp.training.ModelConfig`.
        strategy: `tf.distribute.Strategy`: LoRA's factors are variables,
            made in its scope.

    Returns:
        The mode's summary (`tfdp.finetune`), or None for "full".
    """
    mode = config.finetune
    if mode == "full":
        return None
    if not config.init_checkpoint:
        reporting.log(f"warning: finetune={mode!r} without ModelConfig.init_checkpoint trains "
                      "part of a freshly initialised model")
    with strategy.scope():
        if mode == "last_layer":
            summary = finetune.last_layer(model)
        elif mode == "bitfit":
            summary = finetune.bitfit(model)
        else:
            summary = finetune.lora(model, config.lora_rank or model_config.DEFAULT_LORA_RANK)
    reporting.log(f"fine-tuning: {summary}")
    return summary


def make_schedule(lr_schedule, *, base_lr, logical_batch_size, total_steps, warmup_steps):
    """The learning rate: "cosine" (warmup then cosine to 0) or "constant".

    The rate is `base_lr` per 256 examples of the logical batch.
    """
    if lr_schedule == "cosine":
        return optim.warmup_cosine_schedule(base_lr, logical_batch_size, total_steps, warmup_steps)
    if lr_schedule == "constant":
        return base_lr * logical_batch_size / 256.0
    raise ValueError(
        f"lr_schedule must be 'cosine' or 'constant'. Received: lr_schedule={lr_schedule!r}"
    )


def make_optimizer(config, contract):
    """`config.optimizer_fn`'s optimizer, its learning rate scheduled over `contract`'s steps.

    Args:
        config: `tfdp.training.OptimizationConfig`.
        contract: `tfdp.training.run_contract.RunContract`. The planned steps.
    """
    warmup_steps = min(int(round(config.warmup_epochs * contract.sampler.steps_per_epoch)),
                       contract.total_steps - 1)
    schedule = make_schedule(
        config.lr_schedule, base_lr=config.base_lr,
        logical_batch_size=config.logical_batch_size, total_steps=contract.total_steps,
        warmup_steps=warmup_steps)
    return (config.optimizer_fn or optim.make_optimizer)(learning_rate=schedule)


def make_train_step(model, optimizer, contract, batching, *, method, weight_decay, seed,
                    jit_compile, augmentation_multiplicity):
    """`tfdp.dp.PrivateTrainStep` of `contract.engine`, or the non-private step."""
    if contract.engine is not None:
        return dp.PrivateTrainStep(
            model, optimizer, evaluation.per_example_loss, engine=contract.engine,
            method=method, weight_decay=weight_decay, seed=seed, jit_compile=jit_compile,
            augmentation_multiplicity=augmentation_multiplicity,
            group_size=batching.group_size,
        )
    return dp.NonPrivateTrainStep(
        model, optimizer, evaluation.per_example_loss,
        expected_batch_size=contract.sampler.expected_batch_size,
        weight_decay=weight_decay, seed=seed, jit_compile=jit_compile,
    )


def make_ema(model, ema_decay):
    """`tfdp.optim.ParameterEMA` of the trainable variables, or None."""
    return optim.ParameterEMA(model.trainable_variables, ema_decay) if ema_decay else None


def export_model(model, ema, out_dir):
    """`model.keras` and a SavedModel (with the EMA's parameters, when there is one)."""
    if ema is not None:
        ema.copy_to_parameters()
    model.save(os.path.join(out_dir, "model.keras"))
    model.export(os.path.join(out_dir, "saved_model"), verbose=False)
    reporting.log(f"exported {os.path.join(out_dir, 'model.keras')} and {out_dir}/saved_model")
