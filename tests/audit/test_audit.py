"""End-to-end audits: the audit catches a missing-noise run, and stays below
the accountant's epsilon for a correctly noised run."""

import io
import contextlib
import json

import pytest
import tensorflow as tf

from tfdp import audit
from tfdp.audit import cli

# A small, fast configuration (about 20 s of training per run on 2 CPU
# cores): 200 digits + ~500 of 1000 canaries, ~215 steps. The batches are
# drawn with a secret key, so they differ from run to run: with ReLU, this
# short run sometimes loses its units and memorises too little to be caught
# (epsilon_lower 0.6-4.3 over 6 runs); with tanh it memorised in every run
# (3.6-4.4 over 5 runs).
FAST = dict(num_canaries=1000, num_train=200, epochs=20, batch_size=64,
            l2_norm_clip=1.0, learning_rate=0.2, delta=1e-5, beta=0.05, seed=0,
            activation="tanh")
TARGET_EPSILON = 2.0


def _check_pair(test, no_noise, calibrated):
    # The calibrated run is the one the accountant's epsilon belongs to.
    test.assertAllClose(calibrated["accountant_epsilon"], TARGET_EPSILON, atol=1e-2)
    test.assertGreater(calibrated["noise_multiplier"], 0.0)
    test.assertEqual(no_noise["noise_multiplier"], 0.0)
    test.assertEqual(no_noise["accountant_epsilon"], float("inf"))
    # Same data, canaries, inclusion draws and steps in both runs.
    for key in ("dataset_size", "num_included_canaries", "steps", "sampling_rate"):
        test.assertEqual(no_noise[key], calibrated[key])
    # sigma = 0 (clipping only): the canaries are memorised and the audit
    # proves more leakage than the calibrated run is allowed.
    test.assertGreater(no_noise["epsilon_lower"], calibrated["accountant_epsilon"])
    # Calibrated sigma: the lower bound respects the upper bound.
    test.assertLess(calibrated["epsilon_lower"], calibrated["accountant_epsilon"])


class FastAuditTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.no_noise = audit.run_audit(audit.AuditConfig(noise_multiplier=0.0, **FAST))
        cls.calibrated = audit.run_audit(audit.AuditConfig(target_epsilon=TARGET_EPSILON, **FAST))

    def test_missing_noise_is_caught_and_calibrated_run_passes(self):
        _check_pair(self, self.no_noise, self.calibrated)
        # Not a marginal catch.
        self.assertGreater(self.no_noise["epsilon_lower"], TARGET_EPSILON + 0.5)

    def test_report(self):
        r = self.no_noise
        self.assertEqual(r["m"], 1000)
        self.assertLessEqual(r["v"], r["r"])
        self.assertEqual(r["confidence"], 0.95)
        self.assertGreater(r["canary_accuracy_included"], r["canary_accuracy_excluded"] + 0.5)
        self.assertGreater(r["test_accuracy"], 0.7)  # It did learn the digits.
        self.assertAllClose(r["sampling_rate"], 64 / r["dataset_size"])
        json.dumps(cli._jsonable(r), allow_nan=False)


@pytest.mark.slow
class DefaultAuditTest(tf.test.TestCase):
    """The CLI's default configuration (30 epochs, 500 digits), both ways."""

    def test_default_configuration(self):
        no_noise = audit.run_audit(audit.AuditConfig(noise_multiplier=0.0))
        calibrated = audit.run_audit(audit.AuditConfig(target_epsilon=TARGET_EPSILON))
        _check_pair(self, no_noise, calibrated)


class CliTest(tf.test.TestCase):

    def _run(self, *argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(list(argv))
        return rc, out.getvalue(), err.getvalue()

    def test_bad_input_is_one_line_and_exit_2(self):
        for argv in (
            ["--num_canaries=0"],
            ["--noise_multiplier=-1"],
            ["--noise_multiplier=1", "--target_epsilon=2"],
            ["--delta=1.5"],
            ["--epochs=zero"],
            ["--l2_norm_clip=0"],
            ["--batch_size=0"],
            ["--seed=x"],
            ["--num_canaries=10", "--guess_counts=20"],
            ["--num_train=100000"],
            ["--unknown"],
        ):
            rc, out, err = self._run(*argv)
            self.assertEqual(rc, 2, argv)
            self.assertEqual(out, "")
            lines = err.strip().splitlines()
            self.assertLen(lines, 1, argv)
            self.assertStartsWith(lines[0], "error: ")

    def test_tiny_json_run(self):
        rc, out, _ = self._run(
            "--num_canaries=20", "--num_train=20", "--epochs=1", "--batch_size=8",
            "--noise_multiplier=1.0", "--json",
        )
        self.assertEqual(rc, 0)
        result = json.loads(out)
        self.assertEqual(result["m"], 20)
        self.assertEqual(result["noise_multiplier"], 1.0)
        self.assertGreaterEqual(result["epsilon_lower"], 0.0)
        self.assertGreater(result["accountant_epsilon"], 0.0)


if __name__ == "__main__":
    tf.test.main()
