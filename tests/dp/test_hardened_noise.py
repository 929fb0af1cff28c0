"""Hardened noise (`hardened_noise=True`): its law, its key, its shares, its schemes,
its tail, and the floating-point attack it defeats where the float32 sampler falls."""

import math

import numpy as np
from scipy import stats
import tensorflow as tf

from tfdp import privacy
from tfdp.dp import noise as noise_lib
from tfdp.dp import noise_schemes
from tfdp.dp import noisy_aggregator
from tfdp.dp.noise_schemes import tree as tree_lib
from tfdp.privacy import banded_mf
from tfdp.privacy import tree_aggregation

KEY = [0x1D, 0x2E]  # A public noise key: these tests read the noise.


def _aggregator(stddev=1.0, divisor=1.0, hardened_noise=True, **options):
    return noisy_aggregator.NoisyAggregator(
        noise_stddev=stddev, expected_batch_size=divisor, noise_key=KEY,
        hardened_noise=hardened_noise, **options)


def _released(aggregator, sums, step, num_replicas=1, noise_state=None):
    accumulators = [tf.Variable(s) for s in sums]
    return [m.numpy() for m in aggregator.noisy_mean(
        accumulators, tf.constant(step, tf.int64), num_replicas=num_replicas,
        noise_state=noise_state)]


def _lowest_bit_exponents(values):
    """e such that 2^e is the lowest set bit of each nonzero float32 value."""
    mantissa, exponent = np.frexp(values.astype(np.float64))
    m = np.round(mantissa * 2.0**24).astype(np.int64)  # A float32 has 24 bits.
    return exponent - 24 + np.log2(m & -m).astype(np.int64)


def _near_zero_exponents(x, hardened_noise):
    """Lowest-bit exponents of the releases of the sum x within 2⁻⁸σ of zero (σ = 1)."""
    released = _released(_aggregator(hardened_noise=hardened_noise),
                         [tf.fill([2**20], x)], 3)[0]
    near = released[(np.abs(released) < 2.0**-8) & (released != 0)]
    return _lowest_bit_exponents(near)


class HardenedLawTest(tf.test.TestCase):

    def test_std_is_exactly_sigma_c_and_the_law_normal(self):
        stddev = 1.7
        noise = noise_lib.gaussian_noise([tf.zeros([1000, 1000])], stddev,
                                         noise_lib.step_seed(KEY, 5), hardened_noise=True)[0]
        self.assertEqual(noise.dtype, tf.float64)
        z = noise.numpy().ravel() / stddev
        self.assertLess(abs(np.std(z) - 1.0), 0.005)
        self.assertLess(abs(np.mean(z)), 5.0 / math.sqrt(z.size))
        self.assertGreater(stats.kstest(z, "norm").pvalue, 1e-4)
        # The same test rejects a std 1% off: it has power.
        self.assertLess(stats.kstest(z * 1.01, "norm").pvalue, 1e-4)
        self.assertLess(abs(stats.skew(z)), 0.02)
        self.assertLess(abs(stats.kurtosis(z)), 0.05)  # Excess kurtosis 0.
        # Released through the aggregator, in float32, the same std.
        released = _released(_aggregator(stddev), [tf.zeros([1000, 1000])], 5)[0]
        self.assertEqual(released.dtype, np.float32)
        self.assertLess(abs(np.std(released) / stddev - 1.0), 0.005)
        # Apart from the rounding to float32 and to the grid γ = 2⁻³⁶ near zero.
        self.assertAllClose(released.ravel(), noise.numpy().ravel(), rtol=1e-6, atol=2.0**-36)

    def test_xla_draws_the_same_law(self):
        sums = [tf.zeros([2**16])]
        seed = noise_lib.step_seed(KEY, 1)
        with_xla = tf.function(
            lambda: noise_lib.noisy_divided(sums, 1.0, seed, 1.0, hardened_noise=True)[0],
            jit_compile=True)().numpy()
        self.assertGreater(stats.kstest(with_xla, "norm").pvalue, 1e-4)
        self.assertLess(stats.kstest(with_xla * 1.05, "norm").pvalue, 1e-4)

    def test_same_key_same_noise_and_another_step_other_noise(self):
        sums = [tf.zeros([7, 5]), tf.zeros([300])]
        first = _released(_aggregator(), sums, 4)
        again = _released(_aggregator(), sums, 4)  # A resumed run's aggregator.
        for a, b in zip(first, again):
            self.assertAllEqual(a, b)
        self.assertNotAllClose(first[1], _released(_aggregator(), sums, 5)[1])
        # Not the float32 sampler's draw.
        self.assertNotAllClose(first[1], _released(_aggregator(hardened_noise=False), sums, 4)[1])

    def test_replicas_shares_add_up_to_one_draw(self):
        sums = [tf.zeros([1000])]
        whole = _released(_aggregator(1.5, divisor=4.0), sums, 2)[0]
        # σC/2 and its grid γ/2 are exact halves: each share is exactly half.
        half = _released(_aggregator(1.5, divisor=4.0), sums, 2, num_replicas=2)[0]
        self.assertAllEqual(2 * half, whole)
        third = _released(_aggregator(1.5, divisor=4.0), sums, 2, num_replicas=3)[0]
        self.assertAllClose(3 * third, whole, rtol=1e-6, atol=1e-6)

    def test_zero_noise_releases_the_mean(self):
        sums = [tf.constant([1.0, -3.0, 1e-30])]
        released = noise_lib.noisy_divided(sums, 0.0, noise_lib.step_seed(KEY, 0), 2.0,
                                           hardened_noise=True)[0]
        self.assertAllEqual(released, sums[0] / 2.0)

    def test_bad_flag_is_refused(self):
        with self.assertRaisesRegex(ValueError, "hardened_noise must be True or False"):
            _aggregator(hardened_noise="yes")


class HardenedTailTest(tf.test.TestCase):

    def test_no_draw_is_capped_below_eleven_of_its_stds(self):
        zero = tf.constant([0], tf.uint32)
        quarter_turn = tf.constant([2**30], tf.uint32)  # θ = π/2: sin θ = 1.
        z_sin, _ = noise_lib.hardened_box_muller(zero, zero, zero, quarter_turn, 1.0)
        self.assertAllClose(float(z_sin[0]), noise_lib.MAX_ABS_HARDENED_DRAW, rtol=1e-12)
        self.assertGreater(noise_lib.MAX_ABS_HARDENED_DRAW, 11.5)
        # Each of the k draws has std σ/√k: the sum reaches beyond 16σ.
        reach = noise_lib.MAX_ABS_HARDENED_DRAW * math.sqrt(noise_lib.HARDENED_DRAWS)
        self.assertGreater(reach, 16.0)
        # The tail mass the accountant adds is the sampler's, per pair of coordinates.
        self.assertAllClose(
            noise_lib.HARDENED_DRAWS * math.exp(-noise_lib.MAX_ABS_HARDENED_DRAW**2 / 2),
            privacy.deltas.HARDENED_NOISE_TAIL_MASS_PER_PAIR, rtol=1e-9)
        self.assertLess(privacy.noise_truncation_delta(1369, 11_687_720, hardened_noise=True),
                        1e-6 * 1e-9)

    def test_radius_is_exact_in_the_tail(self):
        # r² = −2 ln u1, u1 = (hi·2⁶⁴ + mid·2³² + lo + ½)·2⁻⁹⁶, to float64's precision.
        words = [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 7, 2**32 - 1), (1, 0, 5),
                 (2**20, 3, 4), (2**31, 0, 0), (2**32 - 1, 2**32 - 1, 2**32 - 1)]
        expected = [math.sqrt(-2.0 * (math.log(2 * (hi * 2**64 + mid * 2**32 + lo) + 1)
                                      - 97 * math.log(2.0)))
                    for hi, mid, lo in words]
        hi, mid, lo = (tf.constant(np.array(w, np.uint64).astype(np.uint32)) for w in zip(*words))
        zero_angle = tf.zeros([len(words)], tf.uint32)  # θ ≈ 0: cos θ = 1.
        _, z_cos = noise_lib.hardened_box_muller(hi, mid, lo, zero_angle, 1.0)
        # Near u1 = 1, ln x − 32 ln 2 cancels: r ≈ 0 within √(2·2⁻⁴⁸) ≈ 1.2e-7.
        self.assertAllClose(z_cos, expected, rtol=1e-12, atol=2e-7)


class HardenedSchemesTest(tf.test.TestCase):

    def test_banded_runs_its_recursion_on_the_hardened_draws(self):
        coefficients = tuple(banded_mf.square_root_coefficients(3))
        aggregator = _aggregator(0.5, coefficients=coefficients)
        self.assertTrue(aggregator.scheme.hardened_noise)
        size, steps = 50, 5
        state = [tf.Variable(tf.zeros(aggregator.noise_state_shape([size])))]
        got = [_released(aggregator, [tf.zeros([size])], t, noise_state=state)[0]
               for t in range(steps)]
        history = []  # The state's float32 w's.
        for t in range(steps):
            z = noise_lib.gaussian_noise([tf.zeros([size])], 0.5, noise_lib.step_seed(KEY, t),
                                         hardened_noise=True)[0].numpy()
            past = sum(coefficients[j] * history[t - j].astype(np.float64)
                       for j in range(1, 3) if t >= j)
            w = (z - past) / coefficients[0]
            history.append(w.astype(np.float32))
            self.assertAllClose(got[t], w, rtol=1e-6, atol=1e-12)

    def test_tree_releases_the_increments_of_hardened_nodes(self):
        restarts = tree_aggregation.TreeRestarts()
        aggregator = _aggregator(0.5, tree=restarts)
        self.assertTrue(aggregator.scheme.hardened_noise)
        like = [tf.zeros([40])]
        key = tf.constant(KEY, tf.int64)

        def node(level, end):
            seed = tree_lib.node_seed(key, 0, level, end)
            return noise_lib.gaussian_noise(like, 0.5, seed, hardened_noise=True)[0].numpy()

        # Step 0: the leaf's node; step 1: the node of [0, 2) minus leaf 0's.
        self.assertAllClose(_released(aggregator, like, 0)[0], node(1, 1), rtol=1e-6)
        self.assertAllClose(_released(aggregator, like, 1)[0], node(2, 2) - node(1, 1),
                            rtol=1e-6, atol=1e-6)

    def test_every_scheme_takes_the_option_and_a_scheme_object_keeps_its_own(self):
        for name, options in (("gaussian", {}), ("banded", {"coefficients": (0.8, 0.6)}),
                              ("tree", {"tree": tree_aggregation.TreeRestarts()})):
            scheme = noise_schemes.scheme_class(name).from_options(hardened_noise=True,
                                                                   **options)
            self.assertTrue(scheme.hardened_noise, name)
            self.assertIn("hardened_noise=True", repr(scheme))
        plain = noise_schemes.scheme_class("gaussian")()
        with self.assertRaisesRegex(ValueError, "carries its own options"):
            _aggregator(scheme=plain)
        self.assertFalse(_aggregator(scheme=plain, hardened_noise=False).hardened_noise)


class FloatingPointAttackTest(tf.test.TestCase):
    """Mironov's and Jin et al.'s test: does the set of float values a release can
    take depend on the sum? A coordinate's sum x is 0 or 1 (say, the gradient of a
    bias only one example reaches), σC = 1, B = 1. Where a release lands near zero,
    the float32 sampler's x + n is exact: with x = 1 it lies on x's grid of 2⁻²⁴,
    with x = 0 it is n itself, finer. "x = 1 iff on that grid" then reads x off
    every near-zero release. The hardened release puts both on the public grid."""

    def test_the_float32_sampler_reveals_the_sum_near_zero(self):
        with_one = _near_zero_exponents(1.0, hardened_noise=False)
        with_zero = _near_zero_exponents(0.0, hardened_noise=False)
        self.assertGreater(with_one.size, 1000)
        self.assertGreater(with_zero.size, 1000)
        self.assertTrue(np.all(with_one >= -24))  # Every one on x = 1's grid.
        self.assertLess(np.mean(with_zero >= -24), 0.02)  # Almost none with x = 0.

    def test_the_hardened_release_does_not(self):
        with_one = _near_zero_exponents(1.0, hardened_noise=True)
        with_zero = _near_zero_exponents(0.0, hardened_noise=True)
        self.assertGreater(with_one.size, 1000)
        self.assertGreater(with_zero.size, 1000)
        # The rule that read x off every near-zero release now says nothing.
        self.assertLess(np.mean(with_one >= -24), 0.02)
        self.assertLess(np.mean(with_zero >= -24), 0.02)
        # Nothing finer than the public grid γ = 2⁻³⁶ (σC = 1), whatever x.
        self.assertEqual(min(with_one.min(), with_zero.min()), -noise_lib.HARDENED_GRID_BITS)
        # And the lowest bits of the releases have one law for both sums.
        bins = np.arange(-36, -25)
        table = [np.bincount(np.clip(e, -36, -26) + 36, minlength=bins.size)
                 for e in (with_one, with_zero)]
        self.assertGreater(stats.chi2_contingency(table).pvalue, 1e-3)
        plain = [np.bincount(np.clip(_near_zero_exponents(x, False), -36, -26) + 36,
                             minlength=bins.size) for x in (1.0, 0.0)]
        self.assertLess(stats.chi2_contingency(plain).pvalue, 1e-50)

    def test_the_grid_is_a_power_of_two_read_from_the_std(self):
        for stddev, exponent in ((1.0, -36), (1.7, -36), (0.3, -38), (2.0**-20, -56)):
            self.assertEqual(float(noise_lib.hardened_grid(stddev)), 2.0**exponent)
        self.assertEqual(float(noise_lib.hardened_grid(0.0)), 0.0)


if __name__ == "__main__":
    tf.test.main()
