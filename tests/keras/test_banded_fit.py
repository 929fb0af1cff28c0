"""Banded matrix-factorization noise in Keras `fit` (`DPOptimizer(bands=b)`)."""

import math

import dp_accounting
import keras
import numpy as np
import tensorflow as tf

import tfdp
from tests.keras import keras_test_case as ktc


class BandedFitTest(ktc.KerasTestCase):
    N, B = 256, 16

    def _fit(self, epochs=1, seed=5, **dp_kwargs):
        x, y = ktc.digits(self.N)
        keras.utils.set_random_seed(0)
        dp = self.private(ktc.tiny_model(), noise_multiplier=1.0,
                          insecure_reproducible_seed=seed, **dp_kwargs)
        dp.fit(x, y, batch_size=self.B, epochs=epochs, verbose=0)
        return dp

    def test_one_band_is_poisson_dp_sgd(self):
        banded = self._fit(sampler="banded_poisson", bands=1)
        plain = self._fit(sampler="poisson")
        self.assertWeightsClose(ktc.weights(banded), ktc.weights(plain), rtol=0, atol=0)
        self.assertIsNone(banded.optimizer.logical_step.noise_state)

    def test_bands_correlate_the_noise_and_are_accounted_by_rounds(self):
        bands = 4
        dp = self._fit(bands=bands)
        optimizer = dp.optimizer
        self.assertEqual(optimizer.mechanism.sampler.name, "banded_poisson")
        self.assertEqual(optimizer.mechanism.bands, bands)
        # The state holds the last b − 1 noise tensors, all drawn by now.
        state = optimizer.logical_step.noise_state
        self.assertLen(state, len(dp.model.trainable_variables))
        self.assertEqual(tuple(state[0].shape), (bands - 1, *dp.model.trainable_variables[0].shape))
        self.assertGreater(float(np.abs(state[0].numpy()).min()), 0.0)
        # ε: ⌈T/b⌉ rounds of the Poisson-sampled Gaussian at q = bB/N.
        steps = int(optimizer.iterations.numpy())
        self.assertEqual(steps, self.N // self.B)
        accountant = dp_accounting.rdp.RdpAccountant()
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                bands * self.B / self.N, dp_accounting.GaussianDpEvent(1.0)),
            math.ceil(steps / bands)))
        self.assertAllClose(dp.epsilon(), accountant.get_epsilon(optimizer.delta), rtol=1e-6)
        # DP-SGD at the same σ, steps and q = B/N is a different figure.
        plain = dp_accounting.rdp.RdpAccountant()
        plain.compose(dp_accounting.PoissonSampledDpEvent(
            self.B / self.N, dp_accounting.GaussianDpEvent(1.0)), steps)
        self.assertNotAllClose(dp.epsilon(), plain.get_epsilon(optimizer.delta))

    def test_a_restored_banded_optimizer_is_refused(self):
        dp = self._fit(bands=2)
        optimizer = tfdp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0, bands=2)
        restored = tfdp.make_private(ktc.tiny_model())
        restored.compile(optimizer=optimizer, loss=ktc.xent())
        restored.model.set_weights(dp.model.get_weights())
        optimizer.build(restored.model.trainable_variables)
        optimizer.iterations.assign(5)  # As a Keras checkpoint restores it.
        x, y = ktc.digits(self.N)
        with self.assertRaisesRegex(ValueError, "bands > 1 .* cannot resume"):
            restored.fit(x, y, batch_size=self.B, verbose=0)

    def test_a_stream_with_bands_is_refused(self):
        x, y = ktc.digits(self.N)
        dp = self.private(ktc.tiny_model(), noise_multiplier=1.0, bands=2, dataset_size=self.N)
        stream = tf.data.Dataset.from_tensor_slices((x, y)).batch(self.B)
        with self.assertRaisesRegex(ValueError, "banded_poisson"):
            dp.fit(stream, verbose=0)

    def test_bands_round_trip_through_the_config(self):
        optimizer = tfdp.DPOptimizer("sgd", 1.0, 1.0, bands=3)
        restored = tfdp.DPOptimizer.from_config(optimizer.get_config())
        self.assertEqual(restored.bands, 3)


class BandedUserFitTest(ktc.KerasTestCase):
    """`DPOptimizer(bands=b, privacy_unit="user")`: b groups of users."""

    USERS, K, B = 60, 2, 5

    def _fit(self, **dp_kwargs):
        # 60 users with 1 to 4 examples each (150 examples).
        counts = np.tile([1, 2, 3, 4], self.USERS // 4)
        user_ids = np.random.default_rng(0).permutation(
            np.repeat(np.arange(self.USERS), counts))
        x, y = ktc.digits(len(user_ids))
        keras.utils.set_random_seed(0)
        dp = self.private(ktc.tiny_model(), noise_multiplier=1.0, insecure_reproducible_seed=5,
                          privacy_unit="user", max_examples_per_user=self.K, **dp_kwargs)
        before = ktc.weights(dp)
        # batch_size = B users of k rows: B users per step, N / B steps.
        dp.fit(x, y, user_ids=user_ids, batch_size=self.B * self.K, verbose=0)
        return dp, before

    def test_two_bands_train_on_groups_of_users_accounted_by_rounds(self):
        dp, before = self._fit(bands=2)
        optimizer = dp.optimizer
        sampler = optimizer.mechanism.sampler
        self.assertEqual(sampler.name, "banded_user_poisson")
        self.assertEqual((sampler.bands, sampler.dataset_size), (2, self.USERS))
        self.assertEqual(optimizer.mechanism.bands, 2)
        self.assertEqual(tuple(optimizer.logical_step.noise_state[0].shape)[0], 1)
        self.assertTrue(all(np.all(np.isfinite(w)) for w in ktc.weights(dp)))
        self.assertFalse(all(np.array_equal(a, b) for a, b in zip(ktc.weights(dp), before)))
        steps = int(optimizer.iterations.numpy())
        self.assertEqual(steps, self.USERS // self.B)
        accountant = dp_accounting.rdp.RdpAccountant()
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                2 * self.B / self.USERS, dp_accounting.GaussianDpEvent(1.0)),
            math.ceil(steps / 2)))
        self.assertAllClose(dp.epsilon(), accountant.get_epsilon(optimizer.delta), rtol=1e-6)
        ledger = dp.privacy_ledger()
        self.assertEqual((ledger.privacy_unit, ledger.sampler, ledger.bands),
                         ("user", "banded_user_poisson", 2))
        # No group-privacy comparison is claimed for a banded run.
        with self.assertRaisesRegex(ValueError, "bands=2"):
            dp.example_level_claim()

    def test_one_band_is_user_poisson_dp_sgd(self):
        banded, _ = self._fit(sampler="banded_user_poisson", bands=1)
        plain, _ = self._fit()
        self.assertEqual(plain.optimizer.mechanism.sampler.name, "user_poisson")
        self.assertWeightsClose(ktc.weights(banded), ktc.weights(plain), rtol=0, atol=0)
