"""Banded matrix factorization: coefficients, prefix-sum error, accounting, config, ledger."""

import math

import dp_accounting
from dp_accounting import rdp
import numpy as np
import pytest

import tfdp
from tfdp import samplers
from tfdp.privacy import banded_mf
from tfdp.privacy import ledger as ledger_lib

N, B, T = 60_000, 256, 469


class TestCoefficients:

    def test_one_band_is_dp_sgd(self):
        assert banded_mf.square_root_coefficients(1) == (1.0,)

    @pytest.mark.parametrize("bands", [2, 4, 8, 64])
    def test_square_root_is_the_series_of_one_over_sqrt_one_minus_x_with_norm_one(self, bands):
        c = np.array(banded_mf.square_root_coefficients(bands))
        assert math.isclose(np.linalg.norm(c), 1.0, rel_tol=1e-12)
        series = [1.0, 0.5, 0.375, 0.3125, 0.2734375]
        np.testing.assert_allclose(c[:5] / c[0], series[:min(bands, 5)], rtol=1e-12)

    @pytest.mark.parametrize("bands", [1, 3, 16])
    def test_every_column_norm_of_the_strategy_is_at_most_one(self, bands):
        for coefficients in (banded_mf.square_root_coefficients(bands),
                             banded_mf.optimized_coefficients(bands, 40)):
            matrix = banded_mf.strategy_matrix(coefficients, 40)
            norms = np.linalg.norm(matrix, axis=0)
            assert norms.max() <= 1 + 1e-12
            assert math.isclose(norms.max(), 1.0, rel_tol=1e-9)

    def test_strategy_matrix_is_banded_lower_triangular_toeplitz(self):
        matrix = banded_mf.strategy_matrix([0.8, 0.5, 0.2], 6)
        assert matrix[3, 3] == 0.8 and matrix[3, 2] == 0.5 and matrix[3, 1] == 0.2
        assert matrix[3, 0] == 0 and matrix[2, 3] == 0

    @pytest.mark.parametrize("bad", [[1.0, 0.5], [0.0, 0.5], [-0.5], [], [float("nan")], "0.5"])
    def test_invalid_coefficients_are_refused(self, bad):
        with pytest.raises(ValueError, match="Received"):
            banded_mf.check_coefficients(bad)

    def test_coefficients_must_match_the_bands(self):
        with pytest.raises(ValueError, match="3 coefficients"):
            banded_mf.check_coefficients([0.6, 0.5], bands=3)

    def test_normalize_scales_to_norm_one(self):
        c = banded_mf.normalize_coefficients([2.0, 1.0])
        np.testing.assert_allclose(c, np.array([2.0, 1.0]) / math.sqrt(5), rtol=1e-15)
        assert banded_mf.check_coefficients(c) == c

    @pytest.mark.parametrize("bands", [0, -1, 1.5, True, "2", None])
    def test_invalid_bands_are_refused(self, bands):
        with pytest.raises(ValueError, match="bands"):
            banded_mf.validate_bands(bands)


class TestPrefixSumError:

    @pytest.mark.parametrize("steps", [1, 10, 469])
    def test_dp_sgd_error_is_root_of_half_t_plus_one(self, steps):
        assert math.isclose(banded_mf.prefix_sum_error((1.0,), steps),
                            math.sqrt((steps + 1) / 2), rel_tol=1e-12)

    @pytest.mark.parametrize("coefficients", [(0.8, 0.6), banded_mf.square_root_coefficients(5)])
    def test_equals_the_matrix_formula(self, coefficients):
        steps = 30
        inverse = np.linalg.inv(banded_mf.strategy_matrix(coefficients, steps))
        prefix = np.tril(np.ones((steps, steps))) @ inverse
        expected = math.sqrt(np.sum(prefix**2) / steps)
        assert math.isclose(banded_mf.prefix_sum_error(coefficients, steps), expected,
                            rel_tol=1e-10)

    def test_more_bands_lower_the_error(self):
        errors = [banded_mf.prefix_sum_error(banded_mf.square_root_coefficients(b), T)
                  for b in (1, 4, 8, 16)]
        assert errors == sorted(errors, reverse=True)
        assert errors[-1] < errors[0] / 2

    @pytest.mark.parametrize("bands", [2, 4, 16])
    def test_optimized_coefficients_beat_the_square_root(self, bands):
        square_root = banded_mf.square_root_coefficients(bands)
        optimized = banded_mf.optimized_coefficients(bands, T)
        assert len(optimized) == bands
        assert math.isclose(np.linalg.norm(optimized), 1.0, rel_tol=1e-12)
        assert (banded_mf.prefix_sum_error(optimized, T)
                < 0.97 * banded_mf.prefix_sum_error(square_root, T))


    @pytest.mark.parametrize("bands", [1, 2, 3, 4, 5, 6])
    def test_optimized_coefficients_are_valid_and_no_worse_for_every_t_up_to_twice_b(self, bands):
        square_root = banded_mf.square_root_coefficients(bands)
        for steps in range(1, 2 * bands + 1):
            optimized = banded_mf.optimized_coefficients(bands, steps)
            assert banded_mf.check_coefficients(optimized, bands=bands) == optimized
            assert optimized[0] > 0
            matrix = banded_mf.strategy_matrix(optimized, steps)
            assert np.linalg.norm(matrix, axis=0).max() <= 1 + 1e-12
            assert (banded_mf.prefix_sum_error(optimized, steps)
                    <= banded_mf.prefix_sum_error(square_root, steps) * (1 + 1e-12)), steps
            assert banded_mf.optimized_coefficients(bands, steps) == optimized  # Deterministic.

    @pytest.mark.parametrize("bands, steps", [(2, 1), (3, 2), (4, 2), (6, 3), (6, 5)])
    def test_fewer_steps_than_bands_optimise_the_t_banded_strategy_and_pad_zeros(
            self, bands, steps):
        optimized = banded_mf.optimized_coefficients(bands, steps)
        # C over T steps holds only c_0 … c_(T-1); a later one would only add to the norm.
        assert optimized[steps:] == (0.0,) * (bands - steps)
        assert optimized[:steps] == banded_mf.optimized_coefficients(steps, steps)
        assert math.isclose(np.linalg.norm(optimized), 1.0, rel_tol=1e-12)
        # Strictly better than the square root, whose tail takes part of the norm.
        assert (banded_mf.prefix_sum_error(optimized, steps)
                < banded_mf.prefix_sum_error(banded_mf.square_root_coefficients(bands), steps))

    def test_one_step_is_dp_sgd_whatever_the_bands(self):
        assert banded_mf.optimized_coefficients(5, 1) == (1.0, 0.0, 0.0, 0.0, 0.0)


def _rdp_epsilon(event, delta):
    accountant = rdp.RdpAccountant()
    accountant.compose(event)
    return accountant.get_epsilon(delta)


def _banded_sampler(bands, n=N, b=B):
    return samplers.make_sampler("banded_poisson", dataset_size=n, logical_batch_size=b,
                                 bands=bands)


class TestAccounting:

    def test_event_is_ceil_t_over_b_poisson_gaussians_at_the_group_rate(self):
        event = banded_mf.amplified_dp_event(1.1, T, bands=4, group_sampling_rate=4 * B / N)
        expected = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                4 * B / N, dp_accounting.GaussianDpEvent(1.1)), 118)
        assert event == expected
        assert _banded_sampler(4).dp_event(1.1, T) == expected

    @pytest.mark.parametrize("bands", [1, 4, 16])
    def test_ledger_epsilon_equals_dp_accounting_composition(self, bands):
        sigma, delta = 1.0, 1e-5
        ledger = ledger_lib.PrivacyLedger(
            sigma, delta=delta, steps=T, sampler="banded_poisson", dataset_size=N,
            batch_size=B, bands=bands)
        expected = _rdp_epsilon(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                bands * B / N, dp_accounting.GaussianDpEvent(sigma)),
            math.ceil(T / bands)), delta)
        assert math.isclose(ledger.epsilon(), expected, rel_tol=1e-9)
        mechanism = tfdp.DPSGD(1.0, sigma, sampler=_banded_sampler(bands), delta=delta)
        assert math.isclose(mechanism.epsilon(T), expected, rel_tol=1e-9)

    def test_one_band_accounts_as_poisson(self):
        poisson = tfdp.DPSGD(1.0, 1.0, sampler=samplers.make_sampler(
            "poisson", dataset_size=N, logical_batch_size=B))
        banded = tfdp.DPSGD(1.0, 1.0, sampler=_banded_sampler(1))
        assert banded.epsilon(T) == poisson.epsilon(T)

    def test_calibration_hits_the_target_with_bands(self):
        config = tfdp.DPSGDConfig(1.0, target_epsilon=3.0, delta=1e-5, bands=4)
        mechanism = tfdp.DPSGD.from_config(config, sampler=_banded_sampler(4), steps=T)
        epsilon = mechanism.epsilon(T)
        assert 3.0 * 0.99 < epsilon <= 3.0
        # Fewer rounds at a higher rate: another σ than DP-SGD's at the same budget.
        dp_sgd = tfdp.DPSGD.from_config(
            tfdp.DPSGDConfig(1.0, target_epsilon=3.0, delta=1e-5),
            sampler=samplers.make_sampler("poisson", dataset_size=N, logical_batch_size=B),
            steps=T)
        assert mechanism.noise_multiplier != dp_sgd.noise_multiplier


class TestConfigAndLedger:

    def test_defaults_change_nothing(self):
        config = tfdp.DPSGDConfig(1.0, 1.0)
        assert config.bands == 1 and config.strategy_coefficients == (1.0,)
        mechanism = tfdp.DPSGD(1.0, 1.0, sampler=samplers.make_sampler(
            "poisson", dataset_size=N, logical_batch_size=B))
        record = mechanism.ledger(3).to_dict()
        assert "bands" not in record and "band_coefficients" not in record

    def test_default_coefficients_are_the_banded_square_root(self):
        config = tfdp.DPSGDConfig(1.0, 1.0, bands=4)
        assert config.strategy_coefficients == banded_mf.square_root_coefficients(4)
        mechanism = tfdp.DPSGD.from_config(config, sampler=_banded_sampler(4))
        assert mechanism.band_coefficients == banded_mf.square_root_coefficients(4)

    @pytest.mark.parametrize("changes, match", [
        ({"bands": 0}, "bands"),
        ({"bands": 2.5}, "bands"),
        ({"bands": 3, "band_coefficients": (0.8, 0.6)}, "3 coefficients"),
        ({"bands": 2, "band_coefficients": (0.9, 0.6)}, "norm"),
        ({"bands": 2, "sampler": "poisson"}, "banded_poisson"),
        ({"bands": 2, "privacy_unit": "user", "max_examples_per_user": 1,
          "sampler": "user_poisson"}, "banded_user_poisson"),
        ({"bands": 2, "privacy_unit": "user", "max_examples_per_user": 1,
          "sampler": "banded_poisson"}, "privacy_unit"),
    ])
    def test_config_refuses(self, changes, match):
        with pytest.raises(ValueError, match=match):
            tfdp.DPSGDConfig(1.0, 1.0, **changes)

    def test_sampler_and_config_bands_must_agree(self):
        with pytest.raises(ValueError, match="must agree"):
            tfdp.DPSGD.from_config(tfdp.DPSGDConfig(1.0, 1.0, bands=4),
                                   sampler=_banded_sampler(2))
        with pytest.raises(ValueError, match="must agree"):
            tfdp.DPSGD.from_config(tfdp.DPSGDConfig(1.0, 1.0), sampler=_banded_sampler(2))

    def test_ledger_round_trips_bands_and_coefficients(self):
        mechanism = tfdp.DPSGD(1.0, 1.0, sampler=_banded_sampler(4),
                               band_coefficients=banded_mf.optimized_coefficients(4, T))
        ledger = mechanism.ledger(7)
        again = ledger_lib.PrivacyLedger.from_json(ledger.to_json())
        assert again == ledger and again.bands == 4
        assert again.band_coefficients == mechanism.band_coefficients
        assert again.epsilon() == ledger.epsilon()

    def test_ledger_refuses_bands_without_a_banded_sampler(self):
        with pytest.raises(ValueError, match="banded_poisson"):
            ledger_lib.PrivacyLedger(1.0, delta=1e-5, dataset_size=N, batch_size=B, bands=4)

    def test_resume_under_other_bands_or_coefficients_is_refused(self):
        key = tfdp.secret_key.SecretKey.generate()
        four = tfdp.DPSGD(1.0, 1.0, sampler=_banded_sampler(4), secret_key=key)
        record = four.ledger(10).to_dict()
        four.check_checkpoint(record, key, "ckpt")  # The same contract resumes.
        for other in (
            tfdp.DPSGD(1.0, 1.0, sampler=_banded_sampler(8), secret_key=key),
            tfdp.DPSGD(1.0, 1.0, sampler=_banded_sampler(1), secret_key=key),
            tfdp.DPSGD(1.0, 1.0, sampler=_banded_sampler(4), secret_key=key,
                       band_coefficients=banded_mf.optimized_coefficients(4, T)),
        ):
            with pytest.raises(ValueError, match="band"):
                other.check_checkpoint(record, key, "ckpt")
