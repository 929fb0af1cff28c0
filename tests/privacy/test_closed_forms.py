"""The independent derivations in closed_forms.py agree with each other.

They are what the accounting tests hold tfdp to, so each is checked here by a
second route that shares no code with it (and none with dp_accounting).
"""

import math

import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from scipy import special
from scipy import stats

from tests.privacy import closed_forms as cf


class GaussianTest(parameterized.TestCase):
    @parameterized.parameters((0.5, 0.0), (1.0, 1.0), (2.0, 3.0), (0.3, 0.2), (5.0, 10.0))
    def test_delta_is_the_hockey_stick_integral(self, mu, epsilon):
        # ∫ (φ(z − μ) − e^ε φ(z))_+ dz on a fine grid.
        z = np.linspace(-40, 40 + mu, 800_001)
        gap = stats.norm.pdf(z, loc=mu) - math.exp(epsilon) * stats.norm.pdf(z)
        integral = float(np.sum(np.maximum(gap, 0.0)) * (z[1] - z[0]))
        self.assertAlmostEqual(cf.gaussian_delta(epsilon, mu), integral, delta=1e-9)

    def test_delta_at_zero_is_total_variation(self):
        # δ(0) = TV(N(μ,1), N(0,1)) = 2Φ(μ/2) − 1.
        for mu in (0.1, 1.0, 3.0):
            self.assertAlmostEqual(cf.gaussian_delta(0.0, mu), 2 * special.ndtr(mu / 2) - 1, places=14)

    def test_epsilon_inverts_delta(self):
        for mu, delta in ((1.0, 1e-5), (0.2, 1e-8), (8.0, 1e-6)):
            eps = cf.gaussian_epsilon(delta, mu)
            self.assertAlmostEqual(cf.gaussian_delta(eps, mu) / delta, 1.0, places=8)
        self.assertEqual(cf.gaussian_epsilon(0.9, 0.1), 0.0)

    def test_composition_is_root_t(self):
        self.assertEqual(cf.gaussian_mu(2.0, 16), 2.0)
        self.assertLess(cf.gaussian_composition_exact_epsilon(1.0, 4, 1e-5),
                        cf.gaussian_composition_rdp_epsilon(1.0, 4, 1e-5))


class RdpTest(parameterized.TestCase):
    @parameterized.parameters((0.01, 1.1), (0.1, 0.8), (0.05, 1.3127), (0.004, 2.0))
    def test_binomial_sum_and_quadrature_agree_at_integer_orders(self, q, sigma):
        orders = [a for a in cf.TFDP_INTEGER_ORDERS if a <= 63]
        binomial = cf.poisson_gaussian_rdp(q, sigma, orders)
        quadrature = cf.poisson_gaussian_rdp(q, sigma, orders, integer_by_quadrature=True)
        np.testing.assert_allclose(quadrature, binomial, rtol=1e-7)

    def test_q_one_is_the_gaussian(self):
        np.testing.assert_allclose(cf.poisson_gaussian_rdp(1.0, 1.5, (2, 2.5, 10)),
                                   cf.gaussian_rdp(1.5, (2, 2.5, 10)))
        # And the binomial sum with q -> 1 tends to it.
        np.testing.assert_allclose(cf.poisson_gaussian_rdp(1 - 1e-12, 1.5, (2, 7)),
                                   cf.gaussian_rdp(1.5, (2, 7)), rtol=1e-9)

    def test_rdp_is_increasing_in_the_order(self):
        rdp = cf.poisson_gaussian_rdp(0.01, 1.1)
        self.assertTrue(np.all(np.diff(rdp) > 0))

    def test_improved_conversion_is_below_the_classic_one(self):
        orders = cf.TFDP_RDP_ORDERS
        rdp = 100 * cf.poisson_gaussian_rdp(0.01, 1.1, orders)
        improved = cf.rdp_to_epsilon(orders, rdp, 1e-5)
        classic = cf.rdp_to_epsilon_classic(orders, rdp, 1e-5)
        self.assertLess(improved, classic)
        # Each order's improved bound is the classic one less
        # log(a) / (a - 1) - log((a - 1) / a), by hand at a = 2: log 2 + log 2.
        self.assertAlmostEqual(
            cf.rdp_to_epsilon([2.0], [1.0], 1e-5),
            cf.rdp_to_epsilon_classic([2.0], [1.0], 1e-5) - 2 * math.log(2), places=12)


class NumpyPldTest(parameterized.TestCase):
    @parameterized.parameters((0.05, 0.9, 2.0), (0.01, 1.1, 0.5), (0.3, 2.0, 0.1))
    def test_one_step_matches_the_closed_form(self, q, sigma, epsilon):
        # One step, remove: L(z) = log((1 − q) + q e^{(2z − 1)/(2σ²)}) is
        # increasing, so δ = P(z > z*) − e^ε Q(z > z*) with L(z*) = ε; add:
        # δ = Q(z < z') − e^ε P(z < z') with L(z') = −ε.
        def cut(level):
            return sigma**2 * (math.log(math.expm1(level) + q) - math.log(q)) + 0.5

        z = cut(epsilon)
        remove = ((1 - q) * special.ndtr(-z / sigma) + q * special.ndtr(-(z - 1) / sigma)
                  - math.exp(epsilon) * special.ndtr(-z / sigma))
        add = 0.0  # L >= log(1 - q), so the add loss −L never exceeds −log(1 − q).
        if -epsilon > math.log1p(-q):
            z = cut(-epsilon)
            add = special.ndtr(z / sigma) - math.exp(epsilon) * (
                (1 - q) * special.ndtr(z / sigma) + q * special.ndtr((z - 1) / sigma))
        exact = max(remove, add)
        upper = cf.poisson_gaussian_delta(epsilon, sigma, 1, q, grid=1e-5, pessimistic=True)
        lower = cf.poisson_gaussian_delta(epsilon, sigma, 1, q, grid=1e-5, pessimistic=False)
        self.assertBetween(exact, lower, upper)
        self.assertLess(upper - lower, 1e-3 * exact)

    def test_bracket_width_is_steps_times_grid(self):
        lower = cf.poisson_gaussian_epsilon(1e-5, 2.0, 20, 0.01, pessimistic=False)
        upper = cf.poisson_gaussian_epsilon(1e-5, 2.0, 20, 0.01, pessimistic=True)
        self.assertBetween(upper - lower, 0.0, 20 * 1e-4 * 1.01)
        # And the tight figure is below the RDP bound.
        self.assertLess(upper, cf.poisson_rdp_epsilon(2.0, 20, 0.01, 1e-5))


if __name__ == "__main__":
    absltest.main()
