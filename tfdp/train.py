"""DP-SGD training of image classifiers, configured by gin.

    python -m tfdp.train                                   # offline default
    python -m tfdp.train --gin_file=gin/imagenet_r18_places.gin --workdir=/tmp/run

`--gin_file` is repeatable (later files override earlier ones) and
`--gin_param` bindings are applied last. Rerunning the same command with the
same workdir resumes from the last checkpoint.
"""

import dataclasses
import os
import re
import sys

# Quiet TF's C++ start-up chatter; must precede the first TensorFlow import.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
import gin  # noqa: E402

from tfdp import config  # noqa: E402
from tfdp import tensorflow_startup  # noqa: E402
from tfdp import training  # noqa: E402
from tfdp import validation  # noqa: E402

DEFAULT_GIN_FILE = "mnist_default.gin"

_GIN_FILE = flags.DEFINE_multi_string("gin_file", None, "Gin config file(s); later override earlier.")
_GIN_PARAM = flags.DEFINE_multi_string("gin_param", None, "Gin bindings, applied after the files.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory. Defaults to ./workdir/<gin file stem>[-<the --gin_param bindings>].")
_SEED = flags.DEFINE_integer(
    "seed", 0,
    "Public seed: initialisation, augmentation and the data splits. The noise and the "
    "sampling never use it: they come from a secret key drawn from the OS's entropy "
    "(see PrivacyConfig.insecure_reproducible_seed).",
)
_STRATEGY = flags.DEFINE_string("strategy", None, "one_device | mirrored | multi_worker_mirrored | tpu.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Parse, build, calibrate, plan and run two steps on mock data; then stop."
)
_TRACEBACK = flags.DEFINE_bool("traceback", False, "Show full tracebacks for configuration errors.")


def moved_bindings():
    """`{"train.epochs": "OptimizationConfig.epochs", ...}`: each trainer binding's config.

    Bindings of the trainer's settings as `train` parameters are reported
    with the config that holds them (`tfdp.config.register_moved_bindings`).
    """
    return {f"train.{field.name}": f"{cls.__name__}.{field.name}"
            for cls in training.TRAINER_CONFIGS for field in dataclasses.fields(cls)
            if field.init}


config.register_moved_bindings(moved_bindings())


@gin.configurable(module="tfdp", denylist=["workdir", "seed", "strategy_name", "dry_run"])
def train(workdir, seed=0, strategy_name=None, dry_run=False, *, data_config=None,
          model_config=None, privacy_config=None, optimization_config=None, run_config=None):
    """Trains a classifier with DP-SGD (or without, for public pretraining).

    Each config left None is made from its gin bindings (`DataConfig()`
    reads `DataConfig.dataset = ...`); `python -m tfdp.train --help` lists
    them all.

    Args:
        workdir: str. Checkpoints, TensorBoard logs, gin configs, summary,
            report and model: the chief's; the other workers of a
            multi-worker run only read its checkpoints.
        seed: int. Run seed. Defaults to 0.
        strategy_name: str. Overrides `RunConfig.strategy` (from `--strategy`).
        dry_run: bool. Plan, calibrate and time two steps on mock data of
            the dataset's shapes, then stop. Defaults to False.
        data_config: `tfdp.training.DataConfig` or None. The data and its
            augmentation. Defaults to None (`DataConfig()`).
        model_config: `tfdp.training.ModelConfig` or None. The model, its
            initialisation and EMA. Defaults to None (`ModelConfig()`).
        privacy_config: `tfdp.training.PrivacyConfig` or None. The privacy
            request, the sampler, the clipping and the key. Defaults to None
            (`PrivacyConfig()`).
        optimization_config: `tfdp.training.OptimizationConfig` or None.
            Epochs, logical batch, learning rate and optimizer. Defaults to
            None (`OptimizationConfig()`).
        run_config: `tfdp.training.RunConfig` or None. Physical batch,
            strategy, precision, logging, checkpoints and outputs. Defaults
            to None (`RunConfig()`).

    Returns:
        A dict with the final metrics, ε, δ and steps.

    Raises:
        tfdp.training.workers.LostWorkerError: a worker of a multi-worker
            run stopped; rerunning resumes from the last checkpoint.
        ValueError: a configuration or checkpoint that cannot run.
    """
    # Imported here, not at the top: keeps TensorFlow out of --help and of the
    # flag and gin checks that run before it (`main`).
    import keras

    from tfdp import distribute
    from tfdp.training import dry_run as dry_run_lib, guards, loop, model_setup, outputs
    from tfdp.training import reporting, resume, run_contract, run_data, workers

    data_config = data_config or training.DataConfig()
    model_config = model_config or training.ModelConfig()
    privacy = privacy_config or training.PrivacyConfig()
    optimization = optimization_config or training.OptimizationConfig()
    run = run_config or training.RunConfig()
    # Created first: MultiWorkerMirroredStrategy must exist before other TF ops.
    dist = distribute.get_strategy(strategy_name or run.strategy)
    # Only the chief writes logs, configs, the summary, the report and the
    # model (out_dir); another worker writes only its share of each
    # checkpoint, into a scratch removed when it ends, and a worker lost on
    # the way is reported in one line (`LostWorkerError`).
    with workers.worker_run(dist, workdir) as worker:
        out_dir = worker.out_dir
        keras.utils.set_random_seed(seed)
        if worker.chief:
            os.makedirs(workdir, exist_ok=True)

        data = run_data.load_run_data(
            data_config, seed=seed, dry_run=dry_run, privacy_unit=privacy.privacy_unit,
            report_non_dp_statistics=run.report_non_dp_statistics)
        contract, batching = run_contract.make_contract_and_batching(
            data.train, dist, privacy=privacy, optimization=optimization, run=run,
            workdir=workdir, read_checkpoint=not dry_run)
        model = model_setup.build_model(dist, data.info, model_config, dry_run=dry_run,
                                        mixed_precision=run.mixed_precision)
        clipping_plan = run_contract.make_clipping_plan(model, batching, data.info, privacy)
        method = clipping_plan.method if clipping_plan else privacy.clipping_method
        step_settings = dict(method=method, weight_decay=optimization.weight_decay,
                             augmentation_multiplicity=data_config.augmentation_multiplicity)
        with dist.scope():
            optimizer = model_setup.make_optimizer(optimization, contract)
            step_fn = model_setup.make_train_step(model, optimizer, contract, batching, seed=seed,
                                                  jit_compile=run.jit_compile, **step_settings)
        ema = model_setup.make_ema(model, model_config.ema_decay)
        probe = guards.probe_settings(contract.engine, group_size=batching.group_size,
                                      **step_settings)
        if dry_run:
            return dry_run_lib.dry_run(model, step_fn, data.info, contract, batching,
                                       clipping_plan=clipping_plan, probe_settings=probe)

        # Weights, optimizer state (its iteration count is the step), ledger and,
        # for banded noise, the last b - 1 noise tensors: a resumed run continues
        # the same correlated noise.
        state = resume.restore_run(workdir, dist, model, optimizer, ema, contract,
                                   noise_state=step_fn.variables_to_checkpoint(),
                                   save_dir=worker.checkpoint_dir)
        # The workdir's summary, on every worker: all of them stop at once.
        finished = reporting.finished_summary(workdir, state.start_step, contract.budget_steps,
                                              workdir)
        if finished is not None:
            return finished
        if out_dir is not None:
            with open(os.path.join(out_dir, "config.gin"), "w") as f:
                f.write(gin.config_str())
        run_contract.log_run_contract(model, contract, batching, dataset=data_config.dataset,
                                      clipping_plan=clipping_plan, out_dir=out_dir,
                                      duplicates_kept=data.duplicates_kept)
        adapted = guards.check_before_training(model, data.info, batching, probe,
                                               preprocess=data.train_preprocess)
        reporter = reporting.make_run_reporter(
            out_dir, contract, state, data, adapted_state=adapted,
            report_non_dp_statistics=run.report_non_dp_statistics)
        evaluate_epoch = loop.epoch_evaluation(model, data, ema, reporter, config=run)
        step, epsilon = loop.train_loop(dist, step_fn, ema, state, contract, batching, data,
                                        reporter, evaluate_epoch, seed=seed, config=run)
        return outputs.write_outputs(out_dir, model, ema, reporter, contract, state, data,
                                     steps=step, epsilon=epsilon, config=run)


def _quiet_startup_noise():
    """One-line warnings, each message once a run (`tfdp.config` resolves gin includes,
    so gin logs no probes).

    A run checks the same thing wherever it builds or reads its contract
    (δ against 1/N when σ is calibrated and again for the ledger); the
    command line says it once.
    """
    import warnings

    shown = set()

    def show_once(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text not in shown:
            shown.add(text)
            (file or sys.stderr).write(f"warning: {text}\n")

    warnings.showwarning = show_once


def default_workdir(gin_files, gin_params):
    """`workdir/<last gin file's stem>[_<name>-<value> of each binding, shortened>]`.

    Each configuration gets its own directory, so that a command run after
    another with other bindings starts afresh instead of meeting the first
    run's checkpoint (which a change of privacy settings may not resume).
    The name holds letters, digits, `_`, `-` and `.` only, e.g.
    `workdir/mnist_default_target_epsilon-3.0`. A directory of an earlier
    naming (`<stem>-<name>=<value>,...`) that exists is resumed.
    """
    stem = os.path.splitext(os.path.basename(gin_files[-1]))[0]
    named, earlier = [], []
    for binding in gin_params:
        name, _, value = binding.partition("=")
        name = name.strip().rsplit(".", 1)[-1]
        value = re.sub(r"[^A-Za-z0-9_.-]+", "_", value.strip()).strip("_")
        named.append(f"{name}-{value}" if value else name)
        earlier.append(f"{name}={value}" if value else name)
    earlier_dir = _workdir_name(stem, "-", ",".join(earlier))
    if gin_params and os.path.isdir(earlier_dir):
        return earlier_dir
    return _workdir_name(stem, "_", "_".join(named))


def _workdir_name(stem, separator, suffix):
    if len(suffix) > 80:  # Readable where short, unique where long.
        import hashlib

        suffix = suffix[:60] + "-" + hashlib.sha256(suffix.encode()).hexdigest()[:8]
    return os.path.join("workdir", f"{stem}{separator}{suffix}" if suffix else stem)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    gin_files = _GIN_FILE.value or [DEFAULT_GIN_FILE]
    try:  # Before TensorFlow's import, which takes seconds.
        config.precheck(gin_files, _GIN_PARAM.value or [], validators={
            "PrivacyConfig.l2_norm_clip": validation.validate_l2_norm_clip,
            "PrivacyConfig.noise_multiplier": validation.validate_noise_multiplier,
            "PrivacyConfig.target_epsilon": validation.validate_epsilon,
            "PrivacyConfig.delta": validation.validate_delta,
        })
    except ValueError as e:
        _exit_with_error(e)
    tensorflow_startup.import_tensorflow()
    # Imported here, after TensorFlow (which it needs), not at the top: keeps
    # TensorFlow out of --help and of the checks above.
    from tfdp.training import workers

    absl_logging.set_verbosity(absl_logging.WARNING)
    _quiet_startup_noise()
    workdir, created = None, False
    try:
        config.parse(gin_files, _GIN_PARAM.value or [])
        workdir = _WORKDIR.value or default_workdir(gin_files, _GIN_PARAM.value or [])
        # Only the chief creates the workdir, so only it may remove one
        # (another worker may start, and fail, before the chief creates it).
        created = not os.path.exists(workdir) and _is_chief_process()
        train(workdir, seed=_SEED.value, strategy_name=_STRATEGY.value, dry_run=_DRY_RUN.value)
        if _DRY_RUN.value and created:  # A dry run writes nothing a real run would resume.
            _remove_unused_workdir(workdir)
    except KeyboardInterrupt:
        print(f"\ninterrupted: rerun the same command to resume from the last checkpoint "
              f"in {os.path.join(workdir or 'workdir', 'checkpoints')}", file=sys.stderr)
        # The run's files are closed by now (the interrupt unwound their
        # blocks). Exit without the interpreter's finalisation: TensorFlow's
        # threads still running (the input pipeline, a step in flight) can
        # abort the process as they are torn down, which turns Ctrl-C early
        # in a run into SIGABRT and a crash dump.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    except workers.LostWorkerError as e:
        _exit_with_error(e, code=workers.LOST_WORKER_EXIT_CODE)
    except (ValueError, FloatingPointError, MemoryError) as e:
        if created:
            _remove_unused_workdir(workdir)
        _exit_with_error(e)


def _is_chief_process():
    # Imported here, not at the top: keeps TensorFlow out of --help.
    from tfdp import distribute

    return distribute.is_chief_process()


def _exit_with_error(error, code=2):
    """One `error:` line and exit code `code` (the traceback with --traceback)."""
    if _TRACEBACK.value:
        raise error
    message = " ".join(str(error).split())
    # gin appends "In call to configurable 'x' (<function x at 0x...>)".
    message = re.sub(r"\s*In call to configurable '[^']*' \(<[^>]*>\)", "", message)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


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


def _documented_args(cls):
    """`{name: (kind, text)}` of the Args section of `cls`'s docstring."""
    args = (cls.__doc__ or "").split("Args:", 1)[-1]
    entries = re.findall(r"^ {8}(\w+): (.*?)(?=^ {8}\w+: |\Z)", args, re.M | re.S)
    documented = {}
    for name, text in entries:
        kind, _, text = " ".join(text.split()).partition(". ")
        documented[name] = (kind.rstrip("."), text)
    return documented


def bindings_help(width=100):
    """The trainer's gin bindings by config, each with its default and description.

    One block per config of `tfdp.training.TRAINER_CONFIGS`: a line naming
    it, then per field `  Config.name = default (kind)` and its whole
    description from the config's docstring, wrapped to `width` columns.
    """
    import textwrap

    blocks = []
    for cls in training.TRAINER_CONFIGS:
        documented = _documented_args(cls)
        lines = [f"{cls.__name__}: {cls.__doc__.strip().splitlines()[0]}"]
        for field in dataclasses.fields(cls):
            if not field.init:
                continue
            kind, text = documented[field.name]
            default = "REQUIRED" if field.default is gin.REQUIRED else repr(field.default)
            lines.append(f"  {cls.__name__}.{field.name} = {default} ({kind})")
            lines += textwrap.wrap(text, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _print_help():
    """`--help`: the usage, the flags and the trainer's bindings; exit code 0."""
    print(__doc__.rstrip())
    print("\nflags:\n")
    print(flags.FLAGS.module_help(sys.modules[__name__]))
    print("\ngin bindings, by config (--gin_param='CONFIG.NAME = VALUE'; full text: "
          "help(tfdp.training.CONFIG)):\n")
    print(bindings_help())
    print("\nOwn images: DataConfig.dataset = 'folder:<dir>', 'tfrecord:<glob>' or "
          "'npz:<file>' (docs/DATA.md).")


if __name__ == "__main__":
    if any(arg in _HELP_FLAGS for arg in sys.argv[1:]):
        _print_help()
        sys.exit(0)
    app.run(main)
