"""Unit tests of the one-run audit statistics (no training)."""

import math

import numpy as np
import tensorflow as tf

from tfdp import audit


def _closed_form_all_correct(r, beta):
    # delta = 0, v = r: P[Binomial(r, p) >= r] = p^r = beta.
    p = beta ** (1.0 / r)
    return math.log(p / (1.0 - p))


class PValueTest(tf.test.TestCase):

    def test_pure_dp_is_the_binomial_tail(self):
        # Theorem 3.1: P[Binomial(r, e^eps / (1 + e^eps)) >= v].
        from scipy import stats

        for r, v, eps in ((100, 70, 0.5), (50, 50, 2.0), (10, 3, 0.0)):
            p = math.exp(eps) / (1 + math.exp(eps))
            self.assertAllClose(audit.p_value(1000, r, v, eps), stats.binom.sf(v - 1, r, p))

    def test_delta_only_adds(self):
        for eps in (0.0, 0.5, 2.0):
            self.assertGreaterEqual(
                audit.p_value(1000, 100, 80, eps, 1e-5), audit.p_value(1000, 100, 80, eps, 0.0)
            )

    def test_decreasing_in_v(self):
        ps = [audit.p_value(500, 100, v, 1.0, 1e-5) for v in range(50, 101, 10)]
        self.assertAllEqual(ps, sorted(ps, reverse=True))

    def test_zero_correct_is_certain(self):
        self.assertEqual(audit.p_value(10, 5, 0, 1.0, 1e-5), 1.0)

    def test_rejects_bad_counts(self):
        for m, r, v in ((10, 20, 5), (10, 5, 6), (10, 5, -1), (10, 5.5, 2)):
            with self.assertRaises(ValueError):
                audit.p_value(m, r, v, 1.0)
        with self.assertRaises(ValueError):
            audit.p_value(10, 5, 2, -1.0)
        with self.assertRaises(ValueError):
            audit.p_value(10, 5, 2, 1.0, delta=1.5)


class EpsilonLowerBoundTest(tf.test.TestCase):

    def test_all_correct_matches_closed_form(self):
        for r in (10, 100, 1000):
            self.assertAllClose(
                audit.epsilon_lower_bound(1000, r, r, 0.0, 0.05),
                _closed_form_all_correct(r, 0.05), atol=1e-6,
            )

    def test_all_correct_is_positive_and_grows_with_r(self):
        values = [audit.epsilon_lower_bound(1000, r, r, 1e-5, 0.05) for r in (10, 50, 100, 500, 1000)]
        self.assertGreater(values[0], 0.0)
        self.assertAllEqual(values, sorted(values))
        self.assertLen(set(values), len(values))

    def test_random_guessing_gives_zero(self):
        for r in (10, 100, 1000):
            self.assertEqual(audit.epsilon_lower_bound(1000, r, r // 2, 1e-5, 0.05), 0.0)
        self.assertEqual(audit.epsilon_lower_bound(100, 100, 0, 0.0, 0.05), 0.0)

    def test_delta_and_confidence_make_it_smaller(self):
        base = audit.epsilon_lower_bound(1000, 200, 190, 0.0, 0.05)
        self.assertLess(audit.epsilon_lower_bound(1000, 200, 190, 1e-4, 0.05), base)
        self.assertLess(audit.epsilon_lower_bound(1000, 200, 190, 0.0, 0.01), base)

    def test_the_papers_worked_examples(self):
        # arXiv:2305.08846, Appendix D (m=1000, r=100, v=75, delta=1e-4) and
        # the Section 7 CIFAR-10 example (m=1e5, r=1510, v=1439, delta=1e-5),
        # both at 95% confidence: eps >= 0.67 and eps >= 2.67.
        self.assertAllClose(audit.epsilon_lower_bound(1000, 100, 75, 1e-4, 0.05), 0.673, atol=1e-3)
        self.assertAllClose(
            audit.epsilon_lower_bound(100000, 1510, 1439, 1e-5, 0.05), 2.676, atol=1e-3
        )

    def test_it_is_a_valid_lower_bound_for_randomized_response(self):
        # eps0-DP randomised response on every canary: each of r guesses is
        # correct w.p. e^eps0 / (1 + e^eps0). Summing the exact Binomial pmf
        # over the v whose bound exceeds eps0 gives the false-positive rate,
        # which must be at most beta.
        from scipy import stats

        eps0, r, beta = 1.0, 200, 0.1
        p = 1 / (1 + math.exp(-eps0))
        lower = np.array([audit.epsilon_lower_bound(r, r, v, 0.0, beta) for v in range(r + 1)])
        self.assertAllEqual(lower, np.sort(lower))
        rate = float(np.sum(stats.binom.pmf(np.arange(r + 1), r, p)[lower > eps0]))
        self.assertLessEqual(rate, beta)
        self.assertGreater(rate, 0.5 * beta)  # Tight: not a vacuous bound.
        # At the expected number of correct guesses the bound is informative.
        self.assertBetween(lower[int(round(p * r))], 0.3, eps0)


class GuessesTest(tf.test.TestCase):

    def test_top_and_bottom(self):
        scores = np.array([0.1, 0.9, 0.5, -1.0, 0.7])
        g = audit.make_guesses(scores, 2, 1)
        self.assertAllEqual(g, [0, 1, 0, -1, 1])
        self.assertEqual(audit.count_correct(g, [False, True, True, False, False]), (3, 2))

    def test_ties_do_not_depend_on_inclusion(self):
        g = audit.make_guesses(np.zeros(10), 3, 3, seed=1)
        self.assertEqual(int(np.sum(g == 1)), 3)
        self.assertEqual(int(np.sum(g == -1)), 3)
        self.assertAllEqual(g, audit.make_guesses(np.zeros(10), 3, 3, seed=1))

    def test_non_finite_scores(self):
        g = audit.make_guesses(np.array([np.nan, 1.0, -np.inf, 0.0]), 1, 2)
        self.assertAllEqual(g, [-1, 1, -1, 0])

    def test_bad_counts(self):
        with self.assertRaises(ValueError):
            audit.make_guesses(np.zeros(4), 3, 2)


class AuditEpsilonTest(tf.test.TestCase):

    def test_perfect_scores(self):
        rng = np.random.default_rng(0)
        included = rng.random(1000) < 0.5
        scores = included + 0.01 * rng.standard_normal(1000)
        result = audit.audit_epsilon(scores, included, delta=1e-5, beta=0.05)
        self.assertGreater(result.epsilon_lower, 4.0)
        self.assertEqual(result.v, result.r)
        self.assertLen(result.candidates, len(audit.default_guess_counts(1000)))

    def test_uninformative_scores(self):
        rng = np.random.default_rng(1)
        included = rng.random(1000) < 0.5
        result = audit.audit_epsilon(rng.standard_normal(1000), included, delta=1e-5)
        self.assertLess(result.epsilon_lower, 0.2)

    def test_single_count_equals_the_plain_bound(self):
        rng = np.random.default_rng(2)
        included = rng.random(300) < 0.5
        scores = included + rng.standard_normal(300)
        result = audit.audit_epsilon(scores, included, delta=1e-5, beta=0.05, guess_counts=[100])
        self.assertEqual(result.r, 100)
        self.assertEqual(result.num_positive + result.num_negative, 100)
        self.assertEqual(
            result.epsilon_lower, audit.epsilon_lower_bound(300, 100, result.v, 1e-5, 0.05)
        )

    def test_bonferroni(self):
        # Trying K counts costs a factor K in the level.
        rng = np.random.default_rng(3)
        included = rng.random(400) < 0.5
        scores = included + 0.5 * rng.standard_normal(400)
        result = audit.audit_epsilon(scores, included, beta=0.05, guess_counts=[100, 200])
        for c in result.candidates:
            self.assertEqual(c["epsilon_lower"],
                             audit.epsilon_lower_bound(400, c["r"], c["v"], 0.0, 0.025))

    def test_bad_inputs(self):
        with self.assertRaises(ValueError):
            audit.audit_epsilon(np.zeros(3), [True, False])
        with self.assertRaises(ValueError):
            audit.audit_epsilon(np.zeros(3), [True, False, True], guess_counts=[4])
        with self.assertRaises(ValueError):
            audit.audit_epsilon(np.zeros(3), [True, False, True], beta=0.0)


class CanariesTest(tf.test.TestCase):

    def test_deterministic_and_half_included(self):
        a = audit.make_canaries(100, (28, 28, 1), 10, seed=3)
        b = audit.make_canaries(100, (28, 28, 1), 10, seed=3)
        self.assertAllEqual(a[0], b[0])
        self.assertAllEqual(a[1], b[1])
        self.assertEqual(a[0].shape, (100, 28, 28, 1))
        self.assertEqual(a[0].dtype, np.float32)
        self.assertBetween(float(a[0].min()), 0.0, 1.0)
        self.assertBetween(int(a[1].max()), 0, 9)
        inc = audit.draw_inclusion(10000, seed=3)
        self.assertAllEqual(inc, audit.draw_inclusion(10000, seed=3))
        self.assertBetween(float(inc.mean()), 0.48, 0.52)
        self.assertNotAllEqual(inc, audit.draw_inclusion(10000, seed=4))


if __name__ == "__main__":
    tf.test.main()
