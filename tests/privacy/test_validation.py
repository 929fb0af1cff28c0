"""One rule per privacy quantity, the same on every route, and `PrivacyQuery`."""

import math
import warnings

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from tfdp import privacy
from tfdp import samplers
from tfdp import validation
from tfdp.mechanism import DPSGD

_BAD_CLIPS = (0, 0.0, -1.0, math.nan, math.inf, "1.0", None, True)
_BAD_SIGMAS = (-0.1, math.nan, math.inf, "1.0", None, False)
_BAD_DELTAS = (0, 0.0, 1, 1.0, -1e-5, math.nan, "1e-5", None)


def _message(fn, *args, **kwargs):
    """The message of the ValueError that `fn(*args, **kwargs)` raises."""
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{fn.__name__} accepted {args} {kwargs}")


def _ledger(**kwargs):
    config = dict(noise_multiplier=1.0, sampling_rate=0.01, delta=1e-5)
    config.update(kwargs)
    return privacy.PrivacyLedger(config.pop("noise_multiplier"), config.pop("sampling_rate"),
                                 **config)


class OneRulePerQuantityTest(parameterized.TestCase):

    def test_clip_bound_is_refused_alike_on_every_route(self):
        from tfdp.compat.tensorflow_privacy import dp_keras_optimizer
        from tfdp.dp import clipping

        for clip in _BAD_CLIPS:
            with self.subTest(clip=clip):
                expected = _message(validation.validate_l2_norm_clip, clip)
                self.assertIn(f"Received: l2_norm_clip={clip!r}", expected)
                self.assertEqual(_message(DPSGD, clip, 1.0, expected_batch_size=8), expected)
                if clip is not None:  # A ledger may record no C.
                    self.assertEqual(_message(_ledger, l2_norm_clip=clip), expected)
                self.assertEqual(_message(clipping.clipped_grad_sum, None, None, None, None,
                                          l2_norm_clip=clip), expected)
                self.assertEqual(_message(dp_keras_optimizer.validate_arguments, clip, 1.0),
                                 expected)
        for clip in (1e-6, 1, 2.5, np.float32(0.5)):
            self.assertEqual(validation.validate_l2_norm_clip(clip), float(clip))
            self.assertEqual(DPSGD(clip, 1.0, expected_batch_size=8).l2_norm_clip, float(clip))

    def test_noise_multiplier_is_refused_alike_on_every_route(self):
        from tfdp.compat.tensorflow_privacy import dp_keras_optimizer

        for sigma in _BAD_SIGMAS:
            with self.subTest(sigma=sigma):
                expected = _message(validation.validate_noise_multiplier, sigma)
                self.assertIn(f"Received: noise_multiplier={sigma!r}", expected)
                if sigma is not None:  # None asks DPSGD to calibrate σ.
                    self.assertEqual(_message(DPSGD, 1.0, sigma, expected_batch_size=8),
                                     expected)
                self.assertEqual(_message(_ledger, noise_multiplier=sigma), expected)
                self.assertEqual(_message(privacy.epsilon, sigma, 10, 1e-5, sampling_rate=0.1),
                                 expected)
                self.assertEqual(_message(dp_keras_optimizer.validate_arguments, 1.0, sigma),
                                 expected)
        self.assertEqual(validation.validate_noise_multiplier(0), 0.0)

    def test_delta_is_refused_alike_on_every_route(self):
        for delta in _BAD_DELTAS:
            with self.subTest(delta=delta):
                expected = _message(validation.validate_delta, delta)
                self.assertEqual(expected, f"delta must be in (0, 1). Received: delta={delta!r}")
                self.assertEqual(_message(DPSGD, 1.0, 1.0, delta=delta, expected_batch_size=8),
                                 expected)
                self.assertEqual(_message(_ledger, delta=delta), expected)
                self.assertEqual(_message(privacy.epsilon, 1.0, 10, delta, sampling_rate=0.1),
                                 expected)

    def test_epsilon_budgets_and_step_counts(self):
        for eps in (0, -1.0, math.nan, math.inf, "1"):
            with self.subTest(eps=eps):
                expected = _message(validation.validate_epsilon, eps)
                self.assertIn("target_epsilon must be > 0", expected)
                self.assertEqual(
                    _message(DPSGD, 1.0, 1.0, target_epsilon=eps, expected_batch_size=8),
                    expected)
                self.assertEqual(
                    _message(privacy.calibrate_noise, eps, 1e-5, steps=10, sampling_rate=0.1),
                    expected)
        # A budget of 0 allows no step, where a count of steps is asked.
        self.assertEqual(privacy.max_steps_within(0, 1.0, 1e-5, sampling_rate=0.1), 0)
        self.assertIn("must be >= 0", _message(privacy.max_steps_within, -1.0, 1.0, 1e-5,
                                               sampling_rate=0.1))
        for steps in (-1, 1.5, "3", True):
            self.assertEqual(_message(validation.validate_steps, steps),
                             f"steps must be an integer >= 0. Received: steps={steps!r}")
        self.assertEqual(validation.validate_steps(np.int64(7)), 7)


class PrivacyQueryTest(parameterized.TestCase):

    @parameterized.parameters(("rdp", "poisson"), ("rdp", "shuffle"), ("pld", "poisson"))
    def test_answers_what_the_functions_answer(self, accountant, sampler):
        kw = dict(dataset_size=1000, batch_size=50, accountant=accountant, sampler=sampler)
        query = privacy.PrivacyQuery(1.1, 40, 1e-5, **kw)
        self.assertEqual(query.epsilon(), privacy.epsilon(1.1, 40, 1e-5, **kw))
        # Another step count, σ or δ is the query of that run.
        self.assertEqual(query.epsilon(steps=80), privacy.epsilon(1.1, 80, 1e-5, **kw))
        self.assertEqual(query.epsilon(noise_multiplier=2.0),
                         privacy.epsilon(2.0, 40, 1e-5, **kw))
        self.assertEqual(query.epsilon(delta=1e-7), privacy.epsilon(1.1, 40, 1e-7, **kw))
        self.assertLess(query.epsilon(steps=80, noise_multiplier=2.0), query.epsilon(steps=80))
        self.assertEqual(query.epsilon(steps=0), 0.0)
        self.assertEqual(query.epsilon(noise_multiplier=0.0), math.inf)
        self.assertEqual((query.sampling_rate, query.dataset_size, query.batch_size),
                         (0.05, 1000, 50))

    def test_validates_once_and_warns_once(self):
        with self.assertRaisesRegex(ValueError, "Received: accountant='exact'"):
            privacy.PrivacyQuery(1.0, 10, 1e-5, sampling_rate=0.1, accountant="exact")
        with self.assertRaisesRegex(ValueError, "batch_size"):
            privacy.PrivacyQuery(1.0, 10, 1e-5, dataset_size=10, batch_size=20)
        with self.assertWarnsRegex(UserWarning, "1/dataset_size") as cm:
            query = privacy.PrivacyQuery(1.0, 10, 0.01, dataset_size=100, batch_size=10)
        self.assertEqual(cm.filename, __file__)  # Pointed at the caller.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            query.epsilon(steps=20)
        # Overrides get the same rules as the query's own values.
        with self.assertRaisesRegex(ValueError, "Received: steps=-1"):
            query.epsilon(steps=-1)
        with self.assertRaisesRegex(ValueError, "Received: delta=2"):
            query.epsilon(delta=2)

    def test_takes_a_sampler_instance(self):
        shuffle = samplers.make_sampler("shuffle", dataset_size=1000, logical_batch_size=50)
        query = privacy.PrivacyQuery(1.1, 40, 1e-5, dataset_size=1000, batch_size=50,
                                     sampler=shuffle)
        self.assertEqual(query.epsilon(), privacy.epsilon(1.1, 40, 1e-5, dataset_size=1000,
                                                          batch_size=50, sampler="shuffle"))


if __name__ == "__main__":
    absltest.main()
