"""Tests for `python -m tfdp.privacy` (no TensorFlow)."""

import io
import json
import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized

from tfdp import privacy
from tfdp.privacy import cli

_REPO = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)

PAPER = [
    "--dataset_size=1281167",
    "--batch_size=65536",
    "--epochs=70",
    "--delta=1e-6",
]


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "tfdp.privacy", *args],
        capture_output=True,
        text=True,
        cwd=_REPO,
        timeout=120,
    )


def _main(*args):
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(args), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


class CliSubprocessTest(absltest.TestCase):
    def test_paper_run_json_both_accountants(self):
        proc = _run(
            *PAPER, "--noise_multiplier=1.3127", "--accountant=both", "--json"
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        result = json.loads(proc.stdout)
        self.assertEqual(result["steps"], 1369)
        self.assertEqual(result["noise_multiplier"], 1.3127)
        self.assertEqual(result["sampling_rate"], 65536 / 1281167)
        self.assertEqual(result["delta"], 1e-6)
        self.assertEqual(result["sampling"], "poisson")
        self.assertBetween(result["epsilon_rdp"], 8.0, 12.0)
        self.assertBetween(result["epsilon_pld"], 8.0, 12.0)
        self.assertEqual(
            result["epsilon_rdp"],
            privacy.epsilon(1.3127, 1369, 1e-6, sampling_rate=65536 / 1281167),
        )
        self.assertEqual(
            [r["delta"] for r in result["epsilon_table"]],
            list(privacy.DEFAULT_DELTAS),
        )
        # delta = 1e-6 >= 1/N: warned on stderr, stdout stays pure JSON.
        self.assertIn("warning:", proc.stderr)
        self.assertLen(result["warnings"], 1)

    def test_shuffle_json(self):
        proc = _run(
            *PAPER, "--noise_multiplier=1.3127", "--sampling=shuffle", "--json"
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        result = json.loads(proc.stdout)
        self.assertEqual(result["sampling"], "shuffle")
        self.assertEqual(result["adjacency"], "replace_one")
        self.assertNotIn("epsilon_pld", result)
        self.assertGreater(result["epsilon_rdp"], 12.0)

    def test_bad_input_one_line_exit_2(self):
        proc = _run(
            "--dataset_size=100",
            "--batch_size=200",
            "--steps=3",
            "--noise_multiplier=1",
            "--delta=1e-5",
        )
        self.assertEqual(proc.returncode, 2)
        self.assertEqual(proc.stdout, "")
        self.assertLen(proc.stderr.strip().splitlines(), 1)
        self.assertTrue(proc.stderr.startswith("error: "), proc.stderr)
        self.assertNotIn("Traceback", proc.stderr)


class CliInProcessTest(parameterized.TestCase):
    def test_target_epsilon_json(self):
        code, out, err = _main(
            "--dataset_size=60000",
            "--batch_size=256",
            "--steps=3000",
            "--target_epsilon=3",
            "--delta=1e-5",
            "--json",
        )
        self.assertEqual(code, 0, err)
        result = json.loads(out)
        self.assertLessEqual(result["epsilon_rdp"], 3.0)
        self.assertGreater(result["epsilon_rdp"], 2.9)
        self.assertEqual(
            result["noise_multiplier"],
            privacy.calibrate_noise(
                3.0, 1e-5, steps=3000, dataset_size=60000, batch_size=256
            ),
        )
        self.assertEqual(result["warnings"], [])
        self.assertEqual(err, "")

    def test_text_output(self):
        code, out, err = _main(
            "--dataset_size=60000",
            "--batch_size=256",
            "--epochs=15",
            "--noise_multiplier=1.1",
            "--delta=1e-5",
        )
        self.assertEqual(code, 0, err)
        self.assertIn("epsilon (rdp)", out)
        self.assertIn("epsilon_rdp", out)
        self.assertIn("1e-08", out)
        self.assertIn("3,516", out)  # ceil(15 * 60000 / 256)

    @parameterized.named_parameters(
        (
            "steps_and_epochs",
            ["--steps=3", "--epochs=1", "--noise_multiplier=1"],
            "not allowed",
        ),
        (
            "sigma_and_target",
            ["--steps=3", "--noise_multiplier=1", "--target_epsilon=1"],
            "not allowed",
        ),
        ("no_duration", ["--noise_multiplier=1"], "required"),
        ("no_noise", ["--steps=3"], "required"),
        (
            "negative_sigma",
            ["--steps=3", "--noise_multiplier=-1"],
            "noise_multiplier",
        ),
        ("zero_target", ["--steps=3", "--target_epsilon=0"], "target_epsilon"),
        (
            "unreachable",
            ["--steps=100", "--target_epsilon=1e-4", "--batch_size=1000"],
            "unreachable",
        ),
        (
            "bad_accountant",
            ["--steps=3", "--noise_multiplier=1", "--accountant=x"],
            "accountant",
        ),
        (
            "bad_sampling",
            ["--steps=3", "--noise_multiplier=1", "--sampling=x"],
            "sampling",
        ),
        (
            "pld_shuffle",
            [
                "--steps=3",
                "--noise_multiplier=1",
                "--accountant=pld",
                "--sampling=shuffle",
            ],
            "PLD",
        ),
        ("negative_steps", ["--steps=-3", "--noise_multiplier=1"], "steps"),
        ("zero_epochs", ["--epochs=0", "--noise_multiplier=1"], "epochs"),
        (
            "nan_sigma",
            ["--steps=3", "--noise_multiplier=nan"],
            "noise_multiplier",
        ),
    )
    def test_errors(self, extra, pattern):
        code, out, err = _main(
            "--dataset_size=1000", "--batch_size=10", "--delta=1e-5", *extra
        )
        self.assertEqual(code, 2)
        self.assertEqual(out, "")
        self.assertRegex(err, f"^error: .*{pattern}")
        self.assertLen(err.splitlines(), 1)

    def test_bad_delta(self):
        code, _, err = _main(
            "--dataset_size=1000",
            "--batch_size=10",
            "--steps=3",
            "--noise_multiplier=1",
            "--delta=1",
        )
        self.assertEqual(code, 2)
        self.assertRegex(err, "^error: .*delta")

    def test_zero_noise_json_is_strict(self):
        code, out, _ = _main(
            "--dataset_size=1000",
            "--batch_size=10",
            "--steps=3",
            "--noise_multiplier=0",
            "--delta=1e-5",
            "--json",
        )
        self.assertEqual(code, 0)
        result = json.loads(out, parse_constant=lambda c: self.fail(c))
        self.assertIsNone(result["epsilon_rdp"])

    def test_both_with_target_meets_target_under_both(self):
        code, out, _ = _main(
            "--dataset_size=10000",
            "--batch_size=200",
            "--steps=10",
            "--target_epsilon=0.5",
            "--delta=1e-5",
            "--accountant=both",
            "--tolerance=5e-2",
            "--json",
        )
        self.assertEqual(code, 0)
        result = json.loads(out)
        self.assertLessEqual(result["epsilon_rdp"], 2.0)
        self.assertLessEqual(result["epsilon_pld"], 2.0)
        self.assertEqual(
            result["noise_multiplier"],
            max(result["calibrated_noise_multiplier"].values()),
        )


if __name__ == "__main__":
    absltest.main()
