"""Sweeps choose settings by validation accuracy; the test set gives the final number only.

A private selection (`python -m tfdp.tuning --grid=...`) is accounted as
dp_accounting's `RepeatAndSelectDpEvent`; choosing among existing runs is
not, and says so.
"""

import io
import json
import math
import os
import shutil
import stat
import subprocess
import sys
import time
import zipfile
from contextlib import redirect_stdout
from unittest import mock

import dp_accounting
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant
import numpy as np
import pytest
from scipy import stats
import tensorflow as tf

from tfdp import privacy
from tfdp import tuning
from tfdp.tuning import cli
from tfdp.tuning import private_selection
from tfdp.tuning import trial_count as trial_count_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Stands in for `python` in the sweep scripts: `-m tfdp.train` writes a
# summary whose validation and test accuracies disagree on the best run, and
# records its flags; anything else runs the real interpreter.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1 $2" = "-m tfdp.train" ]; then
  exec {python} -c '
import json, os, re, sys
args = sys.argv[1:]
workdir = [a.split("=", 1)[1] for a in args if a.startswith("--workdir=")][-1]
bindings = " ".join(a for a in args if a.startswith("--gin_param="))
value = float(re.search(r"(?:NOISE|EPSILON|EPOCHS) = ([0-9.]+)", bindings).group(1))
validation = "DataConfig.validation_fraction" in bindings
os.makedirs(workdir, exist_ok=True)
with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump({{"not_covered_by_epsilon": {{"validation_accuracy": 1 / (1 + abs(value - 1.0)) if validation else None}},
               "test_accuracy": value / 100, "epsilon": 8.0}}, f)
with open(os.path.join(workdir, "flags.txt"), "w") as f:
    f.write(bindings)
' "${{@:3}}"
fi
exec {python} "$@"
"""


def _summary(validation, test):
    return {"not_covered_by_epsilon": {"validation_accuracy": validation},
            "test_accuracy": test, "epsilon": 3.0}


class SelectByValidationTest(tf.test.TestCase):

    def test_selects_the_best_validation_run_not_the_best_test_run(self):
        summaries = {"a": _summary(0.70, 0.90), "b": _summary(0.80, 0.60), "c": _summary(0.75, 0.95)}
        self.assertEqual(tuning.select_by_validation(summaries), "b")
        lines = tuning.report(summaries, "b")
        self.assertIn("final test_accuracy=0.6000", lines[-1])
        # Only the selected run's test accuracy is shown.
        self.assertNotIn("0.9000", "\n".join(lines))
        self.assertNotIn("0.9500", "\n".join(lines))

    def test_final_line_does_not_present_one_runs_epsilon_as_the_selections(self):
        summaries = {"a": _summary(0.70, 0.90), "b": _summary(0.80, 0.60), "c": _summary(0.75, 0.95)}
        guarantee = tuning.selection_guarantee(summaries, "b")
        self.assertEqual((guarantee.runs, guarantee.run_epsilon), (3, 3.0))
        self.assertIsNone(guarantee.epsilon)  # Not accounted.
        final = tuning.report(summaries, "b")[-1]
        self.assertIn("selected over 3 runs by accuracy on private validation data: the "
                      "selection is NOT COVERED by epsilon (the selected run's own "
                      "epsilon=3.000 covers that run only)", final)
        # The run's ε appears only as that run's own.
        self.assertNotIn("final test_accuracy=0.6000 epsilon=", final)
        self.assertEqual(final.count("epsilon="), 1)

    def test_runs_without_validation_are_an_error(self):
        with self.assertRaisesRegex(ValueError, r"DataConfig.validation_fraction.*\['a'\]"):
            tuning.select_by_validation({"a": _summary(None, 0.9), "b": _summary(0.5, 0.5)})

    def _sweep(self, script, env=None):
        root = self.create_tempdir().full_path
        bin_dir = os.path.join(root, "bin")
        os.makedirs(bin_dir)
        fake = os.path.join(bin_dir, "python")
        with open(fake, "w") as f:
            f.write(FAKE_PYTHON.format(python=sys.executable))
        os.chmod(fake, os.stat(fake).st_mode | stat.S_IEXEC)
        env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=REPO,
                   **(env or {}))
        result = subprocess.run(["bash", os.path.join(REPO, "launch", script)], cwd=root,
                                env=env, capture_output=True, text=True, timeout=300)
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])
        return root, result.stdout

    def test_cifar_sweep_holds_out_validation_and_selects_on_it(self):
        root, out = self._sweep("sweep_cifar10_vgg.sh")
        with open(os.path.join(root, "workdir/cifar10_vgg_noise_0.5/flags.txt")) as f:
            self.assertIn("DataConfig.validation_fraction = 0.1", f.read())
        # Validation peaks at NOISE = 1.0; test accuracy would have picked 1.5.
        self.assertIn("selected by validation accuracy: workdir/cifar10_vgg_noise_1.0 ", out)
        self.assertIn("final test_accuracy=0.0100", out)

    def test_scratch_models_sweep_selects_per_epsilon(self):
        _, out = self._sweep("sweep_scratch.sh", env={"SWEEP": "models"})
        self.assertEqual(out.count("selected by validation accuracy:"), 3)


# The private selection's trainer stand-in: a finished run's summary.json and
# ledger, with a validation accuracy that peaks at base_lr = 0.5.
FAKE_RUN = dict(noise_multiplier=1.1, dataset_size=1000, batch_size=100, steps=50, delta=1e-5)
PRIVATE_FLAGS = ["--gin_file=mnist_default.gin",
                 "--gin_param=DataConfig.validation_fraction = 0.1"]


def fake_trainer(trial_dir, gin_files, gin_params, seed, run=None):
    del gin_files, seed
    run = dict(FAKE_RUN, **(run or {}))
    lr = float([p for p in gin_params if p.startswith("OptimizationConfig.base_lr")][-1]
               .split("=")[1])
    ledger = privacy.PrivacyLedger(run.pop("noise_multiplier"), **run)
    os.makedirs(os.path.join(trial_dir, "checkpoints"))
    with open(os.path.join(trial_dir, "checkpoints", "privacy_ledger.json"), "w") as f:
        f.write(ledger.to_json())
    with open(os.path.join(trial_dir, "summary.json"), "w") as f:
        json.dump({"epsilon": ledger.epsilon(), "delta": ledger.delta,
                   "test_accuracy": lr / 10,
                   "not_covered_by_epsilon": {"validation_accuracy": 1 / (1 + abs(lr - 0.5))}},
                  f)
    with open(os.path.join(trial_dir, "model.keras"), "w") as f:
        f.write(f"model of base_lr={lr}")
    return 0


# What docs/PRIVACY.md says every released file's time is: 1980-01-01 00:00:00 UTC.
RELEASE_TIME_NS = 315532800 * 10**9
RELEASE_ZIP_TIME = (1980, 1, 1, 0, 0, 0)
RELEASE_DATE_SAVED = "1980-01-01@00:00:00"


def _base_lr(gin_params):
    return float([p for p in gin_params if p.startswith("OptimizationConfig.base_lr")][-1]
                 .split("=")[1])


def timed_trainer(clock):
    """`fake_trainer` writing the outputs a real run releases, stamped by a simulated clock.

    Each trial ends 11 simulated seconds after the one before: its files'
    times, its Keras-style archive's entry times and `date_saved`, and its
    `wall_time_s` all tell when it ran. The content is the setting's only.
    """

    def trainer(trial_dir, gin_files, gin_params, seed):
        fake_trainer(trial_dir, gin_files, gin_params, seed)
        lr = _base_lr(gin_params)
        clock[0] += 11.0
        now = clock[0]
        stamp = time.gmtime(now)
        with zipfile.ZipFile(os.path.join(trial_dir, "model.keras"), "w") as zf:
            zf.writestr(zipfile.ZipInfo("metadata.json", stamp[:6]), json.dumps(
                {"keras_version": "3", "date_saved": time.strftime("%Y-%m-%d@%H:%M:%S", stamp)}))
            zf.writestr(zipfile.ZipInfo("config.json", stamp[:6]), json.dumps({"base_lr": lr}))
            zf.writestr(zipfile.ZipInfo("model.weights.h5", stamp[:6]), f"weights {lr}" * 100)
        os.makedirs(os.path.join(trial_dir, "saved_model", "variables"))
        for name in ("saved_model/saved_model.pb", "saved_model/variables/variables.index",
                     "config.gin", "operative_config.gin"):
            with open(os.path.join(trial_dir, name), "w") as f:
                f.write(f"{name} of base_lr={lr}")
        summary_path = os.path.join(trial_dir, "summary.json")
        with open(summary_path) as f:
            summary = json.load(f)
        summary["wall_time_s"] = 10.0 + now % 7  # Not the same in two trials.
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=2)
        for root, dirs, files in os.walk(trial_dir):
            for name in dirs + files:
                os.utime(os.path.join(root, name), (now, now))
        return 0

    return trainer


def release_snapshot(directory):
    """Every entry of `directory`, in listing order: (path, mtime, atime, mode, bytes).

    Each entry's times are read before it is read or listed (either may
    move its atime).
    """
    stats = [("", os.lstat(directory))]

    def walk(relative):
        entries = [os.path.join(relative, name)
                   for name in os.listdir(os.path.join(directory, relative))]
        found = [(path, os.lstat(os.path.join(directory, path))) for path in entries]
        stats.extend(found)
        for path, status in found:
            if stat.S_ISDIR(status.st_mode):
                walk(path)

    walk("")
    snapshot = []
    for path, status in stats:
        data = None
        if stat.S_ISREG(status.st_mode):
            with open(os.path.join(directory, path), "rb") as f:
                data = f.read()
        snapshot.append((path, status.st_mtime_ns, status.st_atime_ns, status.st_mode, data))
    return snapshot


def expected_selection_epsilon(mean, shape):
    """dp_accounting's ε of the best of K ~ (mean, shape) runs of FAKE_RUN."""
    q = FAKE_RUN["batch_size"] / FAKE_RUN["dataset_size"]
    run = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(
            FAKE_RUN["noise_multiplier"])), FAKE_RUN["steps"])
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_event.RepeatAndSelectDpEvent(run, mean, shape))
    return accountant.get_epsilon(FAKE_RUN["delta"])


class TrialCountTest(tf.test.TestCase):
    """The count's distribution is fixed by its mean and shape, as dp_accounting accounts it."""

    def _draws(self, trial_count, n=20000):
        generator = np.random.default_rng(0)
        return np.array([trial_count.sample(generator) for _ in range(n)])

    def test_poisson_has_the_mean_and_variance(self):
        draws = self._draws(tuning.TrialCount(4.0))
        self.assertAllClose([draws.mean(), draws.var()], [4.0, 4.0], rtol=0.04)
        self.assertGreater((draws == 0).sum(), 0)  # K = 0 happens: nothing is released.

    def test_truncated_negative_binomial_has_its_mean_and_variance(self):
        for shape in (0.0, 0.5, 1.0, 3.0):
            trial_count = tuning.TrialCount(5.0, "truncated_negative_binomial", shape)
            gamma = trial_count_lib.truncated_negative_binomial_gamma(shape, 5.0)
            # The γ accounted is the γ sampled from.
            self.assertEqual(
                gamma, rdp_privacy_accountant._gamma_truncated_negative_binomial(shape, 5.0))
            k = np.arange(1, 20000)
            pmf = (stats.logser.pmf(k, 1 - gamma) if shape == 0
                   else stats.nbinom.pmf(k, shape, gamma) / (1 - gamma ** shape))
            mean, variance = (pmf * k).sum(), (pmf * k ** 2).sum() - (pmf * k).sum() ** 2
            self.assertAllClose(mean, 5.0, rtol=1e-6)
            draws = self._draws(trial_count)
            self.assertGreaterEqual(draws.min(), 1)
            self.assertAllClose([draws.mean(), draws.var()], [mean, variance], rtol=0.08,
                                msg=f"shape={shape}")

    def test_bad_distributions_are_refused(self):
        for args, message in [((0.5,), "mean number of trials must be a finite number >= 1"),
                              ((3, "poisson", 1.0), "Poisson has none"),
                              ((3, "truncated_negative_binomial"), "needs a finite shape"),
                              ((3, "binomial"), "must be one of")]:
            with self.assertRaisesRegex(ValueError, message):
                tuning.TrialCount(*args)

    def test_the_count_comes_from_the_os_entropy(self):
        with mock.patch("secrets.randbits", return_value=12345) as randbits:
            trial_count_lib.secret_generator()
        randbits.assert_called_once_with(128)


class PrivateSelectionTest(tf.test.TestCase):

    def _main(self, *flags, generator_seed=1, trainer=fake_trainer):
        out = io.StringIO()
        with mock.patch.object(private_selection, "run_trainer", trainer), \
                mock.patch.object(trial_count_lib, "secret_generator",
                                  lambda: np.random.default_rng(generator_seed)), \
                redirect_stdout(out):
            code = cli.main(list(flags))
        return code, out.getvalue().splitlines()

    def test_epsilon_is_repeat_and_select_of_the_runs_made(self):
        for flags, (mean, shape) in [([], (3.0, math.inf)),
                                     (["--distribution=truncated_negative_binomial",
                                       "--shape=1"], (3.0, 1.0))]:
            workdir = self.create_tempdir().full_path
            code, lines = self._main(
                *PRIVATE_FLAGS, "--grid=OptimizationConfig.base_lr=0.1,0.5,2.0",
                "--grid=PrivacyConfig.l2_norm_clip=0.5,1.0", "--mean_trials=3",
                f"--workdir={workdir}", *flags)
            self.assertEqual(code, 0, lines)
            with open(os.path.join(workdir, "selection.json")) as f:
                record = json.load(f)
            expected = expected_selection_epsilon(mean, shape)
            self.assertEqual(record["epsilon"], expected)
            self.assertGreater(record["epsilon"], record["run_epsilon"])
            self.assertEqual(record["trial_count_distribution"]["mean"], 3.0)
            trials = record["trial_count"]
            self.assertGreaterEqual(trials, 1)
            self.assertLen([d for d in os.listdir(workdir) if d.startswith("trial_")], trials)
            self.assertLen(record["trials"], trials)
            best = max(record["trials"], key=lambda t: t["validation_accuracy"])
            self.assertEqual(record["selected_workdir"], best["workdir"])
            self.assertEqual(record["setting"], best["setting"])
            self.assertEqual(lines[-1].split(" for the selection")[0],
                             f"final: test_accuracy={record['test_accuracy']:.4f} "
                             f"epsilon={expected:.4f} delta=1e-05")
            # The release: the selected model, and a record without the count or the trials.
            selected = os.path.join(workdir, "selected")
            self.assertCountEqual(os.listdir(selected),
                                  ["model.keras", "summary.json", "selection.json"])
            with open(os.path.join(selected, "selection.json")) as f:
                public = json.load(f)
            self.assertNotIn("trial_count", public)
            self.assertNotIn("trials", public)
            self.assertNotRegex(json.dumps(public), r"trial_\d")
            self.assertEqual(public["epsilon"], expected)
            self.assertTrue(os.path.isfile(os.path.join(best["workdir"], "NOT_FOR_RELEASE.txt")))
            # The console names no trial (its index would tell that K is at least as large).
            self.assertNotRegex("\n".join(lines), r"trial_\d")

    def test_banded_runs_are_selected_as_their_rounds_at_the_group_rate(self):
        # A BandMF run (b = 4) is ⌈T/b⌉ Poisson-subsampled Gaussians at b·B/N:
        # the selection composes that event, rebuilt from the trial's ledger.
        banded = {"sampler": "banded_poisson", "bands": 4,
                  "band_coefficients": [0.8, 0.45, 0.3, 0.25]}

        def banded_trainer(trial_dir, gin_files, gin_params, seed):
            return fake_trainer(trial_dir, gin_files, gin_params, seed, run=banded)

        workdir = self.create_tempdir().full_path
        code, lines = self._main(*PRIVATE_FLAGS, "--grid=OptimizationConfig.base_lr=0.1,0.5",
                                 "--mean_trials=3", f"--workdir={workdir}",
                                 trainer=banded_trainer)
        self.assertEqual(code, 0, lines)
        with open(os.path.join(workdir, "selection.json")) as f:
            record = json.load(f)
        q = 4 * FAKE_RUN["batch_size"] / FAKE_RUN["dataset_size"]
        rounds = -(-FAKE_RUN["steps"] // 4)
        run = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(
                FAKE_RUN["noise_multiplier"])), rounds)
        accountant = dp_accounting.rdp.RdpAccountant()
        accountant.compose(dp_event.RepeatAndSelectDpEvent(run, 3.0, math.inf))
        self.assertAllClose(record["epsilon"], accountant.get_epsilon(FAKE_RUN["delta"]),
                            rtol=1e-12)
        # Fewer rounds at a higher rate: not DP-SGD's event over the same steps.
        self.assertNotAlmostEqual(record["epsilon"], expected_selection_epsilon(3.0, math.inf),
                                  places=3)

    def test_a_poisson_count_of_zero_releases_nothing(self):
        workdir = self.create_tempdir().full_path
        generator = mock.Mock(poisson=mock.Mock(return_value=0))
        record = tuning.select_privately(
            gin_files=["mnist_default.gin"], gin_params=["DataConfig.validation_fraction = 0.1"],
            grid={"OptimizationConfig.base_lr": ["0.1"]}, trial_count=tuning.TrialCount(2.0),
            workdir=workdir, generator=generator, trainer=fake_trainer)
        self.assertIsNone(record["released"])
        self.assertFalse(os.path.exists(os.path.join(workdir, "selected")))

    def test_trials_that_were_different_events_are_not_released(self):
        workdir = self.create_tempdir().full_path
        steps = iter([50, 60, 70, 80, 90, 100, 110, 120, 130, 140])

        def drifting_trainer(trial_dir, gin_files, gin_params, seed):
            return fake_trainer(trial_dir, gin_files, gin_params, seed,
                                run={"steps": next(steps)})

        code, _ = self._main(*PRIVATE_FLAGS, "--grid=OptimizationConfig.base_lr=0.1,0.5",
                             "--mean_trials=3", f"--workdir={workdir}",
                             trainer=drifting_trainer)
        self.assertEqual(code, 2)
        self.assertFalse(os.path.exists(os.path.join(workdir, "selected")))

    def test_refusals(self):
        workdir = self.create_tempdir().full_path
        lr = "--grid=OptimizationConfig.base_lr=0.1,0.5"
        cases = [
            ([lr, "--grid=PrivacyConfig.noise_multiplier=1.0,2.0",
              "--gin_param=PrivacyConfig.target_epsilon = None"],
             "may not change PrivacyConfig.noise_multiplier"),
            ([lr, "--grid=EPOCHS=10,20"], "may not change OptimizationConfig.epochs"),
            ([lr, "--grid=PrivacyConfig.delta=1e-5,1e-6"], "may not change PrivacyConfig.delta"),
            ([lr, "--grid=DataConfig.validation_fraction=0.1,0.2"],
             "may not change DataConfig.validation_fraction"),
            ([lr, "--gin_param=DataConfig.validation_fraction = 0.0"],
             "DataConfig.validation_fraction = 0.1"),
            ([lr, "--gin_param=PrivacyConfig.insecure_reproducible_seed = 3"],
             "noise is secret"),
            (["--grid=OptimizationConfig.base_lr="], "BINDING=V1,V2"),
            (["--grid=OptimizationConfig.base_lrr=0.1,0.5"],
             "Did you mean 'OptimizationConfig.base_lr'"),
            ([lr, "--mean_trials=0.5"], "mean number of trials"),
            ([lr, "--shape=1"], "Poisson has none"),
        ]
        for flags, message in cases:
            code = None
            err = io.StringIO()
            with mock.patch("sys.stderr", err):
                code, _ = self._main(*PRIVATE_FLAGS, "--mean_trials=2",
                                     f"--workdir={workdir}/w", *flags)
            self.assertEqual(code, 2, flags)
            self.assertIn(message, err.getvalue(), flags)
            self.assertFalse(os.path.exists(f"{workdir}/w"), flags)

    def test_a_workdir_in_use_is_refused(self):
        workdir = self.create_tempdir().full_path
        open(os.path.join(workdir, "x"), "w").close()
        with self.assertRaisesRegex(ValueError, "runs once, into a new workdir"):
            tuning.select_privately(
                gin_files=["mnist_default.gin"],
                gin_params=["DataConfig.validation_fraction = 0.1"],
                grid={"OptimizationConfig.base_lr": ["0.1"]},
                trial_count=tuning.TrialCount(2.0), workdir=workdir, trainer=fake_trainer)

    def test_grid_values_split_on_top_level_commas(self):
        self.assertEqual(tuning.parse_grid(["A.b=0.1, (1, 2),'x,y'", "C=1"]),
                         {"A.b": ["0.1", "(1, 2)", "'x,y'"], "C": ["1"]})

    @pytest.mark.slow
    def test_a_real_selection_on_digits(self):
        workdir = self.create_tempdir().full_path
        out = io.StringIO()
        with redirect_stdout(out):
            code = cli.main([
                "--gin_file=mnist_default.gin", "--gin_param=DataConfig.dataset = 'digits'",
                "--gin_param=OptimizationConfig.epochs = 1",
                "--gin_param=OptimizationConfig.logical_batch_size = 128",
                "--gin_param=RunConfig.physical_batch_size = 64",
                "--gin_param=PrivacyConfig.noise_multiplier = 1.0",
                "--gin_param=PrivacyConfig.target_epsilon = None",
                "--gin_param=DataConfig.validation_fraction = 0.1",
                "--grid=OptimizationConfig.base_lr=0.1,0.5", "--mean_trials=1.5",
                "--distribution=truncated_negative_binomial", "--shape=0",
                f"--workdir={workdir}"])
        self.assertEqual(code, 0)
        with open(os.path.join(workdir, "selection.json")) as f:
            record = json.load(f)
        with open(os.path.join(record["selected_workdir"], "checkpoints",
                               "privacy_ledger.json")) as f:
            ledger = privacy.PrivacyLedger.from_json(f.read())
        run = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            ledger.sampling_rate, dp_accounting.GaussianDpEvent(1.0)), ledger.steps)
        accountant = dp_accounting.rdp.RdpAccountant()
        accountant.compose(dp_event.RepeatAndSelectDpEvent(run, 1.5, 0.0))
        self.assertEqual(record["epsilon"], accountant.get_epsilon(ledger.delta))
        self.assertIn(f"epsilon={record['epsilon']:.4f}", out.getvalue().splitlines()[-1])
        released = os.path.join(workdir, "selected")
        self.assertTrue(os.path.isfile(os.path.join(released, "model.keras")))
        self.assertFalse(os.path.exists(os.path.join(released, "checkpoints")))
        # Nothing released tells when it was written (times read before any read).
        snapshot = release_snapshot(released)
        self.assertIn("saved_model/saved_model.pb", [entry[0] for entry in snapshot])
        for path, mtime, atime, _, _ in snapshot:
            self.assertEqual((mtime, atime), (RELEASE_TIME_NS, RELEASE_TIME_NS), path)
        with zipfile.ZipFile(os.path.join(released, "model.keras")) as zf:
            self.assertEqual({i.date_time for i in zf.infolist()}, {RELEASE_ZIP_TIME})
            self.assertEqual(json.loads(zf.read("metadata.json"))["date_saved"],
                             RELEASE_DATE_SAVED)
        with open(os.path.join(released, "summary.json")) as f:
            self.assertNotIn("wall_time_s", json.load(f))
        for root, _, files in os.walk(released):  # Nothing released names a trial.
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    self.assertNotRegex(f.read(), rb"trial_\d", name)


class ReleaseTest(tf.test.TestCase):
    """The release of a private selection tells nothing of K nor of when the selected trial ran."""

    def _select(self, workdir, draws, trainer):
        # K = len(draws); trial i runs base_lr 0.1 (draw 0) or 0.5 (draw 1, the best).
        generator = mock.Mock(poisson=mock.Mock(return_value=len(draws)),
                              integers=mock.Mock(side_effect=list(draws)))
        return tuning.select_privately(
            gin_files=["mnist_default.gin"], gin_params=["DataConfig.validation_fraction = 0.1"],
            grid={"OptimizationConfig.base_lr": ["0.1", "0.5"]},
            trial_count=tuning.TrialCount(2.0), workdir=workdir, generator=generator,
            trainer=trainer)

    def test_the_release_is_the_same_whatever_k_and_whenever_the_selected_trial_ran(self):
        workdir = os.path.join(self.create_tempdir().full_path, "W")
        selected = os.path.join(workdir, "selected")
        snapshots = []
        # K = 1; K = 3, the selected trial last; K = 4, the selected trial first: each
        # starts at another time, so every trial's own times differ.
        for draws, start in [([1], 1.8e9), ([0, 0, 1], 1.8e9 + 1000.0),
                             ([1, 0, 0, 0], 1.8e9 + 5000.0)]:
            if os.path.exists(workdir):
                shutil.rmtree(workdir)  # The same path: the record names it.
            record = self._select(workdir, draws, timed_trainer([start]))
            self.assertEqual(record["setting"], {"OptimizationConfig.base_lr": "0.5"})
            snapshots.append(release_snapshot(selected))
            self.assertCountEqual(os.listdir(workdir), [
                "PRIVATE.txt", "selection.json", "selected",
                *(f"trial_{i}" for i in range(len(draws)))])
            self.assertNotEqual(os.stat(os.path.join(workdir, "trial_0", "model.keras"))
                                .st_mtime_ns, RELEASE_TIME_NS)
        # Bytes, times, modes and listing order: the same three releases.
        self.assertEqual(snapshots[1], snapshots[0])
        self.assertEqual(snapshots[2], snapshots[0])
        self.assertCountEqual([entry[0] for entry in snapshots[0]], [
            "", "model.keras", "saved_model", "saved_model/saved_model.pb",
            "saved_model/variables", "saved_model/variables/variables.index", "summary.json",
            "config.gin", "operative_config.gin", "selection.json"])
        for path, mtime, atime, _, _ in snapshots[0]:
            self.assertEqual((mtime, atime), (RELEASE_TIME_NS, RELEASE_TIME_NS), path)
        with zipfile.ZipFile(os.path.join(selected, "model.keras")) as zf:
            self.assertEqual([i.filename for i in zf.infolist()],
                             ["metadata.json", "config.json", "model.weights.h5"])
            self.assertEqual({i.date_time for i in zf.infolist()}, {RELEASE_ZIP_TIME})
            self.assertEqual(json.loads(zf.read("metadata.json")),
                             {"keras_version": "3", "date_saved": RELEASE_DATE_SAVED})
            self.assertEqual(json.loads(zf.read("config.json")), {"base_lr": 0.5})
        with open(os.path.join(workdir, "trial_0", "summary.json")) as f:
            trial_summary = json.load(f)
        with open(os.path.join(selected, "summary.json")) as f:
            released_summary = json.load(f)
        # The trial's wall time is not released; the rest of its summary is.
        del trial_summary["wall_time_s"]
        self.assertEqual(released_summary, trial_summary)
        self.assertNotIn("selected.partial", os.listdir(workdir))

    def test_the_released_keras_model_loads_and_records_no_save_time(self):
        import keras

        def keras_trainer(trial_dir, gin_files, gin_params, seed):
            fake_trainer(trial_dir, gin_files, gin_params, seed)
            model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(
                1, kernel_initializer=keras.initializers.Constant(_base_lr(gin_params)))])
            model.save(os.path.join(trial_dir, "model.keras"))
            return 0

        workdir = self.create_tempdir().full_path
        self._select(workdir, [0, 1], keras_trainer)
        with open(os.path.join(workdir, "selection.json")) as f:
            trial_model = os.path.join(json.load(f)["selected_workdir"], "model.keras")
        released = os.path.join(workdir, "selected", "model.keras")
        with zipfile.ZipFile(trial_model) as trial, zipfile.ZipFile(released) as zf:
            # Keras records when it saved; the release does not.
            self.assertNotEqual(json.loads(trial.read("metadata.json"))["date_saved"],
                                RELEASE_DATE_SAVED)
            self.assertEqual(json.loads(zf.read("metadata.json"))["date_saved"],
                             RELEASE_DATE_SAVED)
            self.assertEqual({i.date_time for i in zf.infolist()}, {RELEASE_ZIP_TIME})
            self.assertEqual(zf.namelist(), trial.namelist())
            for name in trial.namelist():
                if name != "metadata.json":
                    self.assertEqual(zf.read(name), trial.read(name), name)
        self.assertAllClose(keras.saving.load_model(released).layers[0].kernel,
                            [[0.5], [0.5]])
