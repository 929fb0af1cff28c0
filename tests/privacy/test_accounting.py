"""Tests for tfdp.privacy.accounting (no TensorFlow).

Figures are checked against `tests.privacy.closed_forms`, derived without
dp_accounting (closed forms for Gaussians, binomial sums and quadrature for
the Poisson-subsampled Gaussian, a numpy PLD), and against published tables;
where a test also compares with a direct dp_accounting call, that checks
tfdp's use of it (its cached RDP vector, its events), not the figure.
"""

import math
import subprocess
import sys
import warnings

import dp_accounting
from absl.testing import absltest
from absl.testing import parameterized
from dp_accounting import pld as dp_pld
from dp_accounting import rdp as dp_rdp

from tests.privacy import closed_forms as cf
from tfdp import privacy
from tfdp.privacy import accounting

NR = dp_accounting.NeighboringRelation

# The paper's best ImageNet run (Kurakin et al. 2022, "Toward training at
# ImageNet scale with differential privacy"; /work/shared/REFERENCE.md): N is
# ImageNet's training set, batch 64 x 1024, 70 epochs, delta = 1e-6, and
# sigma = 0.058014 * sqrt(8 * 64) = 1.31271 on the logical batch (their code
# noised each of 8 devices and 64 accumulation steps), rounded to 1.3127.
PAPER_N = 1_281_167
PAPER_B = 65_536
PAPER_EPOCHS = 70
PAPER_SIGMA = 1.3127
PAPER_DELTA = 1e-6
# The paper's published epsilon for that run ("epsilon = 10, delta = 10^-6",
# its abstract): the noise was chosen to reach it.
PAPER_EPSILON = 10.0


def _direct_rdp_poisson(sigma, steps, q, delta):
    acc = dp_rdp.RdpAccountant()
    acc.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                q, dp_accounting.GaussianDpEvent(sigma)
            ),
            steps,
        )
    )
    return acc.get_epsilon(delta)


def _direct_pld_poisson(sigma, steps, q, delta):
    acc = dp_pld.PLDAccountant()
    acc.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                q, dp_accounting.GaussianDpEvent(sigma)
            ),
            steps,
        )
    )
    return acc.get_epsilon(delta)


def _passes(steps, n, b):
    # Shuffle: a pass is N // B steps; a partial pass counts as a whole one.
    steps_per_pass = n // b
    return -(-steps // steps_per_pass)


def _shuffle_event(sigma, passes):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(sigma), passes
    )


def _direct_rdp_shuffle(sigma, steps, n, b, delta):
    # One Gaussian mechanism (sensitivity C, noise sigma * C) per pass,
    # add/remove-one adjacency (the removed example's slot left empty).
    acc = dp_rdp.RdpAccountant(neighboring_relation=NR.ADD_OR_REMOVE_ONE)
    acc.compose(_shuffle_event(sigma, _passes(steps, n, b)))
    return acc.get_epsilon(delta)


class EpsilonMatchesDpAccountingTest(parameterized.TestCase, cf.ClosedFormAssertions):
    def test_rdp_orders_are_the_documented_ones(self):
        # docs/PRIVACY.md names the orders; the closed forms use them.
        self.assertEqual(tuple(accounting.RDP_ORDERS), cf.TFDP_RDP_ORDERS)

    @parameterized.parameters(
        (1.1, 1000, 0.01, 1e-5),
        (0.8, 50, 0.1, 1e-6),
        (2.0, 10_000, 0.004, 1e-8),
        (1.0, 3, 1.0, 1e-5),
    )
    def test_rdp_poisson(self, sigma, steps, q, delta):
        got = privacy.epsilon(sigma, steps, delta, sampling_rate=q)
        self.assertIsInstance(got, float)
        # The RDP of the subsampled Gaussian by binomial sums and quadrature
        # (Mironov, Talwar and Zhang 2019), composed and converted in numpy.
        self.assertPoissonRdp(got, sigma, steps, q, delta)
        if q == 1.0:
            # No subsampling: exactly the Gaussian's RDP, steps * a / (2 sigma^2).
            self.assertGaussianRdp(got, sigma, steps, delta)
        # tfdp's cached one-step RDP vector times the steps is what
        # dp_accounting composes itself (docs/PRIVACY.md: "identical").
        self.assertEqual(got, _direct_rdp_poisson(sigma, steps, q, delta))

    @parameterized.parameters(
        # sigma, steps, q, delta, whether to run the numpy PLD. It takes
        # about a second at 20 steps; at 100 steps it would take several and
        # its bracket would be 2% wide, so that case is only held below the
        # exact RDP bound (which catches gross errors, not a 1% one).
        (1.1, 100, 0.01, 1e-5, False),
        (0.9, 20, 0.05, 1e-6, True),
        (1.1, 20, 0.01, 1e-5, True),
    )
    def test_pld_poisson(self, sigma, steps, q, delta, numpy_pld):
        got = privacy.epsilon(
            sigma, steps, delta, sampling_rate=q, accountant="pld"
        )
        # PLD is tight: below the exact RDP figure, a valid bound too.
        self.assertLess(got, cf.poisson_rdp_epsilon(sigma, steps, q, delta))
        if numpy_pld:
            # The exact epsilon lies between the numpy PLD with every loss
            # rounded down and with every loss rounded up (grid 1e-4, so
            # steps * 1e-4 apart); tfdp's PLD (grid 1e-4, pessimistic) must
            # fall in that bracket.
            lower = cf.poisson_gaussian_epsilon(delta, sigma, steps, q, pessimistic=False)
            upper = cf.poisson_gaussian_epsilon(delta, sigma, steps, q, pessimistic=True)
            self.assertBetween(got, lower, upper)
        self.assertAlmostEqual(
            got, _direct_pld_poisson(sigma, steps, q, delta), places=9
        )

    def test_pld_poisson_without_subsampling_is_the_exact_gaussian(self):
        # q = 1: every step is the Gaussian mechanism, and 3 of them are the
        # mu = sqrt(3) / sigma Gaussian, whose epsilon is known exactly.
        got = privacy.epsilon(1.0, 3, 1e-5, sampling_rate=1.0, accountant="pld")
        self.assertGaussianPld(got, 1.0, 3, 1e-5)

    @parameterized.parameters(
        # sigma, steps, N, B, delta, passes (written out, not computed).
        (1.5, 200, 10_000, 100, 1e-5, 2),
        (3.0, 40, 1000, 50, 1e-6, 2),
        (2.0, 5, 60, 60, 1e-3, 5),
        (1.5, 201, 10_000, 100, 1e-5, 3),
        (1.2, 7, 1000, 300, 1e-5, 3),  # N // B = 3 steps per pass.
    )
    def test_rdp_shuffle(self, sigma, steps, n, b, delta, passes):
        self.assertEqual(_passes(steps, n, b), passes)
        self.assertEqual(cf.shuffle_passes(steps, n, b), passes)
        got = privacy.epsilon(
            sigma,
            steps,
            delta,
            dataset_size=n,
            batch_size=b,
            sampler="shuffle",
        )
        # passes * a / (2 sigma^2), converted in numpy.
        self.assertGaussianRdp(got, sigma, passes, delta)
        self.assertEqual(got, _direct_rdp_shuffle(sigma, steps, n, b, delta))
        acc = dp_rdp.RdpAccountant(neighboring_relation=NR.ADD_OR_REMOVE_ONE)
        acc.compose(dp_accounting.GaussianDpEvent(sigma), count=passes)
        self.assertEqual(got, acc.get_epsilon(delta))

    @parameterized.parameters(
        (1.5, 200, 10_000, 100, 1e-5),
        (3.0, 40, 1000, 50, 1e-6),
        (2.0, 5, 60, 60, 1e-3),
    )
    def test_pld_shuffle(self, sigma, steps, n, b, delta):
        got = privacy.epsilon(
            sigma,
            steps,
            delta,
            dataset_size=n,
            batch_size=b,
            accountant="pld",
            sampler="shuffle",
        )
        # The exact epsilon of the mu = sqrt(passes) / sigma Gaussian.
        self.assertGaussianPld(got, sigma, cf.shuffle_passes(steps, n, b), delta)
        # PLD is the tighter accountant: never more than a hair above RDP.
        rdp = cf.gaussian_composition_rdp_epsilon(sigma, cf.shuffle_passes(steps, n, b), delta)
        self.assertLessEqual(got, rdp * (1 + 1e-3))

    def test_dataset_and_batch_size_equal_sampling_rate(self):
        a = privacy.epsilon(1.2, 500, 1e-6, sampling_rate=256 / 60_000)
        b = privacy.epsilon(1.2, 500, 1e-6, dataset_size=60_000, batch_size=256)
        self.assertEqual(a, b)

    def test_consistent_sampling_rate_and_sizes_accepted(self):
        got = privacy.epsilon(
            1.2,
            500,
            1e-6,
            sampling_rate=256 / 60_000,
            dataset_size=60_000,
            batch_size=256,
        )
        self.assertEqual(
            got, privacy.epsilon(1.2, 500, 1e-6, sampling_rate=256 / 60_000)
        )

    def test_make_dp_event(self):
        # Shuffle: one Gaussian(sigma) per pass of N // B = 10 steps.
        for steps, passes in ((7, 1), (10, 1), (11, 2), (21, 3)):
            event = privacy.make_dp_event(
                2.0, steps, dataset_size=100, batch_size=10, sampler="shuffle"
            )
            self.assertEqual(
                event,
                dp_accounting.SelfComposedDpEvent(
                    dp_accounting.GaussianDpEvent(2.0), passes
                ),
            )
        # Rate only: N and B are the integer ratio of q; 0.25 is exact, so a
        # pass is 4 steps.
        event = privacy.make_dp_event(
            2.0, 9, sampling_rate=0.25, sampler="shuffle"
        )
        self.assertEqual(
            event,
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.GaussianDpEvent(2.0), 3
            ),
        )
        event = privacy.make_dp_event(2.0, 7, sampling_rate=0.1)
        self.assertEqual(
            event,
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(
                    0.1, dp_accounting.GaussianDpEvent(2.0)
                ),
                7,
            ),
        )


class EdgeCasesTest(parameterized.TestCase, cf.ClosedFormAssertions):
    @parameterized.parameters(
        ("rdp", "poisson"), ("pld", "poisson"), ("rdp", "shuffle"),
        ("pld", "shuffle"),
    )
    def test_zero_steps_is_zero(self, accountant, sampler):
        for sigma in (0.0, 1.0):
            self.assertEqual(
                privacy.epsilon(
                    sigma,
                    0,
                    1e-5,
                    dataset_size=1000,
                    batch_size=10,
                    accountant=accountant,
                    sampler=sampler,
                ),
                0.0,
            )

    @parameterized.parameters(
        ("rdp", "poisson"), ("pld", "poisson"), ("rdp", "shuffle"),
        ("pld", "shuffle"),
    )
    def test_zero_noise_is_inf(self, accountant, sampler):
        self.assertEqual(
            privacy.epsilon(
                0.0,
                10,
                1e-5,
                dataset_size=1000,
                batch_size=10,
                accountant=accountant,
                sampler=sampler,
            ),
            math.inf,
        )

    def test_pld_shuffle_works(self):
        # PLD accounts shuffle now (one Gaussian per pass): no refusal, and
        # the result is the direct PLD figure, at most RDP's.
        kw = dict(dataset_size=1000, batch_size=10, sampler="shuffle")
        pld = privacy.epsilon(1.0, 10, 1e-5, accountant="pld", **kw)
        rdp = privacy.epsilon(1.0, 10, 1e-5, accountant="rdp", **kw)
        self.assertTrue(math.isfinite(pld))
        self.assertGreater(pld, 0.0)
        # 10 steps of the 100 in a pass: one Gaussian mechanism.
        self.assertGaussianPld(pld, 1.0, 1, 1e-5)
        self.assertGaussianRdp(rdp, 1.0, 1, 1e-5)
        self.assertLessEqual(pld, rdp * (1 + 1e-3))

    @parameterized.parameters((60_000, 256), (1_281_167, 65_536), (10, 10))
    def test_shuffle_rate_only_matches_sizes(self, n, b):
        # With only q, N and B are the integer ratio of q, and the shuffle
        # event sees them through N // B only (steps per pass): here
        # floor(1 / q) == N // B, so the two agree.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            by_sizes = privacy.epsilon(
                2.0, 50, 1e-6, dataset_size=n, batch_size=b, sampler="shuffle"
            )
        by_rate = privacy.epsilon(
            2.0, 50, 1e-6, sampling_rate=b / n, sampler="shuffle"
        )
        self.assertEqual(by_rate, by_sizes)
        self.assertGaussianRdp(by_rate, 2.0, cf.shuffle_passes(50, n, b), 1e-6)

    @parameterized.parameters(0.1, 0.01, 0.3, 0.25, 1 / 3)
    def test_shuffle_rate_only_never_below_floor_one_over_q(self, q):
        # A pass from a rate alone is floor(1 / q) steps of the exact ratio
        # of the float q; where the float is above the decimal (0.1, 0.01)
        # that is one step shorter, which only adds passes (conservative).
        steps_per_pass = int(1 / q + 1e-9)  # the decimal's floor(1 / q)
        for steps in (1, steps_per_pass, steps_per_pass + 1, 5 * steps_per_pass):
            got = privacy.epsilon(
                2.0, steps, 1e-6, sampling_rate=q, sampler="shuffle"
            )
            decimal = cf.gaussian_composition_rdp_epsilon(
                2.0, cf.shuffle_passes(steps, steps_per_pass, 1), 1e-6
            )
            self.assertGreaterEqual(got, decimal * (1 - cf.RDP_GAUSSIAN_RTOL))


class MonotonicityTest(parameterized.TestCase):
    @parameterized.parameters(("rdp", "poisson"),)
    def test_more_steps_more_epsilon(self, accountant, sampler):
        kw = dict(
            dataset_size=50_000,
            batch_size=500,
            accountant=accountant,
            sampler=sampler,
        )
        eps = [privacy.epsilon(1.5, t, 1e-5, **kw) for t in (1, 10, 100, 1000)]
        self.assertEqual(eps, sorted(eps))
        self.assertLess(eps[0], eps[-1])
        self.assertEqual(len(set(eps)), len(eps))

    @parameterized.parameters("rdp", "pld")
    def test_shuffle_epsilon_is_a_step_function_of_steps(self, accountant):
        # N // B = 100 steps per pass: epsilon is constant within a pass,
        # non-decreasing in steps, and jumps at each pass boundary.
        kw = dict(
            dataset_size=50_000,
            batch_size=500,
            accountant=accountant,
            sampler="shuffle",
        )
        steps = (1, 10, 99, 100, 101, 150, 200, 201, 1000)
        eps = {t: privacy.epsilon(1.5, t, 1e-5, **kw) for t in steps}
        values = [eps[t] for t in steps]
        self.assertEqual(values, sorted(values))
        self.assertEqual(eps[1], eps[10])
        self.assertEqual(eps[1], eps[100])
        self.assertEqual(eps[101], eps[200])
        self.assertLess(eps[100], eps[101])
        self.assertLess(eps[200], eps[201])
        self.assertLess(eps[201], eps[1000])

    @parameterized.parameters(("rdp", "poisson"), ("rdp", "shuffle"))
    def test_larger_q_more_epsilon(self, accountant, sampler):
        eps = [
            privacy.epsilon(
                1.5,
                200,
                1e-5,
                dataset_size=50_000,
                batch_size=b,
                accountant=accountant,
                sampler=sampler,
            )
            for b in (100, 500, 2500, 12_500)
        ]
        self.assertEqual(len(set(eps)), len(eps))
        self.assertEqual(eps, sorted(eps))

    @parameterized.parameters(("rdp", "poisson"), ("rdp", "shuffle"))
    def test_larger_sigma_less_epsilon(self, accountant, sampler):
        eps = [
            privacy.epsilon(
                s,
                200,
                1e-5,
                dataset_size=50_000,
                batch_size=500,
                accountant=accountant,
                sampler=sampler,
            )
            for s in (0.7, 1.0, 1.5, 3.0, 8.0)
        ]
        self.assertEqual(len(set(eps)), len(eps))
        self.assertEqual(eps, sorted(eps, reverse=True))

    def test_pld_monotone_small(self):
        e = lambda s, t, q: privacy.epsilon(
            s, t, 1e-5, sampling_rate=q, accountant="pld"
        )
        base = e(2.0, 20, 0.01)
        self.assertLess(base, e(2.0, 40, 0.01))
        self.assertLess(base, e(2.0, 20, 0.05))
        self.assertGreater(base, e(3.0, 20, 0.01))

    def test_smaller_delta_more_epsilon(self):
        e = [
            privacy.epsilon(1.0, 100, d, sampling_rate=0.01)
            for d in (1e-5, 1e-6, 1e-7)
        ]
        self.assertEqual(e, sorted(e))


class ShuffleAccountingTest(parameterized.TestCase, cf.ClosedFormAssertions):
    @parameterized.parameters(
        (1.0, 100, 10_000, 100),
        (1.3127, 1369, PAPER_N, PAPER_B),
        (4.0, 1000, 60_000, 600),
    )
    def test_shuffle_larger_than_poisson(self, sigma, steps, n, b):
        kw = dict(dataset_size=n, batch_size=b)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            poisson = privacy.epsilon(sigma, steps, 1e-6, **kw)
            shuffle = privacy.epsilon(
                sigma, steps, 1e-6, sampler="shuffle", **kw
            )
        self.assertGreater(shuffle, poisson)

    def test_full_batch_is_one_gaussian_per_step(self):
        # With B = N every step is a pass: the plain Gaussian mechanism on
        # the clipped sum, sensitivity C under add/remove (slot left empty),
        # so sigma itself, not sigma / 2, once per step.
        sigma, steps, delta = 2.0, 5, 1e-5
        kw = dict(dataset_size=100, batch_size=100, sampler="shuffle")
        got = privacy.epsilon(sigma, steps, delta, **kw)
        # RDP: steps * a / (2 sigma^2); sigma / 2 would be 4 times that.
        self.assertGaussianRdp(got, sigma, steps, delta)
        self.assertEqual(accounting.adjacency("shuffle"), "zero_out")
        # The exact epsilon of the mu = sqrt(steps) / sigma Gaussian: an
        # honest RDP bound is not below it, and PLD agrees with it.
        tight = cf.gaussian_composition_exact_epsilon(sigma, steps, delta)
        self.assertGreaterEqual(got, tight)
        self.assertGaussianPld(
            privacy.epsilon(sigma, steps, delta, accountant="pld", **kw),
            sigma, steps, delta,
        )

    @parameterized.parameters(
        # N, B: steps per pass N // B.
        (60_000, 256),
        (PAPER_N, PAPER_B),
        (1000, 300),
    )
    def test_one_step_into_a_new_pass_costs_a_full_pass(self, n, b):
        steps_per_pass = n // b
        kw = dict(dataset_size=n, batch_size=b, sampler="shuffle")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for accountant, check in (
                ("rdp", self.assertGaussianRdp),
                ("pld", self.assertGaussianPld),
            ):
                two = privacy.epsilon(
                    1.5, 2 * steps_per_pass, 1e-6, accountant=accountant, **kw
                )
                two_and_one = privacy.epsilon(
                    1.5, 2 * steps_per_pass + 1, 1e-6, accountant=accountant,
                    **kw
                )
                three = privacy.epsilon(
                    1.5, 3 * steps_per_pass, 1e-6, accountant=accountant, **kw
                )
                self.assertLess(two, two_and_one)
                self.assertEqual(two_and_one, three)
                # Three whole Gaussian mechanisms, in closed form; two for
                # the two whole passes.
                check(two_and_one, 1.5, 3, 1e-6)
                check(two, 1.5, 2, 1e-6)

    @parameterized.parameters(
        # sigma, steps, N, B, delta: the paper's run, and the README default.
        (1.31271, 1369, PAPER_N, PAPER_B, 1e-6),
        (1.31271, 1330, PAPER_N, PAPER_B, 1e-6),
        (1.1616, 469, 4000, 256, 1e-5),
    )
    def test_shuffle_never_below_poisson(self, sigma, steps, n, b, delta):
        # Same (sigma, q, steps): the unamplified shuffle figure is never
        # below the amplified Poisson one, under either accountant.
        kw = dict(dataset_size=n, batch_size=b)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for accountant in ("rdp", "pld"):
                poisson = privacy.epsilon(
                    sigma, steps, delta, accountant=accountant, **kw
                )
                shuffle = privacy.epsilon(
                    sigma, steps, delta, accountant=accountant,
                    sampler="shuffle", **kw
                )
                self.assertGreaterEqual(shuffle, poisson, accountant)
        self.assertGaussianPld(shuffle, sigma, cf.shuffle_passes(steps, n, b), delta)


class PaperKnownValueTest(absltest.TestCase, cf.ClosedFormAssertions):
    def test_steps_from_epochs(self):
        self.assertEqual(
            privacy.steps_for_epochs(PAPER_EPOCHS, PAPER_N, PAPER_B), 1369
        )

    def test_paper_best_run_rdp_poisson_is_about_10(self):
        steps = privacy.steps_for_epochs(PAPER_EPOCHS, PAPER_N, PAPER_B)
        with self.assertWarnsRegex(UserWarning, "1/dataset_size"):
            eps = privacy.epsilon(
                PAPER_SIGMA,
                steps,
                PAPER_DELTA,
                dataset_size=PAPER_N,
                batch_size=PAPER_B,
            )
        print(f"\npaper run, RDP/Poisson: epsilon={eps:.4f} (steps={steps})")
        self.assertPoissonRdp(eps, PAPER_SIGMA, steps, PAPER_B / PAPER_N, PAPER_DELTA)
        # The published epsilon = 10: the paper's search stopped at (or just
        # under) 10 with its own RDP orders; sigma is rounded to 5 digits,
        # and a coarser grid of orders adds up to ~1% at this run (integer
        # orders alone: 10.08), so tfdp's figure is at most 10 and within 1%.
        self.assertBetween(eps, 0.99 * PAPER_EPSILON, PAPER_EPSILON)

    def test_paper_best_run_shuffle_and_pld(self):
        steps = privacy.steps_for_epochs(PAPER_EPOCHS, PAPER_N, PAPER_B)
        kw = dict(dataset_size=PAPER_N, batch_size=PAPER_B)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            shuffle = privacy.epsilon(
                PAPER_SIGMA, steps, PAPER_DELTA, sampler="shuffle", **kw
            )
            pld = privacy.epsilon(
                PAPER_SIGMA, steps, PAPER_DELTA, accountant="pld", **kw
            )
        print(f"\npaper run: RDP/shuffle={shuffle:.4f} PLD/Poisson={pld:.4f}")
        self.assertBetween(pld, 8.0, 10.0)
        # PLD is tight: below the exact RDP figure, itself a valid bound.
        self.assertLess(pld, cf.poisson_rdp_epsilon(
            PAPER_SIGMA, steps, PAPER_B / PAPER_N, PAPER_DELTA))
        self.assertGreater(shuffle, 12.0)
        # Shuffle: the 1369 steps of the Poisson schedule, at N // B = 19
        # steps per pass, are 73 passes of the Gaussian mechanism.
        self.assertEqual(cf.shuffle_passes(steps, PAPER_N, PAPER_B), 73)
        self.assertGaussianRdp(
            shuffle, PAPER_SIGMA, cf.shuffle_passes(steps, PAPER_N, PAPER_B), PAPER_DELTA
        )


class PaperFiguresTest(parameterized.TestCase, cf.ClosedFormAssertions):
    """The paper's run (70 epochs of ImageNet in batches of 65,536)."""

    @parameterized.parameters(1.3127, 1.31271)
    def test_shuffle_70_epochs_is_52_28(self, sigma):
        # A shuffle pass is N // B = 19 steps, so 70 epochs = 1330 steps
        # = 70 Gaussian mechanisms (TF-Privacy's once-per-epoch figure).
        steps = 70 * (PAPER_N // PAPER_B)
        self.assertEqual(steps, 1330)
        direct = dp_rdp.RdpAccountant(neighboring_relation=NR.ADD_OR_REMOVE_ONE)
        direct.compose(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.GaussianDpEvent(sigma), 70
            )
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            got = privacy.epsilon(
                sigma, steps, PAPER_DELTA, dataset_size=PAPER_N,
                batch_size=PAPER_B, sampler="shuffle",
            )
            one_more = privacy.epsilon(
                sigma, steps + 1, PAPER_DELTA, dataset_size=PAPER_N,
                batch_size=PAPER_B, sampler="shuffle",
            )
        self.assertEqual(got, direct.get_epsilon(PAPER_DELTA))
        # 70 * a / (2 sigma^2), converted in numpy; docs/PRIVACY.md prints
        # the figure (52.28) that this closed form rounds to.
        self.assertGaussianRdp(got, sigma, 70, PAPER_DELTA)
        self.assertEqual(round(cf.gaussian_composition_rdp_epsilon(sigma, 70, PAPER_DELTA), 2), 52.28)
        # The old tfdp shuffle accountant (without replacement, sigma / 2,
        # replace-one, per step) said 83.5 for this run: the new figure is
        # not that one.
        self.assertLess(got, 83.0)
        # Step 1331 opens a 71st pass.
        self.assertGreater(one_more, got)

    @parameterized.parameters(1.3127, 1.31271)
    def test_poisson_1369_steps_is_9_98(self, sigma):
        steps = privacy.steps_for_epochs(PAPER_EPOCHS, PAPER_N, PAPER_B)
        self.assertEqual(steps, 1369)
        q = PAPER_B / PAPER_N
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            got = privacy.epsilon(
                sigma, steps, PAPER_DELTA, dataset_size=PAPER_N,
                batch_size=PAPER_B,
            )
        self.assertEqual(got, _direct_rdp_poisson(sigma, steps, q, PAPER_DELTA))
        self.assertPoissonRdp(got, sigma, steps, q, PAPER_DELTA)
        # docs/PRIVACY.md prints tfdp's figure, 9.98. (The exact RDP at
        # tfdp's orders gives 9.974: dp_accounting's fractional orders are
        # conservative, see closed_forms.RDP_FRACTIONAL_SLACK.)
        self.assertEqual(round(got, 2), 9.98)


class PublishedTableTest(parameterized.TestCase, cf.ClosedFormAssertions):
    """TF-Privacy's published MNIST figures, reproduced, and tfdp's beside them.

    tensorflow/privacy tutorials/README.md ("Select Parameters" table and
    "Expected Output"): MNIST (N = 60,000), batch 256, delta = 1e-5, printed
    by mnist_dpsgd_tutorial.py's `compute_epsilon`: RDP orders 1.1 ... 10.9
    (step 0.1) and 12 ... 63, epochs * (60000 // 256) steps of the Poisson-
    subsampled Gaussian, and TF-Privacy's 2019 `get_privacy_spent`, the
    classic conversion min_a RDP(a) - log(delta) / (a - 1). The 2.92 row is
    the README's earlier default (sigma = 1.12). Printed to 2 decimals.
    """

    N, B, DELTA = 60_000, 256, 1e-5
    ORDERS = tuple([1 + x / 10 for x in range(1, 100)] + list(range(12, 64)))

    @parameterized.parameters(
        # sigma, epochs, published epsilon.
        (1.1, 60, 3.01),
        (1.3, 15, 1.19),
        (0.7, 45, 7.10),
        (1.12, 60, 2.92),
    )
    def test_tf_privacy_mnist_table(self, sigma, epochs, published):
        q = self.B / self.N
        steps = epochs * (self.N // self.B)
        # The closed forms, with TF-Privacy's orders and conversion, give
        # the published figure to its 2 decimals: they compute what
        # TF-Privacy computed.
        theirs = cf.poisson_rdp_epsilon(
            sigma, steps, q, self.DELTA, orders=self.ORDERS,
            conversion=cf.rdp_to_epsilon_classic,
        )
        self.assertEqual(round(theirs, 2), published)
        # tfdp, for the same run: the improved conversion and more orders
        # can only lower the figure, and the exact RDP at tfdp's orders is
        # what it must match.
        got = privacy.epsilon(sigma, steps, self.DELTA, dataset_size=self.N, batch_size=self.B)
        self.assertLess(got, published)
        self.assertPoissonRdp(got, sigma, steps, q, self.DELTA)


class StepsForEpochsTest(parameterized.TestCase):
    @parameterized.parameters(
        (1, 100, 10, 10),
        (3, 10, 5, 6),
        (1, 101, 10, 11),
        (0.5, 100, 10, 5),
        (0.1, 30, 1, 3),  # 0.1 * 30 is 3.0000000000000004 in floats.
        (2.5, 7, 2, 9),
    )
    def test_values(self, epochs, n, b, expected):
        self.assertEqual(privacy.steps_for_epochs(epochs, n, b), expected)

    @parameterized.parameters((0, 10, 1), (-1, 10, 1), (1, 10, 11), (1, 0, 1))
    def test_invalid(self, epochs, n, b):
        with self.assertRaises(ValueError):
            privacy.steps_for_epochs(epochs, n, b)


class ValidationTest(parameterized.TestCase):
    @parameterized.named_parameters(
        ("negative_sigma", dict(noise_multiplier=-0.1), "noise_multiplier"),
        ("nan_sigma", dict(noise_multiplier=float("nan")), "noise_multiplier"),
        ("q_zero", dict(sampling_rate=0.0), "sampling_rate"),
        ("q_above_one", dict(sampling_rate=1.5), "sampling_rate"),
        ("delta_zero", dict(delta=0.0), "delta"),
        ("delta_one", dict(delta=1.0), "delta"),
        ("negative_steps", dict(steps=-1), "steps"),
        ("float_steps", dict(steps=1.5), "steps"),
        ("unknown_accountant", dict(accountant="gdp"), "accountant"),
        ("unknown_sampler", dict(sampler="uniform"), "sampler"),
    )
    def test_errors(self, override, name):
        kwargs = dict(
            noise_multiplier=1.0,
            steps=10,
            delta=1e-5,
            sampling_rate=0.01,
            accountant="rdp",
            sampler="poisson",
        )
        kwargs.update(override)
        with self.assertRaisesRegex(ValueError, f"Received: {name}=") as cm:
            privacy.epsilon(
                kwargs.pop("noise_multiplier"),
                kwargs.pop("steps"),
                kwargs.pop("delta"),
                **kwargs,
            )
        self.assertNotIn("\n", str(cm.exception))

    @parameterized.named_parameters(
        ("batch_above_n", dict(dataset_size=10, batch_size=11)),
        ("batch_without_n", dict(batch_size=11)),
        ("zero_n", dict(dataset_size=0, batch_size=1)),
        ("nothing", dict()),
        ("only_n", dict(dataset_size=10)),
        (
            "inconsistent",
            dict(sampling_rate=0.5, dataset_size=10, batch_size=1),
        ),
    )
    def test_batch_description_errors(self, kwargs):
        with self.assertRaisesRegex(ValueError, "Received: "):
            privacy.epsilon(1.0, 10, 1e-5, **kwargs)

    def test_warns_when_delta_not_below_one_over_n(self):
        with self.assertWarnsRegex(UserWarning, "1/dataset_size"):
            privacy.epsilon(1.0, 10, 1e-3, dataset_size=1000, batch_size=10)

    def test_no_warning_when_delta_small(self):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            privacy.epsilon(1.0, 10, 1e-5, dataset_size=1000, batch_size=10)
            privacy.epsilon(1.0, 10, 1e-3, sampling_rate=0.01)


class EpsilonTableTest(absltest.TestCase, cf.ClosedFormAssertions):
    def test_rows(self):
        rows = privacy.epsilon_table(
            1.5, 300, sampling_rate=0.01, accountant="both"
        )
        direct = dp_pld.PLDAccountant()
        direct.compose(privacy.make_dp_event(1.5, 300, sampling_rate=0.01))
        self.assertEqual(
            [r["delta"] for r in rows], list(privacy.DEFAULT_DELTAS)
        )
        for r in rows:
            self.assertPoissonRdp(r["epsilon_rdp"], 1.5, 300, 0.01, r["delta"])
            self.assertEqual(
                r["epsilon_rdp"],
                _direct_rdp_poisson(1.5, 300, 0.01, r["delta"]),
            )
            self.assertLess(r["epsilon_pld"], r["epsilon_rdp"])
            self.assertAlmostEqual(
                r["epsilon_pld"], direct.get_epsilon(r["delta"]), places=9
            )
            self.assertEqual(r["steps"], 300)
            self.assertEqual(r["sampler"], "poisson")
        eps = [r["epsilon_rdp"] for r in rows]
        self.assertEqual(eps, sorted(eps))
        text = privacy.format_epsilon_table(rows)
        self.assertIn("epsilon_rdp", text)
        self.assertIn("epsilon_pld", text)
        self.assertIn("1e-08", text)
        self.assertLen(text.splitlines(), 2 + len(rows))

    def test_inf_formatting(self):
        rows = privacy.epsilon_table(0.0, 3, (1e-5,), sampling_rate=0.5)
        self.assertIn("inf", privacy.format_epsilon_table(rows))

    def test_pld_shuffle_table(self):
        # Both accountants account shuffle: N // B = 10 steps per pass, so
        # 13 steps are 2 passes.
        rows = privacy.epsilon_table(
            1.0,
            13,
            dataset_size=100,
            batch_size=10,
            accountant="both",
            sampler="shuffle",
        )
        self.assertLen(rows, len(privacy.DEFAULT_DELTAS))
        for r in rows:
            self.assertEqual(r["sampler"], "shuffle")
            self.assertGaussianRdp(r["epsilon_rdp"], 1.0, 2, r["delta"])
            self.assertGaussianPld(r["epsilon_pld"], 1.0, 2, r["delta"])
            self.assertLessEqual(r["epsilon_pld"], r["epsilon_rdp"] * (1 + 1e-3))


class NoTensorFlowTest(absltest.TestCase):
    def test_import_does_not_load_tensorflow(self):
        code = (
            "import sys, tfdp.privacy; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported'; "
            "assert 'keras' not in sys.modules, 'keras imported'"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


if __name__ == "__main__":
    absltest.main()
