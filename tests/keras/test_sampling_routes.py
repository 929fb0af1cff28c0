"""How `fit` draws the logical steps, what it accounts, and what it saves.

Most tests read the released steps off the model: a bias-free Dense(1) on
one-hot inputs e_i with per-example loss w·e_i has gradient e_i (norm 1),
so with σ = 0 and SGD(1) a step's update is -Σ_{i in step} e_i / B, and
-B·Δw counts how many times each example entered the step.
"""

import os
import zipfile

import h5py
import keras
import numpy as np
import tensorflow as tf

import tfdp
from tests.keras import keras_test_case as ktc
from tfdp.dp import private_step
from tfdp.keras import fit_route


SEED = 0


def _linear_loss(y_true, y_pred):
    del y_true
    return tf.reshape(y_pred, [-1])


class StepRecorder(keras.callbacks.Callback):
    """Records, per released step, how many times each example was in it."""

    def __init__(self, divisor):
        super().__init__()
        self.divisor = divisor
        self.steps = []  # int counts [N] per released step.
        self.epochs = []  # The epoch of each released step.

    def _kernel(self):
        return self.model.model.layers[-1].kernel.numpy()[:, 0].copy()

    def on_train_begin(self, logs=None):
        self._before = self._kernel()
        self._iterations = int(self.model.optimizer.iterations)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        iterations = int(self.model.optimizer.iterations)
        after = self._kernel()
        if iterations > self._iterations:
            counts = -(after - self._before) * self.divisor
            np.testing.assert_allclose(counts, np.rint(counts), atol=1e-4)
            self.steps.append(np.rint(counts).astype(int))
            self.epochs.append(self._epoch)
        else:  # Nothing released: the model must not move.
            np.testing.assert_array_equal(after, self._before)
        self._before, self._iterations = after, iterations


def _onehot(n):
    return np.eye(n, dtype="float32"), np.zeros([n], "float32")


def _linear_private(n, **dp_kwargs):
    model = keras.Sequential([
        keras.Input((n,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros"),
    ])
    kw = dict(l2_norm_clip=2.0, noise_multiplier=0.0)
    kw.update(dp_kwargs)
    dp = tfdp.make_private(model)
    dp.compile(optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(1.0), **kw), loss=_linear_loss)
    return dp


class NoExampleTwiceTest(ktc.KerasTestCase):
    """(a) N=10, batch_size=4, 2 accumulation steps, several epochs."""

    N, P, K, EPOCHS = 10, 4, 2, 6

    def _steps(self, fit_input, **dp_kwargs):
        dp = _linear_private(self.N, gradient_accumulation_steps=self.K, **dp_kwargs)
        recorder = StepRecorder(self.P * self.K)
        x, y, kw = fit_input
        dp.fit(x, y, epochs=self.EPOCHS, verbose=0, callbacks=[recorder], **kw)
        self.assertEqual(len(recorder.steps), int(dp.optimizer.iterations))
        self.assertNotEmpty(recorder.steps)
        return recorder

    def _assert_once(self, recorder):
        for counts in recorder.steps:
            self.assertLessEqual(int(counts.max()), 1, f"an example twice in a step: {counts}")
            self.assertGreaterEqual(int(counts.min()), 0)

    def test_array_routes(self):
        x, y = _onehot(self.N)
        for name, kw, dp_kwargs in [
            ("poisson", dict(batch_size=self.P), {}),
            ("shuffle", dict(batch_size=self.P), dict(sampler="shuffle")),
            ("ordered", dict(batch_size=self.P, shuffle=False), {}),
        ]:
            with self.subTest(route=name):
                recorder = self._steps((x, y, kw), **dp_kwargs)
                self._assert_once(recorder)
                if name != "poisson":
                    # N // B = 1 step of exactly B = 8 per pass.
                    self.assertLen(recorder.steps, self.EPOCHS)
                    for counts in recorder.steps:
                        self.assertEqual(int(counts.sum()), self.P * self.K)

    def test_stream_route_reshuffled_each_epoch(self):
        # Batches 4, 4, 2 per epoch in a new order each epoch: the 2-example
        # batch starts a step that must not be finished with the next
        # epoch's first batch (which may hold the same examples).
        x, y = _onehot(self.N)
        ds = (tf.data.Dataset.from_tensor_slices((x, y))
              .shuffle(self.N, seed=1, reshuffle_each_iteration=True).batch(self.P))
        recorder = self._steps((ds, None, {}))
        self._assert_once(recorder)
        self.assertEqual(recorder.epochs, list(range(self.EPOCHS)))  # One per epoch.
        for counts in recorder.steps:
            self.assertEqual(int(counts.sum()), self.P * self.K)


class AccountingTest(ktc.KerasTestCase):
    """(b) The ε each route reports."""

    N, B, SIGMA, DELTA = 64, 8, 1.0, 1e-3

    def _fit(self, x, y, **kw):
        dp = self.private(ktc.tiny_model(), noise_multiplier=self.SIGMA, delta=self.DELTA,
                          **kw.pop("dp", {}))
        logger = tfdp.callbacks.PrivacyLogger()
        history = dp.fit(x, y, epochs=2, verbose=0, callbacks=[logger], **kw)
        return dp, history

    def _epsilon(self, steps, sampler):
        return tfdp.privacy.epsilon(self.SIGMA, steps, self.DELTA, sampler=sampler,
                                    dataset_size=self.N, batch_size=self.B)

    def test_each_route(self):
        x, y = ktc.digits(self.N)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(self.B)
        cases = [
            ("poisson", (x, y), dict(batch_size=self.B)),
            ("shuffle", (x, y), dict(batch_size=self.B, dp=dict(sampler="shuffle"))),
            ("shuffle", (x, y), dict(batch_size=self.B, shuffle=False)),
            ("shuffle", (ds, None), dict(dp=dict(dataset_size=self.N))),
        ]
        for sampler, (xs, ys), kw in cases:
            with self.subTest(sampler=sampler, kw=kw):
                dp, history = self._fit(xs, ys, **kw)
                steps = int(dp.optimizer.iterations)
                self.assertEqual(steps, 2 * self.N // self.B)
                expected = self._epsilon(steps, sampler)
                self.assertAllClose(dp.epsilon(), expected)
                self.assertAllClose(history.history["epsilon"][-1], expected)
                self.assertEqual(dp.privacy_ledger().sampler, sampler)
                if sampler == "shuffle":
                    self.assertGreater(dp.epsilon(), 1.5 * self._epsilon(steps, "poisson"))

    def test_fixed_order_is_not_amplified_at_scale(self):
        # N=60000, B=256, 10 epochs, σ=1, δ=1e-5: one Gaussian per pass, ~19,
        # never the amplified figure.
        steps = 10 * (60000 // 256)
        per_pass = tfdp.privacy.epsilon(1.0, steps, 1e-5, sampler="shuffle",
                                        dataset_size=60000, batch_size=256)
        sampled = tfdp.privacy.epsilon(1.0, steps, 1e-5, sampler="poisson",
                                       dataset_size=60000, batch_size=256)
        self.assertBetween(per_pass, 18.0, 20.0)
        for route_args, dp_kwargs in [
            (dict(arrays=True, shuffle=False), {}),
            (dict(arrays=True, shuffle=True), dict(sampler="shuffle")),
            (dict(arrays=False), dict(dataset_size=60000)),
        ]:
            with self.subTest(**route_args):
                optimizer = tfdp.DPOptimizer("sgd", 1.0, 1.0, delta=1e-5, **dp_kwargs)
                fit_route.route_fit(optimizer,
                                    dataset_size=60000 if route_args["arrays"] else None,
                                    physical_batch_size=256, **route_args)
                epsilon = optimizer.ledger(steps=steps).epsilon()
                self.assertAllClose(epsilon, per_pass)
                self.assertNotAllClose(epsilon, sampled)

    def test_stream_counts_a_pass_per_epoch(self):
        # A stream whose epochs hold fewer than N // B steps (here half the
        # data): the ledger still counts one pass per epoch.
        x, y = ktc.digits(self.N)
        half = tf.data.Dataset.from_tensor_slices((x[:32], y[:32])).batch(self.B)
        dp, _ = self._fit(half, None, dp=dict(dataset_size=self.N))
        self.assertEqual(int(dp.optimizer.iterations), 8)
        self.assertEqual(int(dp.optimizer.passes), 2)
        passes_2 = self._epsilon(2 * self.N // self.B, "shuffle")
        self.assertAllClose(dp.epsilon(), passes_2)
        self.assertGreater(dp.epsilon(), self._epsilon(8, "shuffle"))

    def test_a_given_mechanism_is_the_contract(self):
        x, y = ktc.digits(self.N)
        sampler = tfdp.samplers.make_sampler("poisson", dataset_size=self.N,
                                             logical_batch_size=16)
        mechanism = tfdp.DPSGD(1.0, 1.3, sampler=sampler, delta=self.DELTA)
        with self.assertRaisesRegex(ValueError, "in the mechanism only"):
            tfdp.DPOptimizer("sgd", 1.0, 1.3, mechanism=mechanism)
        dp = tfdp.make_private(ktc.tiny_model())
        dp.compile(optimizer=tfdp.DPOptimizer("sgd", mechanism=mechanism), loss=ktc.xent())
        dp.fit(x, y, batch_size=8, epochs=1, verbose=0)  # P = 8, B = 16.
        self.assertIs(dp.optimizer.mechanism, mechanism)
        self.assertEqual(int(dp.optimizer.iterations), self.N // 16)
        self.assertAllClose(dp.epsilon(), mechanism.epsilon(self.N // 16))
        with self.assertRaisesRegex(ValueError, "another dataset size"):
            dp.fit(x[:32], y[:32], batch_size=8, epochs=1, verbose=0)

    def test_repeating_stream_is_refused(self):
        x, y = ktc.digits(16)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
        dp = self.private(ktc.tiny_model())
        with self.assertRaisesRegex(ValueError, "one pass over the data per epoch"):
            dp.fit(ds, steps_per_epoch=3, epochs=1, verbose=0)

    def test_poisson_needs_arrays_and_random_order(self):
        x, y = ktc.digits(16)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        dp = self.private(ktc.tiny_model(), sampler="poisson")
        with self.assertRaisesRegex(ValueError, "arrays.*draws the Poisson"):
            dp.fit(ds, epochs=1, verbose=0)
        with self.assertRaisesRegex(ValueError, "shuffle=False"):
            dp.fit(x, y, batch_size=8, shuffle=False, epochs=1, verbose=0)
        self.assertEqual(int(dp.optimizer.iterations), 0)


class PoissonBatchesTest(ktc.KerasTestCase):
    """(c) fit's Poisson batches."""

    N, B, P = 20, 5, 5

    def _sample(self, steps, **dp_kwargs):
        x, y = _onehot(self.N)
        dp = _linear_private(self.N, **dp_kwargs)
        recorder = StepRecorder(self.B)
        dp.fit(x, y, batch_size=self.P, steps_per_epoch=steps, epochs=1, verbose=0,
               callbacks=[recorder])
        self.assertLen(recorder.steps, steps)
        return np.stack(recorder.steps), dp

    def test_inclusion_rate_and_batch_sizes(self):
        steps, q = 400, self.B / self.N
        counts, dp = self._sample(steps)
        self.assertLessEqual(counts.max(), 1)
        rate = counts.mean(axis=0)
        self.assertAllClose(rate, np.full(self.N, q), atol=5 * np.sqrt(q * (1 - q) / steps))
        sizes = counts.sum(axis=1)
        self.assertAllClose(sizes.mean(), q * self.N,
                            atol=5 * np.sqrt(q * (1 - q) * self.N / steps))
        self.assertAllClose(sizes.var(), q * self.N * (1 - q), rtol=0.35)
        self.assertGreaterEqual(len(set(sizes.tolist())), 4)
        self.assertEqual(dp.privacy_ledger().sampler, "poisson")

    def test_steps_follow_the_secret_key_not_global_seeds(self):
        def sample(**kw):
            keras.utils.set_random_seed(0)
            tf.random.set_seed(0)
            return self._sample(30, **kw)[0]

        self.assertNotAllEqual(sample(), sample())
        with self.assertWarnsRegex(UserWarning, "INSECURE"):
            first, second = sample(insecure_reproducible_seed=5), sample(
                insecure_reproducible_seed=5)
        self.assertAllEqual(first, second)
        # They are the sampler's steps 0, 1, ... under the key's sampling sub-key.
        key = tfdp.secret_key.SecretKey.insecure_from_seed(5).derive("sampling")
        sampler = tfdp.samplers.make_sampler("poisson", dataset_size=self.N,
                                             logical_batch_size=self.B)
        masks = np.stack([sampler.mask(key, s).numpy() for s in range(30)])
        self.assertAllEqual(first, masks.astype(int))

    def test_every_epoch_takes_its_n_over_b_steps(self):
        # Poisson epochs have a random number of physical batches; Keras must
        # not cut later epochs to the first one's length.
        # With this seed the first epoch has 13 physical batches and the
        # later ones up to 31, so a cut would drop steps.
        x, y = _onehot(self.N)
        with self.assertWarnsRegex(UserWarning, "INSECURE"):
            dp = _linear_private(self.N, expected_batch_size=self.B,
                                 insecure_reproducible_seed=SEED)
        recorder = StepRecorder(self.B)
        dp.fit(x, y, batch_size=1, epochs=6, verbose=0, callbacks=[recorder])
        self.assertEqual(int(dp.optimizer.iterations), 6 * self.N // self.B)
        self.assertEqual(recorder.epochs, [e for e in range(6) for _ in range(4)])

    def test_epochs_continue_the_steps(self):
        # Two epochs and two fit calls draw new steps (keyed by the step
        # count), not the first epoch's again.
        x, y = _onehot(self.N)
        dp = _linear_private(self.N, insecure_reproducible_seed=2)
        recorder = StepRecorder(self.B)
        dp.fit(x, y, batch_size=self.P, epochs=2, verbose=0, callbacks=[recorder])
        dp.fit(x, y, batch_size=self.P, epochs=1, verbose=0, callbacks=[recorder])
        self.assertLen(recorder.steps, 12)
        key = dp.optimizer.sampling_key
        sampler = tfdp.samplers.make_sampler("poisson", dataset_size=self.N,
                                             logical_batch_size=self.B)
        masks = np.stack([sampler.mask(key, s).numpy() for s in range(12)])
        self.assertAllEqual(np.stack(recorder.steps), masks.astype(int))


class SharedAggregatorTest(ktc.KerasTestCase):
    """(d) `PrivateTrainStep` and `DPOptimizer` release bit-identical steps."""

    def test_bit_identical_updates(self):
        x, y = ktc.digits(16)
        sampler = tfdp.samplers.make_sampler("shuffle", dataset_size=16, logical_batch_size=8,
                                             physical_batch_size=4)
        with self.assertWarnsRegex(UserWarning, "INSECURE"):
            mechanism = tfdp.DPSGD(0.5, 1.5, sampler=sampler, delta=1e-3,
                                   insecure_reproducible_seed=11)
        inner = ktc.tiny_model()
        twin = keras.models.clone_model(inner)
        twin.set_weights(inner.get_weights())
        start = ktc.weights(inner)

        dp = tfdp.make_private(inner)
        dp.compile(optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(0.1), mechanism=mechanism),
                   loss=ktc.xent())
        # shuffle=False: steps [0, 8) and [8, 16), in batches of 4.
        dp.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        self.assertEqual(int(dp.optimizer.iterations), 2)

        step = private_step.PrivateTrainStep(
            twin, keras.optimizers.SGD(0.1), tfdp.keras.per_example_loss_fn(ktc.xent()),
            mechanism=mechanism,
        )
        for s in range(2):
            for j in range(2):
                rows = slice(8 * s + 4 * j, 8 * s + 4 * j + 4)
                step.accumulate(x[rows], y[rows], np.ones([4], "float32"))
            step.apply()
        moved = False
        for a, b, w0 in zip(ktc.weights(dp.model), ktc.weights(twin), start):
            self.assertAllEqual(a, b)
            moved |= bool(np.any(a != w0))
        self.assertTrue(moved)


class SavedFileTest(ktc.KerasTestCase):
    """(e) No saved file holds an un-noised partial sum."""

    def test_keras_file_mid_step_holds_no_partial_sum(self):
        x, y = ktc.digits(32)
        path = os.path.join(self.get_temp_dir(), "mid_step.keras")
        dp = self.private(ktc.tiny_model(), noise_multiplier=1.0, gradient_accumulation_steps=2)
        seen = {}

        def save_mid_step(batch, logs):
            if batch == 0:  # The first of the step's two batches.
                dp.save(path)
                seen["sums"] = [a.numpy() for a in dp.optimizer.logical_step.accumulators]
                seen["micro_step"] = int(dp.optimizer.logical_step.micro_step.numpy())

        dp.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
               callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=save_mid_step)])
        self.assertEqual(seen["micro_step"], 1)  # A partial step was in progress.
        sums = [s for s in seen["sums"] if np.any(s != 0)]
        self.assertNotEmpty(sums)
        with zipfile.ZipFile(path) as archive, archive.open("model.weights.h5") as f:
            stored = []
            with h5py.File(f, "r") as h5:
                h5.visititems(lambda name, obj: stored.append(np.array(obj))
                              if isinstance(obj, h5py.Dataset) else None)
        self.assertNotEmpty(stored)
        for partial in sums:
            for array in stored:
                if array.shape == partial.shape:
                    self.assertFalse(np.allclose(array, partial),
                                     "an un-noised partial sum is in the .keras file")
        loaded = keras.models.load_model(path)
        self.assertEqual(int(loaded.optimizer.iterations), 0)
        loaded.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        self.assertEqual(int(loaded.optimizer.iterations), 2)

    def test_saved_files_hold_no_key(self):
        # The noise and sampling key is a graph constant, never a variable or
        # a config entry: no `.keras` file or weights file may hold it. An
        # insecure seed makes the key known to the test, so it can look.
        from tfdp.secret_key import SecretKey

        x, y = ktc.digits(32)
        with self.assertWarnsRegex(UserWarning, "INSECURE"):
            key = SecretKey.insecure_from_seed(11)
            dp = self.private(ktc.tiny_model(), noise_multiplier=1.0,
                              insecure_reproducible_seed=11)
        dp.fit(x, y, batch_size=8, epochs=1, verbose=0)
        words = [np.int64(w) for w in (*key.words, *key.derive("noise"),
                                       *key.derive("sampling"))]
        patterns = [w.tobytes() for w in words] + [str(int(w)).encode() for w in words]
        directory = self.get_temp_dir()
        dp.save(os.path.join(directory, "model.keras"))
        dp.save_weights(os.path.join(directory, "model.weights.h5"))
        found = []
        for name in ("model.keras", "model.weights.h5"):
            with open(os.path.join(directory, name), "rb") as f:
                blob = f.read()
            if name.endswith(".keras"):
                with zipfile.ZipFile(os.path.join(directory, name)) as archive:
                    blob += b"".join(archive.read(n) for n in archive.namelist())
            found += [(name, p) for p in patterns if p in blob]
        self.assertEqual(found, [])
