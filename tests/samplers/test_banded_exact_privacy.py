"""The printed (ε, δ) of banded sampling holds exactly on tiny datasets.

For neighbours of every size (n other units, then one more), the exact
δ(ε) between the two releases is computed by enumerating the groups and the
Poisson draws (`banded_exact`), at the ε that tfdp prints for the sampler,
and must not exceed the printed δ. The groups are those of tfdp's rule,
each unit's own uniform draw (`BandGroups.groups`, whose independence
tests/samplers/test_banded_sampler.py checks); the balanced split that
rule replaced fails the same check.
"""

import warnings

import numpy as np
import pytest

from tests.samplers import banded_exact
from tfdp import privacy
from tfdp import samplers

DELTA = 1e-5
# (declared N, B, b, T, σ, coefficients): q = b·B / N.
# Three steps integrate over a 3-D grid: seconds a case, so under `slow`.
_SLOW = pytest.mark.slow
CASES = [
    (4, 2, 2, 2, 0.5, (1.0, 0.0)),  # q = 1
    (4, 1, 2, 2, 0.7, (0.8, 0.6)),  # q = 0.5
    pytest.param((8, 2, 2, 3, 1.0, (0.8, 0.6)), marks=_SLOW),  # a unit in two steps of three
    pytest.param((6, 1, 3, 3, 0.7, (0.8, 0.48, 0.36)), marks=_SLOW),  # q = 0.5
    (6, 1, 3, 2, 0.6, (0.9, 0.3, 0.3)),  # T < b: group 2 never drawn
    pytest.param((8, 1, 4, 3, 0.8, (0.9, 0.3, 0.2, 0.2)), marks=_SLOW),  # q = 0.5, T < b
]
# The other units' clipped contributions (C = 1); the added unit's is +1.
OTHERS = {"zero": 0.0, "minus": -1.0, "plus": 1.0}


def _printed_epsilon(n, batch, bands, steps, sigma, accountant):
    sampler = samplers.make_sampler("banded_poisson", dataset_size=n,
                                    logical_batch_size=batch, bands=bands)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # δ ≥ 1/N: tiny N on purpose.
        epsilon = privacy.epsilon(sigma, steps, DELTA, dataset_size=n, batch_size=batch,
                                  sampler=sampler, accountant=accountant)
    return epsilon, sampler.group_sampling_rate


def _per_sigma(steps):
    # Grid points per σ: the midpoint sum's error stays below 2% (it is
    # within 0.2% of a grid twice as fine at T = 3).
    return 20 if steps <= 2 else 6


@pytest.mark.parametrize("case", CASES, ids=lambda c: "N{}-B{}-b{}-T{}".format(*c[:4]))
@pytest.mark.parametrize("accountant", [
    "pld", pytest.param("rdp", marks=pytest.mark.slow)])  # RDP's ε is the larger.
def test_printed_epsilon_holds_for_neighbours_of_every_size(case, accountant):
    n, batch, bands, steps, sigma, coefficients = case
    epsilon, q = _printed_epsilon(n, batch, bands, steps, sigma, accountant)
    assert np.isfinite(epsilon)
    worst = 0.0
    # Up to 8 units at T = 2; up to 6 at T = 3, where a grid costs more.
    for others in range(0, 8 if steps <= 2 else 6):
        for value in OTHERS.values():
            values = [value] * others
            without = banded_exact.independent_mixture(values, bands, steps, q)
            with_one = banded_exact.independent_mixture(values + [1.0], bands, steps, q)
            worst = max(worst, banded_exact.hockey_stick(
                with_one, without, coefficients, sigma, epsilon, per_sigma=_per_sigma(steps)))
    # 2% for the grid's error, which is below 2% at these spacings.
    assert worst <= DELTA * 1.02, (case, accountant, worst)


def test_the_enumeration_matches_the_gaussian_mechanism():
    # One unit, one group, q = 1, no correlation: the Gaussian mechanism of
    # sensitivity 1, whose δ(ε) has a closed form.
    from scipy import stats
    sigma, epsilon = 0.8, 2.0
    without = banded_exact.independent_mixture([], 1, 1, 1.0)
    with_one = banded_exact.independent_mixture([1.0], 1, 1, 1.0)
    exact = (stats.norm.cdf(0.5 / sigma - epsilon * sigma)
             - np.exp(epsilon) * stats.norm.cdf(-0.5 / sigma - epsilon * sigma))
    got = banded_exact.hockey_stick(with_one, without, (1.0,), sigma, epsilon, per_sigma=40)
    assert got == pytest.approx(exact, rel=1e-3)


def test_a_balanced_split_breaks_the_printed_epsilon():
    # The check can fail: a balanced split of 5 units into groups of 3 and 2
    # moves one of the others between groups when the fifth is added, so
    # one unit moves the release by √5 > 1 in units of C.
    n, batch, bands, steps, sigma, coefficients = CASES[0]
    epsilon, q = _printed_epsilon(n, batch, bands, steps, sigma, "pld")
    values = [-1.0] * 4
    without = banded_exact.output_mixture(
        values, bands, steps, q, banded_exact.balanced_assignments)
    with_one = banded_exact.output_mixture(
        values + [1.0], bands, steps, q, banded_exact.balanced_assignments)
    delta = banded_exact.hockey_stick(with_one, without, coefficients, sigma, epsilon,
                                      per_sigma=20)
    assert delta > 100 * DELTA
