"""Sweeps choose settings by validation accuracy; the test set gives the final number only."""

import os
import stat
import subprocess
import sys

import tensorflow as tf

from tfdp import tuning

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
