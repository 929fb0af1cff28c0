"""tfdp.privacy.group_epsilon: the group-privacy conversions of TF-Privacy's statement."""

import math

import dp_accounting
import pytest

from tfdp import privacy


def _gaussian_epsilon(sigma, count, delta):
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma), count)
    return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)


def test_one_example_is_example_level():
    assert privacy.group_epsilon(1.1, 100, 1e-5, 1, sampling_rate=0.01) == pytest.approx(
        privacy.epsilon(1.1, 100, 1e-5, sampling_rate=0.01), rel=1e-12)


def test_without_sampling_sigma_is_divided_by_the_group_size():
    assert privacy.group_epsilon(2.0, 5, 1e-6, 4) == pytest.approx(
        _gaussian_epsilon(0.5, 5, 1e-6), rel=1e-9)


@pytest.mark.parametrize("sigma, k", [(0.9, 2), (1.1, 3)])
def test_rdp_with_sampling_is_vadhan_lemma_2_2(sigma, k):
    # At the example delta whose group delta (Lemma 2.2, tighter form) is the
    # target, the group epsilon is k times the example epsilon.
    steps, q, example_delta = 25000, 2e-4, 1e-8
    example = privacy.epsilon(sigma, steps, example_delta, sampling_rate=q)
    group_delta = example_delta * math.expm1(k * example) / math.expm1(example)
    group = privacy.group_epsilon(sigma, steps, group_delta, k, sampling_rate=q)
    assert group == pytest.approx(k * example, rel=1e-6)


def test_rdp_group_epsilon_can_be_infinite():
    assert math.isinf(privacy.group_epsilon(1.0, 782, 1e-6, 10, sampling_rate=0.0064))


@pytest.mark.slow  # 20-40 s on 2 cores: with the slow tests (CI runs them).
def test_pld_with_sampling_is_a_mixture_of_gaussians():
    # TF-Privacy's figure: sigma 2 halved by microbatching, 5 epochs of
    # 10,000 examples at batch 64, delta 1e-6, two examples per user.
    group = privacy.group_epsilon(1.0, 782, 1e-6, 2, sampling_rate=0.0064, accountant="pld")
    assert f"{group:.3f}" == "2.532"


def test_tighter_than_the_plain_conversion():
    # The plain (k eps, k e^{(k-1) eps} delta) at the same user delta claims more.
    sigma, steps, q, delta, k = 1.0, 1000, 0.01, 1e-5, 3
    group = privacy.group_epsilon(sigma, steps, delta, k, sampling_rate=q)
    example_eps, example_delta = privacy.example_level_budget(group, delta, k)
    assert privacy.epsilon(sigma, steps, example_delta, sampling_rate=q) > example_eps


def test_bad_group_size_is_refused():
    with pytest.raises(ValueError, match="Received: group_size=0"):
        privacy.group_epsilon(1.0, 10, 1e-5, 0)


class TestCopiesClaim:
    """`copies_claim`: the largest group of identical rows kept as distinct records."""

    def test_poisson_runs_use_the_tight_conversion(self):

        ledger = privacy.PrivacyLedger(1.0, 0.05, delta=1e-5, steps=50, accountant="rdp")
        claim = privacy.copies_claim(ledger, 2)
        tight = privacy.group_epsilon(1.0, 50, 1e-5, 2, sampling_rate=0.05)
        assert claim["group_epsilon"] == tight
        assert claim["group_delta"] == 1e-5
        assert claim["group_epsilon"] > ledger.epsilon()
        assert "identical rows one record" in privacy.describe_copies_claim(claim)

    def test_other_runs_use_the_standard_conversion(self):

        ledger = privacy.PrivacyLedger(2.0, delta=1e-6, steps=100, sampler="shuffle",
                                       dataset_size=1000, batch_size=100)
        claim = privacy.copies_claim(ledger, 3)
        epsilon = ledger.epsilon()
        assert claim["group_epsilon"] == 3 * epsilon
        assert claim["group_delta"] == min(1.0, 3 * math.exp(2 * epsilon) * 1e-6)
        banded = privacy.PrivacyLedger(1.0, delta=1e-5, steps=30, dataset_size=1000,
                                       batch_size=50, bands=2, sampler="banded_poisson")
        assert privacy.copies_claim(banded, 2)["group_epsilon"] == 2 * banded.epsilon()
