"""Privacy guarantees of Keras `fit` (`tfdp.make_private` with a `tfdp.DPOptimizer`).

- a target ε in the contract is kept: no step beyond `DPSGD.budget_steps`;
- labels are checked before any step (`tfdp.validation.validate_labels`);
- non-finite parameters stop `fit`, non-finite examples are dropped and counted;
- several `fit` calls on one banded optimizer continue its noise.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tests.keras import keras_test_case as ktc


class BandedFitCallsTest(ktc.KerasTestCase):
    N, B = 128, 16

    def _private(self):
        keras.utils.set_random_seed(0)
        return self.private(ktc.tiny_model(), noise_multiplier=1.0, bands=2,
                            insecure_reproducible_seed=3)

    def test_two_fits_continue_the_noise_of_one(self):
        x, y = ktc.digits(self.N)
        once = self._private()
        once.fit(x, y, batch_size=self.B, steps_per_epoch=6, verbose=0)
        twice = self._private()
        twice.fit(x, y, batch_size=self.B, steps_per_epoch=3, verbose=0)
        twice.fit(x, y, batch_size=self.B, steps_per_epoch=3, verbose=0)
        self.assertEqual(int(twice.optimizer.iterations.numpy()), 6)
        self.assertEqual(twice.privacy_ledger().steps, 6)
        self.assertWeightsClose(ktc.weights(twice), ktc.weights(once))


def _compile(model, optimizer, loss=None):
    dp = tfdp.make_private(model)
    dp.compile(optimizer=optimizer, loss=loss or ktc.xent())
    return dp


def _sampler(name, n, batch):
    return tfdp.samplers.make_sampler(name, dataset_size=n, logical_batch_size=batch,
                                      physical_batch_size=batch)


class ContractBudgetTest(ktc.KerasTestCase):
    N, B = 128, 16

    def _fit(self, mechanism, x, y, **kwargs):
        dp = _compile(ktc.tiny_model(), tfdp.DPOptimizer(keras.optimizers.SGD(0.1),
                                                         mechanism=mechanism))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = dp.fit(x, y, verbose=0, **kwargs)
        said = [str(w.message) for w in caught if "privacy budget" in str(w.message)]
        return dp, history, said

    def test_a_budget_of_no_step_releases_none(self):
        x, y = ktc.digits(self.N)
        mechanism = tfdp.DPSGD(1.0, 0.5, sampler=_sampler("poisson", self.N, self.B),
                               target_epsilon=1.0)
        self.assertEqual(mechanism.budget_steps(8), 0)
        dp, _, said = self._fit(mechanism, x, y, batch_size=self.B)
        self.assertEqual(int(dp.optimizer.iterations.numpy()), 0)
        self.assertEqual(dp.epsilon(), 0.0)
        self.assertLen(said, 1)
        self.assertIn("allows 0", said[0])

    def test_an_optimizers_target_epsilon_is_kept_and_saved(self):
        x, y = ktc.digits(self.N)
        optimizer = tfdp.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
                                     noise_multiplier=0.5, target_epsilon=1.0)
        restored = tfdp.DPOptimizer.from_config(optimizer.get_config())
        self.assertEqual(restored.get_config()["target_epsilon"], 1.0)
        dp = _compile(ktc.tiny_model(), optimizer)
        before = ktc.weights(dp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dp.fit(x, y, batch_size=self.B, verbose=0)
        self.assertEqual(int(optimizer.iterations.numpy()), 0)
        self.assertWeightsClose(ktc.weights(dp), before, rtol=0, atol=0)

    def test_poisson_steps_stop_at_the_budget(self):
        x, y = ktc.digits(self.N)
        mechanism = tfdp.DPSGD(1.0, 1.0, sampler=_sampler("poisson", self.N, self.B),
                               target_epsilon=4.0)
        allowed = mechanism.budget_steps(16)
        self.assertBetween(allowed, 1, 15)
        dp, _, said = self._fit(mechanism, x, y, batch_size=self.B, epochs=2)
        self.assertEqual(int(dp.optimizer.iterations.numpy()), allowed)
        self.assertLessEqual(dp.epsilon(), 4.0)
        self.assertLen(said, 1)
        # A later fit releases nothing more.
        dp.fit(x, y, batch_size=self.B, verbose=0)
        self.assertEqual(int(dp.optimizer.iterations.numpy()), allowed)

    def test_a_stream_stops_at_the_pass_the_budget_allows(self):
        x, y = ktc.digits(self.N)
        mechanism = tfdp.DPSGD(1.0, 1.0, sampler=_sampler("shuffle", self.N, self.B),
                               target_epsilon=6.0)
        self.assertEqual(mechanism.budget_steps(24), self.N // self.B)  # One pass.
        stream = tf.data.Dataset.from_tensor_slices((x, y)).batch(self.B)
        dp, _, said = self._fit(mechanism, stream, None, epochs=3)
        self.assertEqual(int(dp.optimizer.iterations.numpy()), self.N // self.B)
        self.assertEqual(dp.privacy_ledger().steps, self.N // self.B)
        self.assertLessEqual(dp.epsilon(), 6.0)
        self.assertLen(said, 1)


class LabelsTest(ktc.KerasTestCase):
    N, B = 64, 16

    def _private(self, loss=None, head=10):
        return _compile(ktc.tiny_model(num_classes=head),
                        tfdp.DPOptimizer(keras.optimizers.SGD(0.1), 1.0, 1.0,
                                         insecure_reproducible_seed=1), loss)

    def test_out_of_range_labels_are_refused_before_any_step(self):
        x, y = ktc.digits(self.N)
        for bad in (-7, 13):  # A label of 13 would silently train 14 classes.
            labels = y.copy()
            labels[5] = bad
            dp = self._private()
            with self.assertRaisesRegex(ValueError, r"\[0, num_classes=10\).* 1 of 64 rows") as e:
                dp.fit(x, labels, batch_size=self.B, verbose=0)
            self.assertNotIn(str(bad), str(e.exception))  # Labels are private.
            self.assertEqual(int(dp.optimizer.iterations.numpy()), 0)

    def test_one_hot_targets_must_be_finite_and_of_the_output_shape(self):
        x, y = ktc.digits(self.N)
        loss = keras.losses.CategoricalCrossentropy(from_logits=True)
        one_hot = np.eye(10, dtype="float32")[y]
        one_hot[3, 2] = np.nan
        with self.assertRaisesRegex(ValueError, "1 of 64 rows hold NaN or inf"):
            self._private(loss).fit(x, one_hot, batch_size=self.B, verbose=0)
        with self.assertRaisesRegex(ValueError, r"output shape \(10,\)"):
            self._private(loss).fit(x, np.eye(11, dtype="float32")[y], batch_size=self.B,
                                    verbose=0)

    def test_a_stream_batch_with_a_bad_label_releases_nothing(self):
        x, y = ktc.digits(self.N)
        labels = y.copy()
        labels[2 * self.B + 1] = -1  # The third batch.
        dp = self._private()
        stream = tf.data.Dataset.from_tensor_slices((x, labels)).batch(self.B)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"not class indices in \[0, num_classes=10\)") as e:
            dp.fit(stream, verbose=0)
        self.assertNotIn(str(labels[2 * self.B:3 * self.B].tolist()[:4])[1:-1],
                         str(e.exception))
        self.assertEqual(int(dp.optimizer.iterations.numpy()), 2)


class NonFiniteTest(ktc.KerasTestCase):
    N, B = 64, 16

    def test_nan_parameters_stop_fit_before_later_callbacks(self):
        x, y = ktc.digits(self.N)
        dp = _compile(ktc.tiny_model(), tfdp.DPOptimizer(
            keras.optimizers.SGD(1e39), 1.0, 1.0, insecure_reproducible_seed=1))
        seen = []
        later = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: seen.append(batch))
        with self.assertRaisesRegex(FloatingPointError,
                                    "The parameters are NaN/Inf after step 1: stopping"):
            dp.fit(x, y, batch_size=self.B, callbacks=[later], verbose=0)
        self.assertEqual(seen, [])

    def test_non_finite_examples_are_dropped_and_counted(self):
        x, y = ktc.digits(self.N)
        x = x.copy()
        x[7] = np.nan
        dp = _compile(ktc.tiny_model(), tfdp.DPOptimizer(
            keras.optimizers.SGD(0.1), 1.0, 1.0, sampler="shuffle",
            insecure_reproducible_seed=1))
        with self.assertWarnsRegex(UserWarning, "1 examples .* not covered by epsilon"):
            dp.fit(x, y, batch_size=self.B, verbose=0)
        self.assertEqual(dp.optimizer.account.nonfinite_examples, 1)
        self.assertTrue(all(np.isfinite(w).all() for w in ktc.weights(dp)))

    def test_a_clipping_bound_whose_square_overflows_is_refused(self):
        with self.assertRaisesRegex(ValueError, "l2_norm_clip must be at most"):
            tfdp.DPOptimizer(keras.optimizers.SGD(0.1), 1e30, 1.0)
