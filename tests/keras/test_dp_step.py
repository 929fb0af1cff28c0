"""The DP train step of `fit`: equivalences, virtual steps, noise, weights."""

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tests.keras import keras_test_case as ktc

HUGE_C = 1e6


class DPStepTest(ktc.KerasTestCase):
    def _pair(self, **dp_kwargs):
        """A private model and a plain clone with the same weights."""
        inner = ktc.tiny_model()
        plain = keras.models.clone_model(inner)
        plain.set_weights(inner.get_weights())
        return self.private(inner, **dp_kwargs), plain

    def test_sigma0_huge_clip_equals_nonprivate_step(self):
        for method in ("auto", "vectorized"):
            with self.subTest(method=method):
                x, y = ktc.digits(16)
                dp, plain = self._pair(l2_norm_clip=HUGE_C, method=method)
                dp.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
                ktc.nonprivate_sgd_step(plain, x, y, lr=0.1)
                self.assertEqual(int(dp.optimizer.iterations), 1)
                self.assertWeightsClose(dp.get_weights(), plain.get_weights())

    def test_stream_step_never_spans_epochs(self):
        # 24 examples in batches of 8, k=2: each epoch releases the first two
        # batches as one step; the third starts a step that the next epoch
        # discards, unreleased (before, it was finished with the next
        # epoch's first batch).
        x, y = ktc.digits(24)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        dp, plain = self._pair(l2_norm_clip=HUGE_C, gradient_accumulation_steps=2)
        dp.fit(ds, epochs=2, verbose=0)
        self.assertEqual(int(dp.optimizer.iterations), 2)
        self.assertEqual(int(dp.optimizer.passes), 2)
        ktc.nonprivate_sgd_step(plain, x[:16], y[:16], lr=0.1)
        ktc.nonprivate_sgd_step(plain, x[:16], y[:16], lr=0.1)
        self.assertWeightsClose(dp.get_weights(), plain.get_weights())

    def test_virtual_steps_in_one_fit(self):
        x, y = ktc.digits(32)
        dp, plain = self._pair(l2_norm_clip=HUGE_C, gradient_accumulation_steps=2)
        dp.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        self.assertEqual(int(dp.optimizer.iterations), 2)
        ktc.nonprivate_sgd_step(plain, x[:16], y[:16], lr=0.1)
        ktc.nonprivate_sgd_step(plain, x[16:], y[16:], lr=0.1)
        self.assertWeightsClose(dp.get_weights(), plain.get_weights())

    def test_noise_added_once_per_logical_step(self):
        # C tiny, sigma*C = 0.1: the clipped sum (norm <= B*C = 1.6e-3) is
        # negligible next to the noise. Two fit batches of 8 (k=2) make one
        # logical step: weight change std = sigma*C / (k*B) * lr. Noise added
        # per batch would give sqrt(2) times that, dividing by B only 2x.
        x, y = ktc.digits(16)
        model = tfdp.models.small_convnet(input_shape=(8, 8, 1), filters=(16, 32))
        dp = self.private(
            model, optimizer=keras.optimizers.SGD(1.0),
            l2_norm_clip=1e-4, noise_multiplier=1000.0, gradient_accumulation_steps=2,
        )
        before = np.concatenate([np.ravel(w) for w in dp.model.get_weights()])
        dp.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        after = np.concatenate([np.ravel(w) for w in dp.model.get_weights()])
        self.assertEqual(int(dp.optimizer.iterations), 1)
        expected = 1000.0 * 1e-4 / 16 * 1.0
        self.assertGreater(after.size, 10_000)
        self.assertAllClose(np.std(after - before), expected, rtol=0.03)
        self.assertAllClose(np.mean(after - before), 0.0, atol=3 * expected / np.sqrt(after.size))

    def test_noise_is_secret_unless_an_insecure_seed_is_given(self):
        x, y = ktc.digits(16)

        def weights_after(**kw):
            keras.utils.set_random_seed(0)
            tf.random.set_seed(0)
            dp = self.private(ktc.tiny_model(), noise_multiplier=1.0, **kw)
            dp.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
            return dp.get_weights()[0]

        # Global seeds do not make the noise reproducible: it comes from the
        # OS's entropy.
        self.assertNotAllClose(weights_after(), weights_after())
        # Only the explicit, insecure option does.
        with self.assertWarnsRegex(UserWarning, "INSECURE"):
            same = [weights_after(insecure_reproducible_seed=s) for s in (3, 3, 4)]
        self.assertAllClose(same[0], same[1], rtol=0, atol=0)
        self.assertNotAllClose(same[0], same[2])

    def test_seed_argument_is_refused(self):
        with self.assertRaisesRegex(ValueError, "secret key.*insecure_reproducible_seed"):
            tfdp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0, seed=0)

    def test_sample_weight_scales_loss_and_zero_is_padding(self):
        x, y = ktc.digits(16)
        sw = np.array([1.0] * 10 + [2.0] * 2 + [0.0] * 4, "float32")
        dp, plain = self._pair(l2_norm_clip=HUGE_C, expected_batch_size=16)
        dp.fit(x, y, sample_weight=sw, batch_size=16, epochs=1, shuffle=False, verbose=0)
        ktc.nonprivate_sgd_step(plain, x[:12], y[:12], lr=0.1, divisor=16, sample_weight=sw[:12])
        self.assertWeightsClose(dp.get_weights(), plain.get_weights())

    def test_expected_batch_size_is_the_divisor(self):
        x, y = ktc.digits(16)
        dp, plain = self._pair(l2_norm_clip=HUGE_C, expected_batch_size=20.0)
        dp.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=1, verbose=0)
        ktc.nonprivate_sgd_step(plain, x, y, lr=0.1, divisor=20.0)
        self.assertWeightsClose(dp.get_weights(), plain.get_weights())

    def test_clipping_bounds_each_example(self):
        # sigma=0, C small: the update is lr * (sum of clipped grads) / B,
        # whose norm is at most lr * C.
        x, y = ktc.digits(16)
        dp = self.private(ktc.tiny_model(), optimizer=keras.optimizers.SGD(1.0),
                          l2_norm_clip=0.01)
        before = ktc.weights(dp)
        dp.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        delta = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(ktc.weights(dp), before)))
        self.assertLessEqual(delta, 0.01 * (1 + 1e-5))
        self.assertGreater(delta, 0.001)

    def test_dataset_input_and_batch_size_from_element_spec(self):
        x, y = ktc.digits(32)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
        dp, plain = self._pair(l2_norm_clip=HUGE_C)
        dp.fit(ds, epochs=1, verbose=0, shuffle=False)
        self.assertEqual(dp.optimizer.logical_batch_size, 16.0)
        ktc.nonprivate_sgd_step(plain, x[:16], y[:16], lr=0.1)
        ktc.nonprivate_sgd_step(plain, x[16:], y[16:], lr=0.1)
        self.assertWeightsClose(dp.get_weights(), plain.get_weights())

    def test_batch_size_from_first_batch(self):
        # No static batch dimension: the divisor is fixed by the first batch
        # (16), also for the short last batch (8 examples).
        x, y = ktc.digits(24)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        dp, plain = self._pair(l2_norm_clip=HUGE_C)
        dp.fit(ds, epochs=1, verbose=0, shuffle=False)
        self.assertEqual(dp.optimizer.logical_batch_size, 16.0)
        ktc.nonprivate_sgd_step(plain, x[:16], y[:16], lr=0.1)
        ktc.nonprivate_sgd_step(plain, x[16:], y[16:], lr=0.1, divisor=16)
        self.assertWeightsClose(dp.get_weights(), plain.get_weights())

    def test_metrics_loss_and_evaluate_predict(self):
        x, y = ktc.digits(64)
        dp = self.private(ktc.tiny_model())
        history = dp.fit(x, y, batch_size=32, epochs=1, validation_data=(x, y), verbose=0)
        for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
            self.assertIn(key, history.history)
        loss, acc = dp.evaluate(x, y, verbose=0)
        plain_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
            y, dp.model.predict(x, verbose=0))
        self.assertAllClose(loss, plain_loss, rtol=1e-5)
        self.assertAllClose(dp.predict(x, verbose=0), dp.model(x), rtol=1e-5, atol=1e-6)

    def test_per_example_loss_from_any_compiled_loss(self):
        y = tf.constant([1, 0, 2])
        logits = tf.constant([[0.1, 2.0, -1.0], [1.0, 0.0, 0.0], [0.3, 0.2, 0.9]])
        probs = tf.nn.softmax(logits)
        expected = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        cases = [
            (keras.losses.SparseCategoricalCrossentropy(from_logits=True), logits),
            (keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"), logits),
            (keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None), logits),
            ("sparse_categorical_crossentropy", probs),
            ([keras.losses.SparseCategoricalCrossentropy(from_logits=True)], logits),
            (lambda t, p: keras.losses.sparse_categorical_crossentropy(
                 t, p, from_logits=True), logits),
        ]
        for loss, pred in cases:
            with self.subTest(loss=repr(loss)):
                fn = tfdp.keras.per_example_loss_fn(loss)
                self.assertAllClose(fn(y, pred), expected, rtol=1e-5)
        fn = tfdp.keras.per_example_loss_fn("sparse_categorical_crossentropy", loss_weights=[2.0])
        self.assertAllClose(fn(y, probs), 2 * expected, rtol=1e-5)
        # Extra axes are averaged per example.
        mse = tfdp.keras.per_example_loss_fn(keras.losses.MeanSquaredError())
        self.assertEqual(mse(tf.zeros([3, 4, 2]), tf.ones([3, 4, 2])).shape, (3,))

    def test_subclassed_model(self):
        class Net(keras.Model):
            def __init__(self):
                super().__init__()
                self.conv = keras.layers.Conv2D(4, 3)
                self.flat = keras.layers.Flatten()
                self.head = keras.layers.Dense(10)

            def call(self, x):
                return self.head(self.flat(self.conv(x)))

        x, y = ktc.digits(32)
        dp = self.private(Net(), l2_norm_clip=HUGE_C)
        dp.fit(x, y, batch_size=16, epochs=1, verbose=0)
        self.assertEqual(int(dp.optimizer.iterations), 2)
        self.assertEqual(dp.predict(x, verbose=0).shape, (32, 10))
