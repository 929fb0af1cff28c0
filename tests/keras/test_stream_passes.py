"""A stream whose pass holds more than N examples is refused, before any update.

The per-pass bound of a streamed input needs each example at most once per
pass; `.repeat(2)` before `.batch()` breaks it (both copies of an example can
land in one logical step). `fit` counts the passes against `dataset_size`.
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
        # A stream whose second epoch holds 10 + 10 + 10 + 8 = 38 > N
        # examples, which the up-front count (of a first-epoch pass) cannot
        # see. The train
        # step refuses the batch that goes above N: the first epoch's 4
        # steps and the second's first 3 stand, the 4th is never applied.
        state = {"epoch": 0}

        def batches():
            rows = P if state["epoch"] == 0 else 10
            for i in range(4):
                j = i * P
                yield self.x[j:j + rows], self.y[j:j + rows]

        ds = tf.data.Dataset.from_generator(batches, output_signature=(
            tf.TensorSpec((None, 8, 8, 1), tf.float32), tf.TensorSpec((None,), tf.int32)))

        class Epoch(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                state["epoch"] = epoch

        dp = _compiled(expected_batch_size=P)
        with self.assertRaisesRegex(ValueError, r"\(38\).*rest of the pass were not applied"):
            dp.fit(ds, epochs=2, verbose=0, callbacks=[Epoch()])
        self.assertEqual(int(dp.optimizer.iterations), 7)

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
