"""End-to-end tests of `python -m tfdp.train` in subprocesses."""

import pytest
import json
import os
import re
import subprocess
import sys

import tensorflow as tf

FINAL = re.compile(
    r"^final: (?:NOT PRIVATE \([^)]*\) )?test_accuracy=(?P<acc>[0-9.]+) epsilon=(?P<eps>[0-9.inf]+) "
    r"delta=(?P<delta>[0-9.e-]+) steps=(?P<steps>\d+)$",
    re.M,
)
QUICK = [
    "--gin_param=DataConfig.dataset = 'digits'",
    "--gin_param=OptimizationConfig.epochs = 2",
    "--gin_param=OptimizationConfig.logical_batch_size = 128",
    "--gin_param=RunConfig.physical_batch_size = 64",
    "--gin_param=RunConfig.log_every_steps = 5",
]


def run_train(*args, workdir=None):
    cmd = [sys.executable, "-m", "tfdp.train", *args]
    if workdir:
        cmd.append(f"--workdir={workdir}")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


class TrainTest(tf.test.TestCase):

    def test_private_run_prints_summary_and_fills_workdir(self):
        workdir = self.create_tempdir().full_path
        result = run_train(*QUICK, workdir=workdir)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        match = FINAL.search(result.stdout)
        self.assertIsNotNone(match, result.stdout[-2000:])
        self.assertGreater(float(match["acc"]), 0.1)
        self.assertLessEqual(float(match["eps"]), 8.0 + 1e-6)
        self.assertEqual(float(match["delta"]), 1e-5)
        self.assertIn("DP plan: method=bk", result.stdout)
        self.assertRegex(result.stdout, r"epoch +\d.* test_acc=.* epsilon=")
        for name in ("config.gin", "operative_config.gin", "summary.json", "report.html",
                     "clipping_plan.txt"):
            self.assertTrue(os.path.isfile(os.path.join(workdir, name)), name)
        self.assertTrue(tf.io.gfile.glob(os.path.join(workdir, "tensorboard", "events.*")))
        ckpt_dir = os.path.join(workdir, "checkpoints")
        self.assertIsNotNone(tf.train.latest_checkpoint(ckpt_dir))
        with open(os.path.join(ckpt_dir, "privacy_ledger.json")) as f:
            ledger = json.load(f)
        self.assertEqual(ledger["steps"], int(match["steps"]))
        self.assertEqual(ledger["sampler"], "poisson")
        with open(os.path.join(workdir, "operative_config.gin")) as f:
            self.assertIn("PrivacyConfig.target_epsilon = 8.0", f.read())
        # The prompt exit after the final line loses no TensorBoard event:
        # the last evaluation's test accuracy is on disk.
        steps = [
            event.step
            for path in tf.io.gfile.glob(os.path.join(workdir, "tensorboard", "events.*"))
            for event in tf.compat.v1.train.summary_iterator(path)
            for value in event.summary.value if value.tag == "test/accuracy"
        ]
        self.assertEqual(max(steps), int(match["steps"]))

        # Rerunning the same command finds the run finished and redoes nothing.
        again = run_train(*QUICK, workdir=workdir)
        self.assertEqual(again.returncode, 0, again.stderr[-3000:])
        self.assertIn("already holds this run's", again.stdout)
        self.assertNotIn("sensitivity probe", again.stdout)

        # Rerunning with more epochs resumes and keeps counting privacy.
        longer = run_train(*QUICK, "--gin_param=OptimizationConfig.epochs = 3", workdir=workdir)
        self.assertNotEqual(longer.returncode, 0)  # σ was calibrated for 2 epochs.
        self.assertIn("another privacy configuration (noise_multiplier", longer.stderr)

    @pytest.mark.slow
    def test_dry_run_of_the_paper_config(self):
        workdir = self.create_tempdir().full_path
        result = run_train("--gin_file=imagenet_r18_places.gin", "--dry_run", workdir=workdir)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        for needle in ("DP plan: method=bk", "froze the first 4", "dry run: 2 steps on mock data OK",
                       "dry run: sigma=", "per epoch"):
            self.assertIn(needle, result.stdout)
        self.assertFalse(os.path.exists(os.path.join(workdir, "checkpoints")))

    @pytest.mark.slow
    def test_budget_stops_before_exceeding_epsilon(self):
        workdir = self.create_tempdir().full_path
        result = run_train(
            *QUICK, "--gin_param=PrivacyConfig.noise_multiplier = 1.5",
            "--gin_param=PrivacyConfig.target_epsilon = 3.0",
            "--gin_param=OptimizationConfig.epochs = 20",
            workdir=workdir,
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn("training will stop there", result.stdout)
        match = FINAL.search(result.stdout)
        self.assertLessEqual(float(match["eps"]), 3.0)
        self.assertIn("one more step would exceed the budget", result.stdout)
        self.assertGreater(int(match["steps"]), 0)

    @pytest.mark.slow  # 12-20 s of a whole run or a memory measurement (CI runs it).
    def test_each_sampler_is_accounted_for_what_it_does(self):
        # Shuffle batches get the bound that holds for any order (one
        # Gaussian mechanism per pass), never Poisson's amplification.
        from tfdp import privacy

        n, b, sigma = 1437, 128, 1.0
        for sampler, expected_steps in (("poisson", 23), ("shuffle", 22)):
            with self.subTest(sampler=sampler):
                result = run_train(
                    *QUICK, f"--gin_param=PrivacyConfig.sampler = '{sampler}'",
                    f"--gin_param=PrivacyConfig.noise_multiplier = {sigma}",
                    "--gin_param=PrivacyConfig.target_epsilon = None",
                    "--gin_param=RunConfig.export_model = False",
                    workdir=self.create_tempdir().full_path,
                )
                self.assertEqual(result.returncode, 0, result.stderr[-3000:])
                self.assertIn(f"sampler={sampler}", result.stdout)
                match = FINAL.search(result.stdout)
                self.assertEqual(int(match["steps"]), expected_steps)
                expected = privacy.epsilon(sigma, expected_steps, 1e-5, dataset_size=n,
                                           batch_size=b, sampler=sampler)
                self.assertAllClose(float(match["eps"]), expected, rtol=1e-4)
        # The two differ: the shuffle run claimed no amplification.
        self.assertGreater(privacy.epsilon(sigma, 22, 1e-5, dataset_size=n, batch_size=b,
                                           sampler="shuffle"),
                           1.5 * privacy.epsilon(sigma, 23, 1e-5, dataset_size=n, batch_size=b))

    @pytest.mark.slow
    def test_bad_inputs_give_one_line_errors(self):
        cases = {
            "PrivacyConfig.l2_norm_clip = 0.0": "l2_norm_clip",
            "PrivacyConfig.noise_multiplier = -1.0": "noise_multiplier",
            "PrivacyConfig.delta = 1.0": "delta",
            "OptimizationConfig.logical_batch_size = 100000": "logical_batch_size",
            "train.no_such_parameter = 3": "no_such_parameter",
        }
        for binding, needle in cases.items():
            result = run_train(f"--gin_param={binding}", workdir=self.create_tempdir().full_path)
            self.assertEqual(result.returncode, 2, binding)
            self.assertNotIn("Traceback", result.stderr, binding)
            lines = [l for l in result.stderr.splitlines() if l.startswith("error:")]
            self.assertLen(lines, 1, result.stderr[-2000:])
            self.assertIn(needle, lines[0])
        missing = run_train("--gin_file=does_not_exist.gin")
        self.assertEqual(missing.returncode, 2)
        self.assertIn("does_not_exist.gin", missing.stderr)
        bad = os.path.join(self.create_tempdir().full_path, "bad.gin")
        with open(bad, "w") as f:
            f.write("OptimizationConfig.epochs = = 3\n")
        result = run_train(f"--gin_file={bad}")
        self.assertEqual(result.returncode, 2)
        self.assertNotIn("Traceback", result.stderr)
        self.assertIn("error: Bad gin configuration", result.stderr)
        # From a directory with a data/ folder, the default's includes (one of
        # them data/mnist_offline.gin) resolve in tfdp's gin dir; a missing
        # include is one error line.
        cwd = self.create_tempdir().full_path
        os.makedirs(os.path.join(cwd, "data"))
        with open(os.path.join(cwd, "missing_include.gin"), "w") as f:
            f.write("include 'mnist_default.gin'\ninclude 'data/no_such_data.gin'\n")
        result = subprocess.run(
            [sys.executable, "-m", "tfdp.train", "--gin_file=missing_include.gin"],
            capture_output=True, text=True, timeout=600, cwd=cwd,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                     PYTHONPATH=os.pathsep.join(filter(None, [
                         os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         os.environ.get("PYTHONPATH")]))),
        )
        self.assertEqual(result.returncode, 2, result.stderr[-2000:])
        self.assertNotIn("Traceback", result.stderr)
        lines = [l for l in result.stderr.splitlines() if l.startswith("error:")]
        self.assertLen(lines, 1, result.stderr[-2000:])
        self.assertRegex(lines[0], r"^error: Gin include not found in .*missing_include.gin: "
                                   r"looked in .*gin/data/no_such_data.gin")


if __name__ == "__main__":
    tf.test.main()
