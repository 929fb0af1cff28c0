"""The warning where sampling amplifies privacy little (q > 1/2), on every route."""

import warnings

import keras
import numpy as np

import tfdp
from tests.keras import keras_test_case as ktc
from tfdp import samplers


class WeakAmplificationWarningTest(ktc.KerasTestCase):
    """`tfdp.samplers.weak_amplification_warning`, a pure function."""

    def test_silent_at_or_below_one_half(self):
        self.assertIsNone(samplers.weak_amplification_warning(0.5))
        self.assertIsNone(samplers.weak_amplification_warning(
            samplers.make_sampler("poisson", dataset_size=100, logical_batch_size=50)))

    def test_example_level_quotes_epsilon_and_suggests_what_exists(self):
        sampler = samplers.make_sampler("poisson", dataset_size=100, logical_batch_size=80)
        message = samplers.weak_amplification_warning(sampler, epsilon=12.345, delta=1e-5)
        self.assertIn("q=0.8", message)
        self.assertIn("epsilon=12.3 at delta=1e-05", message)
        self.assertIn("a larger dataset", message)
        self.assertIn("a smaller batch size", message)
        self.assertNotIn("max_examples_per_user", message)

    def test_user_level_suggests_max_examples_per_user(self):
        message = samplers.weak_amplification_warning(0.9, "user", max_examples_per_user=2)
        self.assertIn("every user", message)
        self.assertIn("max_examples_per_user (now 2)", message)

    def test_a_sampler_without_amplification_is_not_warned(self):
        sampler = samplers.make_sampler("shuffle", dataset_size=100, logical_batch_size=80)
        self.assertIsNone(samplers.weak_amplification_warning(sampler))

    def test_rejects_a_rate_outside_zero_one(self):
        with self.assertRaisesRegex(ValueError, "Received: q=1.5"):
            samplers.weak_amplification_warning(1.5)


class FitWarnsOnceTest(ktc.KerasTestCase):

    def _fit_twice(self, batch_size):
        x = np.random.default_rng(0).normal(size=(40, 4)).astype("float32")
        y = np.zeros([40], "int32")
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        dp = tfdp.make_private(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer = tfdp.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
                                         noise_multiplier=1.0, delta=1e-5,
                                         insecure_reproducible_seed=1)
            dp.compile(optimizer=optimizer,
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            dp.fit(x, y, batch_size=batch_size, epochs=2, verbose=0)
            dp.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
        return [str(w.message) for w in caught if "amplification" in str(w.message)]

    def test_fit_warns_once_with_the_runs_epsilon(self):
        found = self._fit_twice(batch_size=32)  # q = 32 / 40.
        self.assertLen(found, 1)
        self.assertIn("q=0.8", found[0])
        self.assertRegex(found[0], r"this run gets epsilon=[0-9.]+ at delta=1e-05")
        self.assertIn("(after 3 steps)", found[0])  # 2 epochs of 40 / 32 steps.

    def test_fit_is_silent_below_one_half(self):
        self.assertEqual(self._fit_twice(batch_size=8), [])
