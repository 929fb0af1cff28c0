"""A stream whose pass holds more than N examples, or a copy, is refused.

The per-pass bound of a streamed input needs each example at most once per
pass; `.repeat(2)` before `.batch()` breaks it (both copies of an example can
land in one logical step). `fit` counts the passes against `dataset_size`,
and compares each pass's rows by content hash, so that a pass of N rows
holding N / 2 examples twice is refused too; arrays with copies are refused
before any step.
"""

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tests.keras import keras_test_case as ktc

N, P = 32, 8


def _compiled(k=1, **kwargs):
    dp = tfdp.make_private(ktc.tiny_model())
    dp.compile(
        optimizer=tfdp.DPOptimizer(
            keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=0.0,
            dataset_size=N, gradient_accumulation_steps=k, insecure_reproducible_seed=0,
            **kwargs,
        ),
        loss=ktc.xent(),
    )
    dp.build((None, 8, 8, 1))
    return dp


class StreamPassTest(ktc.KerasTestCase):

    def setUp(self):
        super().setUp()
        self.x, self.y = ktc.digits(N)

    def _stream(self, repeat=1, take=None):
        ds = tf.data.Dataset.from_tensor_slices((self.x, self.y))
        if take is not None:
            ds = ds.take(take)
        return ds.repeat(repeat).shuffle(64, seed=0).batch(P)

    def test_repeated_stream_refused_before_its_first_update(self):
        for k in (1, 2):
            dp = _compiled(k)
            before = ktc.weights(dp)
            with self.assertRaisesRegex(ValueError, r"more than dataset_size=32 examples \(64\)"):
                dp.fit(self._stream(repeat=2), epochs=1, verbose=0)
            self.assertEqual(int(dp.optimizer.iterations), 0)
            self.assertWeightsClose(ktc.weights(dp), before, rtol=0, atol=0)

    def test_a_shorter_or_exact_pass_is_fine(self):
        for take in (N, N - 8):
            dp = _compiled()
            dp.fit(self._stream(take=take), epochs=2, verbose=0)
            self.assertEqual(int(dp.optimizer.iterations), 2 * take // P)

    def test_a_later_pass_above_n_releases_nothing_more(self):
        # A stream whose second epoch holds 10 + 10 + 10 + 10 = 40 > N
        # examples, which the up-front count (of a first-epoch pass) cannot
        # see. The train
        # step refuses the batch that goes above N: the first epoch's 4
        # steps and the second's first 3 stand, the 4th is never applied.
        state = {"epoch": 0}
        x, y = ktc.digits(40)  # Distinct rows: no copies, only too many.

        def batches():
            rows = P if state["epoch"] == 0 else 10
            for i in range(4):
                j = i * rows
                yield x[j:j + rows], y[j:j + rows]

        ds = tf.data.Dataset.from_generator(batches, output_signature=(
            tf.TensorSpec((None, 8, 8, 1), tf.float32), tf.TensorSpec((None,), tf.int32)))

        class Epoch(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                state["epoch"] = epoch

        dp = _compiled(expected_batch_size=P)
        with self.assertRaisesRegex(ValueError, r"\(40\).*rest of the pass were not applied"):
            dp.fit(ds, epochs=2, verbose=0, callbacks=[Epoch()])
        self.assertEqual(int(dp.optimizer.iterations), 7)

    def test_a_pass_holding_its_examples_twice_is_refused(self):
        # N rows, each of N // 2 examples twice (shuffled after `.repeat(2)`,
        # or a generator's batches): the count of the pass is N, but copies
        # sit in one pass. Refused at the first batch that holds a copy,
        # before its step is released.
        dp = _compiled(expected_batch_size=P)
        with self.assertRaisesRegex(ValueError, r"rows are exact duplicates of other rows in "
                                    r"one pass.*Deduplicate the data.*or train at user level"):
            dp.fit(self._stream(take=N // 2, repeat=2), epochs=1, verbose=0)
        released = int(dp.optimizer.iterations)
        self.assertLess(released, N // P)

        def twice():
            for i in range(0, N // 2, P // 2):
                rows = slice(i, i + P // 2)
                yield (np.concatenate([self.x[rows]] * 2), np.concatenate([self.y[rows]] * 2))

        before = ktc.weights(dp)
        with self.assertRaisesRegex(ValueError, r"4 rows are exact duplicates.*Received: 4 "
                                    r"duplicate rows among 8"):
            dp.fit(twice(), epochs=1, verbose=0)
        self.assertEqual(int(dp.optimizer.iterations), released)
        self.assertWeightsClose(ktc.weights(dp), before, rtol=0, atol=0)

    def test_arrays_with_copies_are_refused_before_any_step(self):
        x = np.concatenate([self.x[:N // 2]] * 2)
        y = np.concatenate([self.y[:N // 2], (self.y[:N // 2] + 1) % 10])  # Other labels.
        for sampler in ("poisson", "shuffle"):
            dp = _compiled(sampler=sampler)
            with self.assertRaisesRegex(ValueError, r"fit's x: 16 rows are exact duplicates"
                                        r".*Nothing was trained.*Received: 16 duplicate rows "
                                        r"among 32"):
                dp.fit(x, y, batch_size=P, epochs=1, verbose=0)
            self.assertEqual(int(dp.optimizer.iterations), 0)

    def test_kept_copies_train_and_warn_with_their_group_epsilon(self):
        # Distinct records with one content: `duplicates="keep"` trains on
        # them, arrays and streams alike, and names the count and the group.
        x = np.concatenate([self.x[:N // 2]] * 2)
        y = np.concatenate([self.y[:N // 2], (self.y[:N // 2] + 1) % 10])
        dp = tfdp.make_private(ktc.tiny_model())
        dp.compile(optimizer=tfdp.DPOptimizer(
            keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=1.0,
            dataset_size=N, insecure_reproducible_seed=0), loss=ktc.xent())
        with self.assertWarnsRegex(UserWarning, r"fit's x: kept 16 rows that repeat another "
                                   r"row's content among 32.*largest group holds 2.*Planned: "
                                   r"were the largest group of 2 identical rows one record.*"
                                   r"epsilon=.*delta="):
            dp.fit(x, y, batch_size=P, epochs=1, verbose=0, duplicates="keep")
        self.assertGreater(int(dp.optimizer.iterations), 0)
        stream = _compiled(expected_batch_size=P)
        with self.assertWarnsRegex(UserWarning, r"a pass over the training stream: kept \d+ "
                                   r"rows.*So far: were the largest group of 2"):
            stream.fit(self._stream(take=N // 2, repeat=2), epochs=1, verbose=0,
                       duplicates="keep")
        self.assertEqual(int(stream.optimizer.iterations), N // P)
        with self.assertRaisesRegex(ValueError, "duplicates must be one of"):
            stream.fit(self._stream(), epochs=1, verbose=0, duplicates="drop")

    def test_xla_stream_fit_is_refused(self):
        dp = tfdp.make_private(ktc.tiny_model())
        dp.compile(optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
                                              noise_multiplier=0.0, dataset_size=N),
                   loss=ktc.xent(), jit_compile=True)
        with self.assertRaisesRegex(ValueError, "jit_compile=False"):
            dp.fit(self._stream(), epochs=1, verbose=0)

    def test_zero_weight_rows_are_not_examples(self):
        # Padding rows (weight 0) do not count: 32 real examples in 40 rows.
        x = np.concatenate([self.x, np.zeros((8, 8, 8, 1), "float32")])
        y = np.concatenate([self.y, np.zeros(8, "int32")])
        w = np.concatenate([np.ones(N, "float32"), np.zeros(8, "float32")])
        ds = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(P)
        dp = _compiled()
        dp.fit(ds, epochs=1, verbose=0)
        self.assertEqual(int(dp.optimizer.iterations), 5)


if __name__ == "__main__":
    tf.test.main()
