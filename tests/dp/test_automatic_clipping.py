"""Automatic clipping (Bu et al. 2023, AUTO-S): each unit contributes
C·g/(‖g‖ + γ), the same for every clipping method and every route."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tests.dp import dp_test_case
from tests.keras.keras_test_case import digits
from tests.keras.keras_test_case import tiny_model
from tests.keras.keras_test_case import xent
from tfdp import dp
from tfdp import engine as engine_lib
from tfdp import models
from tfdp import secret_key
from tfdp import training

ALL_METHODS = ("naive", "vectorized", "ghost", "mixed", "bk")


def _per_example_grads(model, loss_fn, x, y):
    grads = []
    for i in range(int(x.shape[0])):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(y[i:i + 1], model(x[i:i + 1], training=True)))
        grads.append([tf.convert_to_tensor(g).numpy()
                      for g in tape.gradient(loss, model.trainable_variables)])
    return grads


def _reference(grads, clip, gamma):
    """Σ_i C·g_i/(‖g_i‖ + γ), and each contribution's norm."""
    sums = [np.zeros_like(g) for g in grads[0]]
    contributions = []
    for g in grads:
        norm = np.sqrt(sum(float(np.sum(t.astype(np.float64) ** 2)) for t in g))
        factor = clip / (norm + gamma)
        sums = [s + factor * t for s, t in zip(sums, g)]
        contributions.append(factor * norm)
    return sums, np.array(contributions)


class AutomaticClippingTest(dp_test_case.DPTestCase):

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(3)

    def test_coefficients_and_every_contribution_below_c(self):
        norms = tf.constant([0.0, 0.01, 1.0, 100.0, np.nan])
        mask = tf.constant([1.0, 1.0, 1.0, 1.0, 1.0])
        got = dp.clip_coefficients(norms, 2.0, mask, clipping="automatic", clipping_gamma=0.01)
        self.assertAllClose(got[:4], [200.0, 100.0, 2.0 / 1.01, 2.0 / 100.01])
        self.assertEqual(float(got[4]), 0.0)  # A non-finite unit contributes nothing.
        self.assertAllLess((got * norms)[:4], 2.0)
        standard = dp.clip_coefficients(norms, 2.0, mask)
        self.assertAllClose(standard[:4], [1.0, 1.0, 1.0, 0.02])

    def test_every_method_gives_the_reference_sum(self):
        model = models.small_convnet(num_classes=4, input_shape=(28, 28, 1))
        rng = np.random.default_rng(0)
        x = tf.constant(rng.normal(size=(6, 28, 28, 1)), tf.float32)
        y = tf.constant([0, 1, 2, 3, 0, 1])
        loss_fn = dp_test_case.per_example_xent
        clip, gamma = 0.5, 0.05
        reference, contributions = _reference(
            _per_example_grads(model, loss_fn, x, y), clip, gamma)
        self.assertAllLess(contributions, clip)
        for method in ALL_METHODS:
            grads, _ = dp.clipped_grad_sum(model, loss_fn, x, y, l2_norm_clip=clip,
                                           method=method, clipping="automatic",
                                           clipping_gamma=gamma)
            for g, r in zip(grads, reference):
                scale = float(np.max(np.abs(r))) + 1e-6
                self.assertAllClose(g / scale, r / scale, rtol=1e-4, atol=1e-4,
                                    msg=f"method={method}")

    def test_units_of_several_rows_are_normalised_as_one(self):
        # At user level (or with augmentation multiplicity) a unit's gradient
        # is its rows' mean gradient, normalised once.
        model = dp_test_case.text_model()
        rng = np.random.default_rng(1)
        x = tf.constant(rng.integers(0, 20, size=(6, 7)), tf.int32)
        y = tf.constant([0, 1, 2, 0, 1, 2])
        loss_fn = dp_test_case.per_example_xent
        rows = _per_example_grads(model, loss_fn, x, y)
        units = [[(a + b) / 2 for a, b in zip(rows[i], rows[i + 1])] for i in (0, 2, 4)]
        reference, _ = _reference(units, 1.0, 0.01)
        for method in ALL_METHODS:
            grads, norms = dp.clipped_grad_sum(model, loss_fn, x, y, l2_norm_clip=1.0,
                                               method=method, augmentation_multiplicity=2,
                                               clipping="automatic")
            self.assertLen(norms, 3)
            for g, r in zip(grads, reference):
                self.assertAllClose(g, r, rtol=1e-4, atol=1e-5, msg=f"method={method}")

    def test_the_loss_vectors_jacobian_is_normalised_alike(self):
        model = tiny_model()
        x, y = digits(4)
        loss_fn = dp_test_case.per_example_xent
        with tf.GradientTape(persistent=True) as tape:
            losses = tf.reshape(loss_fn(y, model(x, training=True)), [-1])
        summed, _ = dp.jacobian_clipped_sum(tape, losses, model.trainable_variables, 0.3,
                                            clipping="automatic", clipping_gamma=0.02)
        reference, _ = _reference(_per_example_grads(model, loss_fn, x, y), 0.3, 0.02)
        for g, r in zip(summed, reference):
            self.assertAllClose(g, r, rtol=1e-4, atol=1e-6)

    def test_bad_rules_are_refused(self):
        with self.assertRaisesRegex(ValueError, r"clipping must be one of .*Received: "
                                    r"clipping='auto'"):
            tfdp.DPSGDConfig(1.0, 1.0, clipping="auto")
        for gamma in (0.0, -1.0, float("nan"), "0.01"):
            with self.assertRaisesRegex(ValueError, "clipping_gamma must be a finite number"):
                tfdp.DPSGDConfig(1.0, 1.0, clipping="automatic", clipping_gamma=gamma)


class AutomaticClippingRoutesTest(tf.test.TestCase):
    """The rule reaches every route through the contract, and changes no ε."""

    def test_the_contract_carries_it_and_its_epsilon_is_standard_clippings(self):
        sampler = tfdp.samplers.make_sampler("poisson", dataset_size=1000, logical_batch_size=50)
        automatic = tfdp.DPSGD.from_config(
            tfdp.DPSGDConfig(1.0, 1.1, clipping="automatic", clipping_gamma=0.1),
            sampler=sampler)
        standard = tfdp.DPSGD.from_config(tfdp.DPSGDConfig(1.0, 1.1), sampler=sampler)
        self.assertEqual(automatic.clip_settings(), dict(l2_norm_clip=1.0, clipping="automatic",
                                                         clipping_gamma=0.1))
        self.assertEqual(automatic.epsilon(100), standard.epsilon(100))
        self.assertIn("clipping=automatic(gamma=0.1)", automatic.describe())
        engine = engine_lib.make_engine(
            tfdp.DPSGDConfig(1.0, 1.1, clipping="automatic"), sampler=sampler,
            key=secret_key.SecretKey.generate())
        settings = engine.probe_settings(method="bk", weight_decay=0.0)
        self.assertEqual((settings["clipping"], settings["clipping_gamma"]), ("automatic", 0.01))

    def test_the_trainers_privacy_config_takes_it(self):
        config = training.PrivacyConfig(noise_multiplier=1.0, clipping="automatic",
                                        clipping_gamma=0.05)
        self.assertEqual((config.dpsgd_config.clipping, config.dpsgd_config.clipping_gamma),
                         ("automatic", 0.05))
        with self.assertRaisesRegex(ValueError, "clipping must be one of"):
            training.PrivacyConfig(noise_multiplier=1.0, clipping="flat")
        with self.assertRaisesRegex(ValueError, "are for private training"):
            training.PrivacyConfig(private=False, clipping="automatic")

    def test_the_trainers_step_releases_the_normalised_sum(self):
        # With DP-SGD's noise and with banded noise (bands = 2): the noise
        # scheme adds to the normalised sum and does not bypass it.
        x, y = digits(8)
        x, y = tf.constant(x), tf.constant(y)
        clip, gamma, lr = 0.2, 0.05, 0.5
        for bands in (1, 2):
            keras.utils.set_random_seed(6)
            model = tiny_model()
            grads = _per_example_grads(model, dp_test_case.per_example_xent, x, y)
            expected = [lr * s / 8 for s in _reference(grads, clip, gamma)[0]]
            mechanism = tfdp.DPSGD.from_config(
                tfdp.DPSGDConfig(clip, 0.0, clipping="automatic", clipping_gamma=gamma,
                                 bands=bands),
                expected_batch_size=8.0, secret_key=secret_key.SecretKey.generate())
            step = dp.PrivateTrainStep(model, keras.optimizers.SGD(lr),
                                       dp_test_case.per_example_xent, mechanism=mechanism,
                                       method="bk")
            before = [v.numpy() for v in model.trainable_variables]
            step.accumulate(x, y, tf.ones([8]))
            step.apply()
            for b, v, e in zip(before, model.trainable_variables, expected):
                self.assertAllClose(b - v.numpy(), e, rtol=1e-4, atol=1e-6, msg=f"bands={bands}")

    def test_banded_noise_keeps_its_epsilon(self):
        sampler = tfdp.samplers.make_sampler("banded_poisson", dataset_size=1000,
                                             logical_batch_size=50, bands=2)
        automatic, standard = (tfdp.DPSGD.from_config(
            tfdp.DPSGDConfig(1.0, 1.1, bands=2, **kwargs), sampler=sampler)
            for kwargs in (dict(clipping="automatic"), {}))
        self.assertEqual(automatic.epsilon(100), standard.epsilon(100))

    def test_keras_fit_releases_the_normalised_sum(self):
        # At σ = 0 and plain SGD, one logical step moves the weights by
        # lr·Σ_i C·g_i/(‖g_i‖ + γ) / B.
        x, y = digits(16)
        clip, gamma, lr = 0.2, 0.05, 0.5

        def reference_update(model):
            grads = _per_example_grads(model, xent(), tf.constant(x), tf.constant(y))
            sums, _ = _reference(grads, clip, gamma)
            return [lr * s / 16 for s in sums]

        keras.utils.set_random_seed(5)
        model = tfdp.make_private(tiny_model())
        model.compile(optimizer=tfdp.DPOptimizer(
            keras.optimizers.SGD(lr), l2_norm_clip=clip, noise_multiplier=0.0,
            clipping="automatic", clipping_gamma=gamma, sampler="shuffle",
            expected_batch_size=16, insecure_reproducible_seed=0), loss=xent())
        model.build((None, 8, 8, 1))
        before = [v.numpy() for v in model.trainable_variables]
        expected = reference_update(model)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        after = [v.numpy() for v in model.trainable_variables]
        for b, a, e in zip(before, after, expected):
            self.assertAllClose(b - a, e, rtol=1e-4, atol=1e-6)
        config = model.optimizer.get_config()
        self.assertEqual((config["clipping"], config["clipping_gamma"]), ("automatic", gamma))


if __name__ == "__main__":
    tf.test.main()
