"""Tests for `python -m tfdp.privacy` (no TensorFlow)."""

import io
import json
import os
import subprocess
import sys

import dp_accounting
from absl.testing import absltest
from absl.testing import parameterized
from dp_accounting import rdp as dp_rdp

from tests.privacy import closed_forms as cf
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


class CliSubprocessTest(absltest.TestCase, cf.ClosedFormAssertions):
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
        self.assertEqual(result["sampler"], "poisson")
        self.assertBetween(result["epsilon_rdp"], 8.0, 12.0)
        self.assertBetween(result["epsilon_pld"], 8.0, 12.0)
        self.assertEqual(
            result["epsilon_rdp"],
            privacy.epsilon(1.3127, 1369, 1e-6, sampling_rate=65536 / 1281167),
        )
        self.assertPoissonRdp(result["epsilon_rdp"], 1.3127, 1369, 65536 / 1281167, 1e-6)
        self.assertEqual(
            [r["delta"] for r in result["epsilon_table"]],
            list(privacy.DEFAULT_DELTAS),
        )
        # delta = 1e-6 >= 1/N: warned on stderr, stdout stays pure JSON.
        self.assertIn("warning:", proc.stderr)
        self.assertLen(result["warnings"], 1)

    def test_shuffle_json(self):
        proc = _run(
            *PAPER,
            "--noise_multiplier=1.3127",
            "--sampler=shuffle",
            "--accountant=both",
            "--json",
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        result = json.loads(proc.stdout)
        self.assertEqual(result["sampler"], "shuffle")
        self.assertEqual(result["adjacency"], "zero_out")
        # A shuffle epoch is N // B = 19 steps: 70 epochs are 1330 steps.
        self.assertEqual(result["steps"], 70 * 19)
        direct = dp_rdp.RdpAccountant()
        direct.compose(dp_accounting.GaussianDpEvent(1.3127), count=70)
        self.assertEqual(result["epsilon_rdp"], direct.get_epsilon(1e-6))
        # 70 Gaussian mechanisms in closed form (52.28 in docs/PRIVACY.md),
        # and PLD at the exact mu = sqrt(70) / sigma Gaussian (49.86).
        self.assertGaussianRdp(result["epsilon_rdp"], 1.3127, 70, 1e-6)
        self.assertIn("epsilon_pld", result)
        self.assertGaussianPld(result["epsilon_pld"], 1.3127, 70, 1e-6)
        self.assertLessEqual(result["epsilon_pld"], result["epsilon_rdp"])
        self.assertGreater(result["epsilon_pld"], 12.0)

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

    def test_help_shows_the_sampler_flag(self):
        proc = _run("--help")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("--sampler {poisson,shuffle", proc.stdout)


class CliInProcessTest(parameterized.TestCase, cf.ClosedFormAssertions):
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
            "bad_sampler",
            ["--steps=3", "--noise_multiplier=1", "--sampler=x"],
            "sampler",
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

    def test_pld_shuffle(self):
        code, out, err = _main(
            "--dataset_size=1000",
            "--batch_size=10",
            "--steps=250",
            "--noise_multiplier=1",
            "--delta=1e-5",
            "--accountant=pld",
            "--sampler=shuffle",
            "--json",
        )
        self.assertEqual(code, 0, err)
        result = json.loads(out)
        self.assertEqual(result["adjacency"], "zero_out")
        # 100 steps per pass: 250 steps are 3 passes.
        self.assertGaussianPld(result["epsilon_pld"], 1.0, 3, 1e-5)

    @parameterized.parameters(
        # sampler, N, B, epochs, steps.
        ("poisson", 60000, 256, 15, 3516),  # ceil(15 * 60000 / 256)
        ("shuffle", 60000, 256, 15, 3510),  # 15 * (60000 // 256)
        ("shuffle", 60000, 256, 1.5, 351),  # ceil(1.5 * 234)
        ("shuffle", 1000, 300, 2, 6),  # 2 * (1000 // 300)
        ("poisson", 1000, 300, 2, 7),  # ceil(2 * 1000 / 300)
        ("poisson", 100, 1, 1.1, 110),  # 1.1 * 100 is 110.00000000000001
        ("shuffle", 100, 1, 1.1, 110),  # in floats; the decimal is exact.
    )
    def test_epochs_to_steps(self, sampler, n, b, epochs, steps):
        code, out, err = _main(
            f"--dataset_size={n}",
            f"--batch_size={b}",
            f"--epochs={epochs}",
            "--noise_multiplier=2",
            "--delta=1e-5",
            f"--sampler={sampler}",
            "--json",
        )
        self.assertEqual(code, 0, err)
        self.assertEqual(json.loads(out)["steps"], steps)

    @parameterized.parameters(
        (["--steps=250"],), (["--steps=250", "--json"],), (["--epochs=2.5", "--json"],),
    )
    def test_sampler_flag(self, extra):
        args = ["--dataset_size=1000", "--batch_size=10", "--noise_multiplier=1",
                "--delta=1e-5", "--accountant=both", *extra]
        code, out, err = _main(*args, "--sampler=shuffle")
        self.assertEqual(code, 0, err)
        self.assertEqual(err, "")
        if "--json" in extra:
            self.assertEqual(json.loads(out)["sampler"], "shuffle")
        else:
            self.assertRegex(out, r"(?m)^sampler +shuffle \(zero_out\)$")
        # Not the default's output: the flag was honoured.
        _, default_out, _ = _main(*args)
        self.assertNotEqual(default_out, out)

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


class DefaultDeltaTest(absltest.TestCase):
    """One default δ on every route: min(1e-5, the largest power of ten below 1/N)."""

    def test_values(self):
        for n, delta in ((10, 1e-5), (4_000, 1e-5), (99_999, 1e-5), (100_000, 1e-6),
                         (1_281_167, 1e-7), (None, 1e-5)):
            self.assertAlmostEqual(privacy.default_delta(n), delta, msg=n)
            if n:
                self.assertLess(privacy.default_delta(n), 1 / n)

    def test_cli_without_delta_uses_it(self):
        code, out, err = _main("--dataset_size=1281167", "--batch_size=1024",
                               "--steps=100", "--noise_multiplier=2", "--json")
        self.assertEqual(code, 0, err)
        self.assertEqual(json.loads(out)["delta"], 1e-7)

    def test_the_trainer_defaults_to_it(self):
        import dataclasses

        from tfdp import training

        fields = {field.name: field for field in dataclasses.fields(training.PrivacyConfig)}
        self.assertIsNone(fields["delta"].default)


class CliBandsTest(parameterized.TestCase):
    """`--bands=b`: banded MF, accounted as ⌈T/b⌉ Poisson-subsampled Gaussians at b·B/N."""

    @parameterized.parameters(
        (4000, 256, 469, 4, "rdp"), (60000, 256, 469, 8, "rdp"), (4000, 256, 470, 3, "pld"))
    def test_epsilon_is_the_rounds_at_the_group_rate(self, n, b, steps, bands, acc):
        code, out, err = _main(f"--dataset_size={n}", f"--batch_size={b}", f"--steps={steps}",
                               "--noise_multiplier=1.3", "--delta=1e-5", f"--bands={bands}",
                               f"--accountant={acc}", "--json")
        self.assertEqual(code, 0, err)
        result = json.loads(out)
        q = bands * b / n
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.3)),
            -(-steps // bands))
        if acc == "rdp":
            accountant = dp_rdp.RdpAccountant()
        else:
            accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
        accountant.compose(event)
        self.assertAlmostEqual(result[f"epsilon_{acc}"], accountant.get_epsilon(1e-5),
                               delta=1e-9 if acc == "rdp" else 1e-2)
        self.assertEqual(result["sampler"], "banded_poisson")
        self.assertEqual(result["bands"], bands)
        self.assertAlmostEqual(result["group_sampling_rate"], q)
        self.assertEqual(result["rounds"], -(-steps // bands))
        self.assertEqual(result["epsilon_table"][0]["sampler"], "banded_poisson")
        noise = result["noise_error"]
        self.assertLess(noise["optimized"]["prefix_sum_error"],
                        noise["sqrt"]["prefix_sum_error"])

    @parameterized.parameters((2, 4), (3, 6), (1, 5), (5, 6))
    def test_fewer_steps_than_bands_print_both_strategies(self, steps, bands):
        code, out, err = _main("--dataset_size=60000", "--batch_size=256", f"--steps={steps}",
                               "--noise_multiplier=1", "--delta=1e-5", f"--bands={bands}",
                               "--json")
        self.assertEqual(code, 0, err)
        result = json.loads(out)
        self.assertEqual(result["rounds"], 1)
        noise = result["noise_error"]
        optimized = noise["optimized"]["coefficients"]
        self.assertLen(optimized, bands)
        self.assertGreater(optimized[0], 0)
        self.assertEqual(optimized[steps:], [0.0] * (bands - steps))
        self.assertLess(noise["optimized"]["prefix_sum_error"],
                        noise["sqrt"]["prefix_sum_error"])
        code, out, err = _main("--dataset_size=60000", "--batch_size=256", f"--steps={steps}",
                               "--noise_multiplier=1", "--delta=1e-5", f"--bands={bands}")
        self.assertEqual(code, 0, err)
        self.assertIn("noise, optimized (x C)", out)

    def test_users_are_split_into_the_groups(self):
        code, out, err = _main("--dataset_size=1000", "--batch_size=10", "--steps=100",
                               "--noise_multiplier=1", "--delta=1e-5", "--bands=4",
                               "--sampler=user_poisson", "--json")
        self.assertEqual(code, 0, err)
        result = json.loads(out)
        self.assertEqual(result["sampler"], "banded_user_poisson")
        self.assertEqual(result["adjacency"], "add_or_remove_one_user")
        accountant = dp_rdp.RdpAccountant()
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.04, dp_accounting.GaussianDpEvent(1.0)), 25))
        self.assertAlmostEqual(result["epsilon_rdp"], accountant.get_epsilon(1e-5), delta=1e-9)

    def test_target_epsilon_calibrates_the_banded_sigma(self):
        code, out, err = _main("--dataset_size=4000", "--batch_size=256", "--steps=469",
                               "--target_epsilon=8", "--delta=1e-5", "--bands=4", "--json")
        self.assertEqual(code, 0, err)
        result = json.loads(out)
        self.assertLessEqual(result["epsilon_rdp"], 8.0)
        self.assertGreater(result["epsilon_rdp"], 7.9)
        banded = privacy.calibrate_noise(
            8.0, 1e-5, steps=469, dataset_size=4000, batch_size=256,
            sampler=_banded_sampler(4000, 256, 4))
        self.assertEqual(result["noise_multiplier"], banded)
        # More than DP-SGD's σ: fewer rounds, but each at four times the rate.
        self.assertGreater(banded, privacy.calibrate_noise(
            8.0, 1e-5, steps=469, dataset_size=4000, batch_size=256))

    @parameterized.parameters(
        (["--bands=2", "--sampler=shuffle"], "bands > 1 samples each privacy unit"),
        (["--bands=16"], "bands × logical_batch_size must not exceed"),
        (["--bands=0"], "expected >= 1"),
    )
    def test_refusals(self, extra, pattern):
        code, _, err = _main("--dataset_size=4000", "--batch_size=256", "--steps=469",
                             "--noise_multiplier=1", *extra)
        self.assertEqual(code, 2)
        self.assertRegex(err, pattern)

    def test_stays_free_of_tensorflow(self):
        proc = subprocess.run(
            [sys.executable, "-c",
             "import sys; from tfdp.privacy import cli; "
             "assert cli.main(['--dataset_size=4000', '--batch_size=256', '--steps=469', "
             "'--target_epsilon=2', '--bands=4']) == 0; "
             "assert 'tensorflow' not in sys.modules, 'tensorflow imported'"],
            capture_output=True, text=True, cwd=_REPO, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stderr)


def _banded_sampler(n, b, bands):
    from tfdp import samplers

    return samplers.make_sampler("banded_poisson", dataset_size=n, logical_batch_size=b,
                                 bands=bands)
