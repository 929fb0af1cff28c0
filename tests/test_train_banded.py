"""Banded matrix-factorization DP-SGD in the trainer: `PrivacyConfig.bands`.

The run samples from b groups, correlates its noise over b steps, records b
and the accounted rate in `summary.json`, resumes its noise exactly after a
kill, and at b = 1 is today's DP-SGD bit for bit.
"""

import json
import os

import dp_accounting
import gin
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import config
from tfdp import train
from tfdp.privacy import banded_mf
from tests import test_resume
from tests.test_train import FINAL

N_DIGITS = 1437  # The digits training split.
QUICK = [
    "DataConfig.dataset = 'digits'",
    "OptimizationConfig.epochs = 1",
    "OptimizationConfig.logical_batch_size = 128",
    "RunConfig.physical_batch_size = 64",
    "RunConfig.export_model = False",
    "RunConfig.write_html_report = False",
    "PrivacyConfig.target_epsilon = 4.0",
    "PrivacyConfig.insecure_reproducible_seed = 7",
]


def _checkpoint_tensors(workdir):
    """Every float tensor of the run's last checkpoint, by name."""
    reader = tf.train.load_checkpoint(os.path.join(workdir, "checkpoints"))
    tensors = {}
    for name in reader.get_variable_to_shape_map():
        value = reader.get_tensor(name)
        if isinstance(value, np.ndarray) and value.dtype.kind == "f":
            tensors[name] = value
    return tensors


def _ledger(workdir):
    with open(os.path.join(workdir, "checkpoints", "privacy_ledger.json")) as f:
        return json.load(f)


def _amplified_epsilon(sigma, steps, bands, q, delta):
    """dp_accounting: ⌈T/b⌉ Poisson-subsampled Gaussians at q, composed (RDP)."""
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
        -(-steps // bands)))
    return accountant.get_epsilon(delta)


class BandedTrainerTest(tf.test.TestCase):

    def _train(self, *bindings):
        workdir = self.create_tempdir().full_path
        config.parse(["mnist_default.gin"], [*QUICK, *bindings])
        try:
            summary = train.train(workdir)
        finally:
            gin.clear_config()
        return workdir, summary

    def test_banded_run_records_bands_and_the_group_rate(self):
        workdir, summary = self._train("PrivacyConfig.bands = 4",
                                       "PrivacyConfig.band_coefficients = 'optimized'")
        with open(os.path.join(workdir, "summary.json")) as f:
            self.assertEqual(json.load(f)["bands"], 4)
        steps, sigma = summary["steps"], summary["noise_multiplier"]
        self.assertEqual(summary["bands"], 4)
        self.assertAllClose(summary["sampling_probability"], 4 * 128 / N_DIGITS)
        ledger = _ledger(workdir)
        self.assertEqual(ledger["sampler"], "banded_poisson")
        self.assertEqual(ledger["bands"], 4)
        self.assertAllClose(ledger["band_coefficients"],
                            banded_mf.optimized_coefficients(4, steps))
        # σ was calibrated for the banded event, and the printed ε is its own.
        expected = _amplified_epsilon(sigma, steps, 4, 4 * 128 / N_DIGITS, summary["delta"])
        self.assertAllClose(summary["epsilon"], expected, rtol=1e-9)
        self.assertLessEqual(summary["epsilon"], 4.0 + 1e-9)
        # The last b - 1 = 3 noise tensors of each trainable variable, saved for a resume.
        states = [value for name, value in _checkpoint_tensors(workdir).items()
                  if "noise_state" in name]
        self.assertNotEmpty(states)
        self.assertTrue(all(state.shape[0] == 3 for state in states))

    def test_optimized_run_shorter_than_its_bands(self):
        # 0.25 epochs of 1437 examples at 128 a step: 3 steps, fewer than the 6 bands.
        workdir, summary = self._train("OptimizationConfig.epochs = 0.25",
                                       "PrivacyConfig.bands = 6",
                                       "PrivacyConfig.band_coefficients = 'optimized'")
        self.assertEqual(summary["steps"], 3)
        self.assertEqual(summary["bands"], 6)
        coefficients = _ledger(workdir)["band_coefficients"]
        self.assertAllClose(coefficients, banded_mf.optimized_coefficients(6, 3))
        self.assertEqual(coefficients[3:], [0.0, 0.0, 0.0])
        self.assertGreater(coefficients[0], 0)

    @pytest.mark.slow  # Keras fit's one-band test (tests/keras/test_banded_fit.py) is fast.
    def test_one_band_through_the_new_settings_is_dp_sgd_bit_for_bit(self):
        dp_sgd_dir, dp_sgd = self._train()
        one_dir, one = self._train("PrivacyConfig.bands = 1",
                                   "PrivacyConfig.band_coefficients = 'optimized'",
                                   "PrivacyConfig.sampler = 'banded_poisson'")
        self.assertEqual(dp_sgd["bands"], 1)
        self.assertEqual(one["bands"], 1)
        self.assertEqual(dp_sgd["sampling_probability"], 128 / N_DIGITS)
        for name in ("epsilon", "noise_multiplier", "steps", "sampling_probability",
                     "test_accuracy"):
            self.assertEqual(one[name], dp_sgd[name], name)
        expected, got = _checkpoint_tensors(dp_sgd_dir), _checkpoint_tensors(one_dir)
        self.assertEqual(sorted(got), sorted(expected))
        self.assertNotIn("noise_state", " ".join(got))
        for name, value in expected.items():
            self.assertAllEqual(got[name], value, msg=name)

    def test_a_checkpoint_of_other_bands_is_refused(self):
        workdir, _ = self._train("PrivacyConfig.bands = 2")
        config.parse(["mnist_default.gin"], [*QUICK, "PrivacyConfig.bands = 4"])
        try:
            with self.assertRaisesRegex(ValueError, "another privacy configuration.*bands: "
                                                    "checkpoint 2 vs this run 4"):
                train.train(workdir)
        finally:
            gin.clear_config()


class BandedUserLevelTrainerTest(tf.test.TestCase):

    def test_user_level_run_with_two_bands_records_them(self):
        # The digits training split, each example given one of 300 simulated users.
        train_source, _, _ = tfdp.data.load_offline("digits")
        x = np.round(np.asarray(train_source.images) * 255).astype("uint8")
        y = np.asarray(train_source.labels)
        users = np.random.default_rng(0).integers(0, 300, size=len(y))
        path = os.path.join(self.create_tempdir().full_path, "users.npz")
        np.savez(path, x_train=x, y_train=y, user_ids=users, x_test=x[:100], y_test=y[:100])
        workdir = self.create_tempdir().full_path
        config.parse(["mnist_default.gin"], [
            *QUICK, f"DataConfig.dataset = 'npz:{path}'",
            "OptimizationConfig.logical_batch_size = 16",
            "RunConfig.physical_batch_size = 32",
            "PrivacyConfig.privacy_unit = 'user'",
            "PrivacyConfig.max_examples_per_user = 2",
            "PrivacyConfig.bands = 2"])
        try:
            summary = train.train(workdir)
        finally:
            gin.clear_config()
        with open(os.path.join(workdir, "summary.json")) as f:
            written = json.load(f)
        users_n = len(np.unique(users))
        self.assertEqual(written["bands"], 2)
        self.assertEqual(written["privacy_unit"], "user")
        self.assertNotIn("example_level_group_privacy", written)
        self.assertAllClose(summary["sampling_probability"], 2 * 16 / users_n)
        ledger = _ledger(workdir)
        self.assertEqual((ledger["sampler"], ledger["bands"], ledger["dataset_size"]),
                         ("banded_user_poisson", 2, users_n))
        expected = _amplified_epsilon(summary["noise_multiplier"], summary["steps"], 2,
                                      2 * 16 / users_n, summary["delta"])
        self.assertAllClose(summary["epsilon"], expected, rtol=1e-9)
        self.assertLessEqual(summary["epsilon"], 4.0 + 1e-9)


class BandedResumeAfterKillTest(tf.test.TestCase):

    @pytest.mark.slow
    def test_killed_and_resumed_banded_run_matches_uninterrupted_run(self):
        # The resumed run must continue the last b - 1 noise tensors, not zeros:
        # its final weights are then the uninterrupted run's.
        banded = ["--gin_param=PrivacyConfig.bands = 4",
                  "--gin_param=PrivacyConfig.band_coefficients = 'optimized'"]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(test_resume, "ARGS", [*test_resume.ARGS, *banded])
            reference_dir = self.create_tempdir().full_path
            reference = FINAL.search(test_resume._run_to_end(reference_dir))
            workdir = self.create_tempdir().full_path
            # Kills between checkpoints (every 3 steps), so each resume replays steps.
            killed = [test_resume._run_and_kill_after_step(workdir, k) for k in (5, 13, 20)]
            self.assertTrue(all(killed))
            resumed_out = test_resume._run_to_end(workdir)
        self.assertIn("resumed from", resumed_out)
        resumed = FINAL.search(resumed_out)
        self.assertEqual(resumed["steps"], reference["steps"])
        self.assertEqual(resumed["eps"], reference["eps"])
        self.assertEqual(_ledger(workdir), _ledger(reference_dir))
        expected, got = _checkpoint_tensors(reference_dir), _checkpoint_tensors(workdir)
        self.assertEqual(sorted(got), sorted(expected))
        self.assertTrue(any("noise_state" in name for name in got))
        for name, value in expected.items():
            self.assertAllClose(got[name], value, rtol=1e-6, atol=1e-7, msg=name)


if __name__ == "__main__":
    tf.test.main()
