"""Tests for tfdp.privacy.calibration (no TensorFlow)."""

import dp_accounting
from absl.testing import absltest
from absl.testing import parameterized
from dp_accounting import rdp as dp_rdp
from scipy import optimize

from tests.privacy import closed_forms as cf
from tfdp import privacy


class CalibrateNoiseTest(parameterized.TestCase):
    @parameterized.parameters(
        (1.0, 1e-5, 1000, 0.01, "rdp", "poisson"),
        (8.0, 1e-6, 2000, 0.05, "rdp", "poisson"),
        (3.0, 1e-5, 100, 0.01, "rdp", "shuffle"),
        (0.5, 1e-5, 10, 0.02, "pld", "poisson"),
        (3.0, 1e-5, 250, 0.01, "pld", "shuffle"),
    )
    def test_round_trip(self, target, delta, steps, q, accountant, sampler):
        tolerance = 1e-3
        kw = dict(
            steps=steps,
            dataset_size=50_000,
            batch_size=int(q * 50_000),
            accountant=accountant,
            sampler=sampler,
        )
        sigma = privacy.calibrate_noise(
            target, delta, tolerance=tolerance, **kw
        )
        eps = lambda s: privacy.epsilon(
            s,
            steps,
            delta,
            dataset_size=kw["dataset_size"],
            batch_size=kw["batch_size"],
            accountant=accountant,
            sampler=sampler,
        )
        self.assertLessEqual(eps(sigma), target)
        # Smallest up to the relative tolerance.
        self.assertGreater(eps(sigma * (1 - tolerance)), target)
        self.assertGreater(eps(sigma), 0.9 * target)

    def test_agrees_with_dp_accounting_calibration(self):
        steps, q, delta, target = 500, 0.02, 1e-5, 2.0
        ours = privacy.calibrate_noise(
            target, delta, steps=steps, sampling_rate=q, tolerance=1e-4
        )

        def make_event(sigma):
            return dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(
                    q, dp_accounting.GaussianDpEvent(sigma)
                ),
                steps,
            )

        theirs = dp_accounting.calibrate_dp_mechanism(
            dp_rdp.RdpAccountant,
            make_event,
            target,
            delta,
            dp_accounting.LowerEndpointAndGuess(0.1, 1.0),
            tol=1e-6,
        )
        self.assertAlmostEqual(ours, theirs, delta=2e-4 * theirs)
        # The sigma at which the exact RDP (closed_forms) reaches the target:
        # tfdp's RDP is never below the exact one, so its sigma is not below
        # this, and above it by at most the tolerance and the fractional
        # orders' slack (closed_forms.RDP_FRACTIONAL_SLACK, in epsilon, which
        # moves sigma by less).
        exact = optimize.brentq(
            lambda s: cf.poisson_rdp_epsilon(s, steps, q, delta) - target,
            0.5, 5.0, xtol=1e-7,
        )
        self.assertBetween(ours, exact * (1 - 1e-6),
                           exact * (1 + 1e-4 + cf.RDP_FRACTIONAL_SLACK))

    @parameterized.parameters(
        # accountant, steps: 100 steps per pass (N = 50,000, B = 500).
        ("rdp", 100),
        ("pld", 250),
    )
    def test_shuffle_matches_closed_form(self, accountant, steps):
        # The smallest sigma whose passes Gaussian mechanisms reach epsilon
        # = 3 at delta = 1e-5: passes * a / (2 sigma^2) by RDP, the exact
        # mu = sqrt(passes) / sigma Gaussian for PLD. calibrate_noise lands
        # at most its tolerance above it, and never below it.
        tolerance, target, delta = 1e-3, 3.0, 1e-5
        passes = cf.shuffle_passes(steps, 50_000, 500)
        closed_form = (cf.gaussian_composition_rdp_epsilon if accountant == "rdp"
                       else cf.gaussian_composition_exact_epsilon)
        exact = optimize.brentq(
            lambda s: closed_form(s, passes, delta) - target, 0.1, 100.0, xtol=1e-10
        )
        got = privacy.calibrate_noise(
            target, delta, steps=steps, dataset_size=50_000, batch_size=500,
            accountant=accountant, sampler="shuffle", tolerance=tolerance,
        )
        self.assertBetween(got, exact * (1 - 1e-6), exact * (1 + tolerance))

    def test_shuffle_needs_more_noise_than_poisson(self):
        kw = dict(
            steps=200, dataset_size=50_000, batch_size=500, tolerance=1e-2
        )
        poisson = privacy.calibrate_noise(4.0, 1e-5, **kw)
        shuffle = privacy.calibrate_noise(4.0, 1e-5, sampler="shuffle", **kw)
        self.assertGreater(shuffle, poisson)

    def test_larger_target_less_noise(self):
        sigmas = [
            privacy.calibrate_noise(t, 1e-5, steps=1000, sampling_rate=0.01)
            for t in (0.5, 1.0, 4.0, 16.0)
        ]
        self.assertEqual(sigmas, sorted(sigmas, reverse=True))

    def test_zero_steps(self):
        self.assertEqual(
            privacy.calibrate_noise(1.0, 1e-5, steps=0, sampling_rate=0.1), 0.0
        )

    @parameterized.parameters(1e-4, 1e-3)
    def test_unreachable_target(self, target):
        with self.assertRaisesRegex(ValueError, "unreachable"):
            privacy.calibrate_noise(target, 1e-5, steps=100, sampling_rate=0.1)

    @parameterized.parameters(0.0, -1.0, float("nan"))
    def test_nonpositive_target(self, target):
        with self.assertRaisesRegex(ValueError, "target_epsilon"):
            privacy.calibrate_noise(target, 1e-5, steps=100, sampling_rate=0.1)

    @parameterized.parameters(0.0, 1.0, -0.1)
    def test_bad_tolerance(self, tolerance):
        with self.assertRaisesRegex(ValueError, "tolerance"):
            privacy.calibrate_noise(
                1.0, 1e-5, steps=100, sampling_rate=0.1, tolerance=tolerance
            )

    def test_bad_inputs(self):
        with self.assertRaisesRegex(ValueError, "delta"):
            privacy.calibrate_noise(1.0, 2.0, steps=100, sampling_rate=0.1)

    def test_pld_shuffle_calibrates_at_most_rdp(self):
        # PLD accounts shuffle (no refusal) and, being tighter, needs no
        # more noise than RDP (up to the tolerance).
        kw = dict(
            steps=250,
            dataset_size=50_000,
            batch_size=500,
            sampler="shuffle",
            tolerance=1e-3,
        )
        pld = privacy.calibrate_noise(3.0, 1e-5, accountant="pld", **kw)
        rdp = privacy.calibrate_noise(3.0, 1e-5, accountant="rdp", **kw)
        self.assertLessEqual(pld, rdp * (1 + 1e-3))
        self.assertLessEqual(
            privacy.epsilon(
                pld, 250, 1e-5, dataset_size=50_000, batch_size=500,
                accountant="pld", sampler="shuffle",
            ),
            3.0,
        )


class MaxStepsWithinTest(parameterized.TestCase):
    @parameterized.parameters(
        (1.0, 1.1, 0.01, "poisson"),
        (3.0, 0.9, 0.02, "poisson"),
        (3.0, 2.0, 0.01, "shuffle"),
    )
    def test_boundary(self, target, sigma, q, sampler):
        kw = dict(
            dataset_size=50_000, batch_size=int(q * 50_000), sampler=sampler
        )
        t = privacy.max_steps_within(target, sigma, 1e-5, **kw)
        self.assertGreater(t, 0)
        self.assertLessEqual(privacy.epsilon(sigma, t, 1e-5, **kw), target)
        self.assertGreater(privacy.epsilon(sigma, t + 1, 1e-5, **kw), target)

    def test_zero_noise_allows_no_step(self):
        self.assertEqual(
            privacy.max_steps_within(5.0, 0.0, 1e-5, sampling_rate=0.1), 0
        )

    def test_zero_budget(self):
        self.assertEqual(
            privacy.max_steps_within(0.0, 1.0, 1e-5, sampling_rate=0.1), 0
        )

    def test_negative_budget(self):
        with self.assertRaisesRegex(ValueError, "target_epsilon"):
            privacy.max_steps_within(-1.0, 1.0, 1e-5, sampling_rate=0.1)


if __name__ == "__main__":
    absltest.main()
