"""Private hyperparameter selection: the best of a secret, random number of trainer runs.

`select_privately` draws K from a `TrialCount` and, for each trial, a
setting uniformly from the grid, both from the OS's entropy; runs the
trainer (`python -m tfdp.train`) once per trial in `W/trial_<i>/`; selects
the trial with the best accuracy on the validation split; and releases that
trial only, into `W/selected/`, written after every trial with fixed times
(`tfdp.tuning.release`). Every trial must be the same DP event (same
σ, steps, sampler, q, δ; the same data split), so the grid may vary only
settings that do not change it (`check_grid`); the selection is then
accounted as `RepeatAndSelectDpEvent` (`selection_accounting`).

What stays private, as the data does: everything in `W/` but `W/selected/`.
The trial count K is not covered by the selection's ε (the bound is for the
best run alone), nor are the other trials, their settings, the index of the
selected one, the logs and `W/selection.json` (which records them).
"""

import dataclasses
import itertools
import json
import os
import subprocess
import sys

import gin

from tfdp import config
from tfdp import privacy
from tfdp import training
from tfdp.tuning import existing_runs
from tfdp.tuning import release
from tfdp.tuning import selection_accounting
from tfdp.tuning import trial_count as trial_count_lib

# Fields of the trainer's configs that a grid may vary: they change what a
# run learns, not its DP event nor its data split. Every other field of
# PrivacyConfig (σ, ε, δ, the sampler, the unit, the key, ...) and these of
# DataConfig and OptimizationConfig must be the same in every trial.
VARIABLE_PRIVACY_FIELDS = ("l2_norm_clip", "clipping_method", "clipping_memory_budget_mb")
FIXED_FIELDS = {
    training.DataConfig: ("dataset", "data_dir", "validation_fraction", "test_dataset"),
    training.OptimizationConfig: ("epochs", "logical_batch_size"),
    training.PrivacyConfig: tuple(
        f.name for f in dataclasses.fields(training.PrivacyConfig)
        if f.init and f.name not in VARIABLE_PRIVACY_FIELDS),
}
PRIVATE_NOTE = """\
PRIVATE: everything in this directory except selected/ is as private as the
training data. The number of trials (trial_<i>/ directories), every trial's
setting, model, summary, logs and checkpoints, and selection.json are NOT
covered by the selection's epsilon; releasing any of them voids it.
selected/ is the release: the selected trial's model and summary, and
selected/selection.json with the selection's epsilon.
"""


def split_values(text):
    """`"0.1,(1, 2),'a,b'"` -> `["0.1", "(1, 2)", "'a,b'"]`: commas outside brackets and quotes."""
    values, depth, quote, current = [], 0, None, ""
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append(current.strip())
            current = ""
            continue
        current += char
    values.append(current.strip())
    return values


def parse_grid(specs):
    """`["BINDING=V1,V2", ...]` -> `{"BINDING": ["V1", "V2"], ...}` (gin literals).

    Args:
        specs: list of str. One `--grid` flag each.

    Returns:
        A dict from binding to its values, in the flags' order.
    """
    grid = {}
    for spec in specs:
        name, sep, values = spec.partition("=")
        name, values = name.strip(), split_values(values)
        if not sep or not name or any(not v for v in values):
            raise ValueError("A grid is BINDING=V1,V2,... with non-empty values, e.g. "
                             f"--grid='OptimizationConfig.base_lr=0.1,0.5'. Received: {spec!r}")
        if name in grid:
            raise ValueError(f"A binding appears in two --grid flags. Received: {name!r}")
        grid[name] = values
    if not grid:
        raise ValueError("A private selection needs a grid. Received: no --grid")
    return grid


def grid_settings(grid):
    """Every setting of the product grid: a tuple of `(binding, value)` pairs."""
    names = list(grid)
    return [tuple(zip(names, values)) for values in itertools.product(*grid.values())]


def as_gin_params(setting):
    """`(("A.b", "1"),)` -> `["A.b = 1"]`."""
    return [f"{name} = {value}" for name, value in setting]


def _fixed_values(gin_files, gin_params):
    """`{"PrivacyConfig.delta": value, ...}` of `FIXED_FIELDS`, as gin resolves them.

    Parsed as the trainer parses (`tfdp.config.parse`), so a misspelt
    binding is refused here, before any trial, not in every trial.
    """
    config.parse(gin_files, gin_params)
    try:
        return {f"{cls.__name__}.{name}": getattr(cls(), name)
                for cls, names in FIXED_FIELDS.items() for name in names}
    finally:
        gin.clear_config()


def check_grid(gin_files, gin_params, settings):
    """Refuses a configuration or grid whose trials would not be one private DP event.

    Each setting is resolved as the trainer resolves it (files, then
    `gin_params`, then the setting; macros included), and the fields of
    `FIXED_FIELDS` must agree across settings. The run must be private,
    from a secret key, with a validation split to select on.

    Args:
        gin_files: list of str. The trainer's `--gin_file`s.
        gin_params: list of str. The trainer's `--gin_param`s.
        settings: list of settings (`grid_settings`).
    """
    first = None
    for setting in settings:
        values = _fixed_values(gin_files, list(gin_params) + as_gin_params(setting))
        if first is None:
            first = values
            continue
        changed = sorted(name for name in values if values[name] != first[name])
        if changed:
            raise ValueError(
                "Every trial of a private selection must be the same DP event on the same data "
                "split, so the grid may not change "
                f"{', '.join(changed)} (vary the learning rate, C, the model, ... instead). "
                f"Received: {dict(settings[0])} gives "
                f"{ {n: first[n] for n in changed} }, {dict(setting)} gives "
                f"{ {n: values[n] for n in changed} }")
    if not first["DataConfig.validation_fraction"] > 0:
        raise ValueError(
            "A private selection selects on the validation split held out of the training data; "
            "set --gin_param='DataConfig.validation_fraction = 0.1'. "
            f"Received: DataConfig.validation_fraction={first['DataConfig.validation_fraction']}")
    if not first["PrivacyConfig.private"]:
        raise ValueError("A private selection selects among private runs. "
                         "Received: PrivacyConfig.private=False")
    if first["PrivacyConfig.insecure_reproducible_seed"] is not None:
        raise ValueError(
            "A private selection needs runs whose noise is secret; with a public seed no epsilon "
            "holds. Received: PrivacyConfig.insecure_reproducible_seed="
            f"{first['PrivacyConfig.insecure_reproducible_seed']}")


def run_trainer(trial_dir, gin_files, gin_params, seed):
    """Runs `python -m tfdp.train` into `trial_dir`; its output goes to `trial_dir/train.log`.

    Returns:
        The trainer's exit code.
    """
    os.makedirs(trial_dir, exist_ok=True)
    command = [sys.executable, "-m", "tfdp.train", f"--workdir={trial_dir}", f"--seed={seed}"]
    command += [f"--gin_file={f}" for f in gin_files]
    command += [f"--gin_param={p}" for p in gin_params]
    with open(os.path.join(trial_dir, "train.log"), "w") as log:
        return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode


def read_trial(trial_dir):
    """`(summary, ledger)` of a finished trial, or None if it wrote no summary."""
    summary_path = os.path.join(trial_dir, "summary.json")
    ledger_path = os.path.join(trial_dir, "checkpoints", "privacy_ledger.json")
    if not (os.path.isfile(summary_path) and os.path.isfile(ledger_path)):
        return None
    with open(summary_path) as f:
        summary = json.load(f)
    with open(ledger_path) as f:
        ledger = privacy.PrivacyLedger.from_dict(json.load(f))
    return summary, ledger


@dataclasses.dataclass(frozen=True)
class Trial:
    """One run of a private selection (private: never released as such).

    Args:
        workdir: str. `W/trial_<i>`.
        setting: tuple. Its `(binding, value)` pairs.
        returncode: int. The trainer's exit code.
        summary: dict or None. Its `summary.json`; None if it wrote none.
        ledger: `tfdp.privacy.PrivacyLedger` or None.
    """

    workdir: str
    setting: tuple
    returncode: int
    summary: dict = None
    ledger: object = None

    @property
    def validation_accuracy(self):
        if self.summary is None:
            return None
        return existing_runs.validation_accuracy(self.summary)


def run_trials(count, settings, generator, *, workdir, gin_files, gin_params, seed, trainer):
    """Draws a setting for each of `count` trials and runs them; returns the `Trial`s."""
    trials = []
    for index in range(count):
        setting = settings[int(generator.integers(len(settings)))]
        trial_dir = os.path.join(workdir, f"trial_{index}")
        returncode = trainer(trial_dir, gin_files, list(gin_params) + as_gin_params(setting),
                             seed)
        with open(os.path.join(trial_dir, "NOT_FOR_RELEASE.txt"), "w") as f:
            f.write(PRIVATE_NOTE)
        read = read_trial(trial_dir) if returncode == 0 else None
        trials.append(Trial(trial_dir, setting, returncode, *(read or (None, None))))
    return trials


def account(trials, trial_count):
    """`(epsilon, delta, run_epsilon, adjacency)` of the selection over `trials`.

    Every finished trial must be the same DP event at the same δ (the
    grid's check makes it so; this checks what the runs did).
    """
    finished = [t for t in trials if t.ledger is not None]
    events = {}
    for trial in finished:
        event, relation = selection_accounting.run_event(trial.ledger)
        events[trial.workdir] = (event, relation, trial.ledger.delta)
    if len(set(events.values())) > 1:
        raise ValueError(
            "The trials were not the same DP event, so their selection cannot be accounted; "
            "nothing is released. Received: "
            f"{len(set(events.values()))} different (event, relation, delta): "
            f"{sorted(set(map(str, events.values())))}")
    event, relation, delta = next(iter(events.values()))
    epsilon = selection_accounting.selection_epsilon(event, relation, trial_count, delta)
    return epsilon, delta, finished[0].summary["epsilon"], finished[0].ledger.adjacency


def select_privately(*, gin_files, gin_params, grid, trial_count, workdir, seed=0,
                     generator=None, trainer=None):
    """Runs a private selection and writes `W/selected/` and `W/selection.json`.

    Args:
        gin_files: list of str. The trainer's `--gin_file`s.
        gin_params: list of str. The trainer's `--gin_param`s, before the
            grid's.
        grid: dict. `{binding: [gin literal, ...]}` (`parse_grid`); each
            trial binds one value of each, the setting drawn uniformly from
            the product.
        trial_count: `tfdp.tuning.TrialCount`.
        workdir: str. W; must not exist or be empty (a selection runs once).
        seed: int. The trainer's public `--seed`, the same for every trial,
            so every trial holds out the same validation split. Defaults to
            0.
        generator: `numpy.random.Generator` or None. Draws K and the
            settings. Defaults to None: `trial_count.secret_generator()`
            (a seeded one voids the guarantee; tests only).
        trainer: callable. `(trial_dir, gin_files, gin_params, seed) ->
            exit code`. Defaults to None: `run_trainer` (`python -m tfdp.train`).

    Returns:
        The public record (`W/selected/selection.json`) as a dict.
    """
    settings = grid_settings(grid)
    check_grid(gin_files, gin_params, settings)
    if os.path.isdir(workdir) and os.listdir(workdir):
        raise ValueError(
            "A private selection runs once, into a new workdir (a second selection on the same "
            f"data adds its epsilon to the first's). Received: workdir={workdir!r} is not empty")
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "PRIVATE.txt"), "w") as f:
        f.write(PRIVATE_NOTE)
    generator = generator or trial_count_lib.secret_generator()
    trainer = trainer or run_trainer
    count = trial_count.sample(generator)
    trials = run_trials(count, settings, generator, workdir=workdir, gin_files=gin_files,
                        gin_params=gin_params, seed=seed, trainer=trainer)
    selectable = [t for t in trials if t.validation_accuracy is not None]
    public = {
        "selection": "the trial of best validation accuracy among a secret random number of "
                     "trials, each of a setting drawn uniformly from the grid",
        "trial_count_distribution": trial_count.to_dict(),
        "grid": grid,
        "accountant": selection_accounting.ACCOUNTANT,
    }
    if selectable:
        selected = max(selectable, key=lambda t: t.validation_accuracy)  # Ties: the first.
        epsilon, delta, run_epsilon, adjacency = account(trials, trial_count)
        public.update(
            epsilon=epsilon, delta=delta, adjacency=adjacency, run_epsilon=run_epsilon,
            setting=dict(selected.setting), released=os.path.join(workdir, "selected"),
            validation_accuracy=selected.validation_accuracy,
            test_accuracy=selected.summary.get("test_accuracy"),
            privacy_guarantee=(
                f"(epsilon={epsilon:.4g}, delta={delta:g})-DP under {adjacency} adjacency for "
                "the training examples, for the release of the selected model with its "
                "summary and setting, against an adversary who knows the code, the "
                "configuration, the grid and the distribution of the trial count, but not the "
                "data, the trials' secret keys, the trial count nor the other trials. Not "
                "covered: the validation and other held-out examples, and the figures under "
                "not_covered_by_epsilon of the selected run's summary"))
    else:
        public.update(epsilon=None, released=None,
                      nothing_released="no trial was drawn" if count == 0 else
                      "no trial finished with a validation accuracy: see the trainer's logs, "
                      f"{os.path.join(workdir, 'trial_*', 'train.log')} (private)")
    with open(os.path.join(workdir, "selection.json"), "w") as f:
        json.dump(dict(public, private=PRIVATE_NOTE, trial_count=count,
                       selected_workdir=selected.workdir if selectable else None,
                       trials=[{"workdir": t.workdir, "setting": dict(t.setting),
                                "returncode": t.returncode,
                                "epsilon": t.summary["epsilon"] if t.summary else None,
                                "validation_accuracy": t.validation_accuracy}
                               for t in trials]), f, indent=2)
    if selectable:
        # Last, whole, with fixed times: nothing in it tells how many trials ran before it.
        release.write_release(selected.workdir, os.path.join(workdir, "selected"), public)
    return public
