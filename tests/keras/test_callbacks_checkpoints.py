"""PrivacyLogger, PrivacyBudget, and the step count across checkpoints."""

import glob
import os

import keras

import tfdp
from tests.keras import keras_test_case as ktc

N = 64
B = 8


class Interrupt(keras.callbacks.Callback):
    """Raises once, at (epoch, batch)."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


class CallbacksTest(ktc.KerasTestCase):
    def _model(self, **dp_kwargs):
        keras.utils.set_random_seed(0)
        kw = dict(noise_multiplier=1.0, delta=1e-3)
        kw.update(dp_kwargs)
        return self.private(ktc.tiny_model(), **kw)

    def _expected_epsilon(self, steps, batch=B, sigma=1.0, sampler="poisson"):
        return tfdp.privacy.epsilon(
            sigma, steps, 1e-3, sampler=sampler, dataset_size=N, batch_size=batch
        )

    def test_logger_puts_epsilon_in_logs_and_tensorboard(self):
        x, y = ktc.digits(N)
        dp = self._model()
        log_dir = self.get_temp_dir()
        logger = tfdp.callbacks.PrivacyLogger(log_dir=log_dir)
        batch_eps = []
        spy = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda b, logs: batch_eps.append(logs.get("epsilon")))
        history = dp.fit(x, y, batch_size=B, epochs=2, verbose=0, callbacks=[logger, spy])
        self.assertEqual(int(dp.optimizer.iterations), 16)
        self.assertAllClose(history.history["epsilon"],
                            [self._expected_epsilon(8), self._expected_epsilon(16)])
        # Poisson steps span one or more physical batches each.
        self.assertGreaterEqual(len(batch_eps), 16)
        self.assertAllClose(batch_eps[-1], self._expected_epsilon(16))
        self.assertAllClose(dp.epsilon(), self._expected_epsilon(16))
        self.assertNotEmpty(glob.glob(os.path.join(log_dir, "train", "events.out.*")))

    def test_ledger_reflects_the_run(self):
        x, y = ktc.digits(N)
        dp = self._model(gradient_accumulation_steps=2)
        dp.fit(x, y, batch_size=B, epochs=1, verbose=0)
        ledger = dp.privacy_ledger()
        self.assertEqual(ledger.steps, 4)
        self.assertEqual(ledger.batch_size, 2 * B)
        self.assertEqual(ledger.dataset_size, N)
        self.assertEqual(ledger.sampler, "poisson")
        self.assertEqual(ledger.delta, 1e-3)

    def test_budget_stops_at_batch_granularity(self):
        for k in (1, 2):
            with self.subTest(k=k):
                x, y = ktc.digits(N)
                dp = self._model(gradient_accumulation_steps=k, noise_multiplier=3.0)
                target = self._expected_epsilon(5, batch=k * B, sigma=3.0) + 1e-9
                budget = tfdp.callbacks.PrivacyBudget(target, verbose=0)
                dp.fit(x, y, batch_size=B, epochs=10, verbose=0, callbacks=[budget])
                self.assertEqual(budget.max_steps, 5)
                self.assertEqual(int(dp.optimizer.iterations), 5)  # Mid-epoch.
                self.assertLessEqual(dp.epsilon(), target)
                # A further fit with the budget spent takes no update.
                before = ktc.weights(dp)
                dp.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[budget])
                self.assertEqual(int(dp.optimizer.iterations), 5)
                self.assertWeightsClose(ktc.weights(dp), before, rtol=0, atol=0)
                # Without the budget, training goes on.
                dp.fit(x, y, batch_size=B, epochs=1, verbose=0)
                self.assertEqual(int(dp.optimizer.iterations), 5 + 8 // k)

    def test_backup_and_restore_resumes_steps_and_epsilon(self):
        # (save_freq, interrupt (epoch, batch), steps restored, total steps).
        # A batch-level backup resumes at the start of the saved epoch with
        # the saved steps, so the epoch's batches are taken again and count:
        # steps 12..27 of the fixed order touch 4 passes.
        cases = [("epoch", (1, 3), 8, 24), (4, (1, 6), 12, 28)]
        for save_freq, at, restored, total in cases:
            with self.subTest(save_freq=save_freq):
                x, y = ktc.digits(N)
                backup = os.path.join(self.get_temp_dir(), f"backup_{save_freq}")
                dp = self._model()
                with self.assertRaisesRegex(RuntimeError, "interrupted"):
                    dp.fit(x, y, batch_size=B, epochs=3, verbose=0, shuffle=False, callbacks=[
                        keras.callbacks.BackupAndRestore(backup, save_freq=save_freq),
                        Interrupt(*at)])
                # A fresh process: new model and optimizer, same backup dir.
                resumed = self._model()
                logger = tfdp.callbacks.PrivacyLogger()
                seen = []
                spy = keras.callbacks.LambdaCallback(
                    on_train_begin=lambda logs: seen.append(
                        int(resumed.optimizer.iterations)))
                resumed.fit(x, y, batch_size=B, epochs=3, verbose=0, shuffle=False, callbacks=[
                    keras.callbacks.BackupAndRestore(backup, save_freq=save_freq),
                    spy, logger])
                self.assertEqual(seen, [restored])
                self.assertEqual(int(resumed.optimizer.iterations), total)
                self.assertEqual(logger.history[-1][1], total)
                self.assertAllClose(logger.history[-1][2],
                                    self._expected_epsilon(total, sampler="shuffle"))

    def test_model_checkpoint_round_trip(self):
        x, y = ktc.digits(N)
        dp = self._model(gradient_accumulation_steps=2)
        path = os.path.join(self.get_temp_dir(), "model.keras")
        dp.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[
            keras.callbacks.ModelCheckpoint(path)])
        loaded = keras.models.load_model(path)
        self.assertIsInstance(loaded, tfdp.DPModel)
        self.assertIsInstance(loaded.optimizer, tfdp.DPOptimizer)
        self.assertEqual(loaded.optimizer.get_config(), dp.optimizer.get_config())
        self.assertEqual(int(loaded.optimizer.iterations), 4)
        self.assertAllClose(loaded.predict(x, verbose=0), dp.predict(x, verbose=0))
        # Weights-only checkpoints carry the step count too.
        wpath = os.path.join(self.get_temp_dir(), "w.weights.h5")
        dp.save_weights(wpath)
        fresh = self._model(gradient_accumulation_steps=2)
        fresh.optimizer.build(fresh.trainable_variables)
        fresh.load_weights(wpath)
        self.assertEqual(int(fresh.optimizer.iterations), 4)
        loaded.fit(x, y, batch_size=B, epochs=1, verbose=0)
        self.assertEqual(int(loaded.optimizer.iterations), 8)

    def test_callbacks_need_a_private_model(self):
        x, y = ktc.digits(N)
        model = ktc.tiny_model()
        model.compile(optimizer="sgd", loss=ktc.xent())
        with self.assertRaisesRegex(ValueError, "make_private"):
            model.fit(x, y, epochs=1, verbose=0,
                      callbacks=[tfdp.callbacks.PrivacyLogger()])

    def test_dataset_size_required_for_datasets(self):
        import tensorflow as tf

        x, y = ktc.digits(N)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
        dp = self._model(expected_batch_size=B)
        with self.assertRaisesRegex(ValueError, "dataset_size"):
            dp.fit(ds, epochs=1, verbose=0, shuffle=False,
                   callbacks=[tfdp.callbacks.PrivacyLogger()])
        dp.fit(ds, epochs=1, verbose=0, shuffle=False,
               callbacks=[tfdp.callbacks.PrivacyLogger(dataset_size=N)])
