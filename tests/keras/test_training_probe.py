"""Keras `fit` runs the training probe before its first update.

At the fit batch size, with the compiled loss: a layer that mixes examples
only from 4 rows on, and a loss that is not per-example, are refused, and
the weights stay as they were.
"""

import keras
import tensorflow as tf

import tfdp
from tests.dp.test_training_probe import batch_mean_xent
from tests.dp.test_training_probe import mixing_model
from tests.dp.test_training_probe import plain_model
from tests.keras import keras_test_case as ktc


def _data(n=16):
    x = tf.random.stateless_normal([n, 6, 6, 1], seed=[0, 1]).numpy()
    y = (tf.range(n) % 3).numpy().astype("int32")
    return x, y


def _private(model, loss, method="auto"):
    dp = tfdp.make_private(model)
    dp.compile(optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
                                          noise_multiplier=0.0, method=method,
                                          insecure_reproducible_seed=0), loss=loss)
    return dp


class KerasTrainingProbeTest(ktc.KerasTestCase):

    def _refused(self, dp, pattern, data):
        before = ktc.weights(dp)
        with self.assertRaisesRegex(ValueError, pattern):
            if isinstance(data, tf.data.Dataset):
                dp.fit(data, epochs=1, verbose=0)
            else:
                dp.fit(*data, batch_size=8, epochs=1, verbose=0)
        self.assertEqual(int(dp.optimizer.iterations), 0)
        self.assertWeightsClose(ktc.weights(dp), before, rtol=0, atol=0)

    def test_layer_mixing_from_four_rows_refused(self):
        for method in ("auto", "ghost", "naive"):
            self._refused(_private(mixing_model(4), ktc.xent(), method),
                          "Layer 'mixes_from_4' mixes examples", _data())

    def test_layer_mixing_at_the_fit_batch_size_refused_on_a_stream(self):
        # Mixing from 8 rows: a dataset of batches of 8 is probed at 8 rows.
        x, y = _data()
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        dp = _private(mixing_model(8), ktc.xent())
        self._refused(dp, "Layer 'mixes_from_8' mixes examples", ds)

    def test_batch_mean_loss_refused(self):
        self._refused(_private(plain_model(), batch_mean_xent),
                      "loss 'batch_mean_xent' mixes examples", _data())

    def test_per_example_model_trains(self):
        dp = _private(plain_model(), ktc.xent())
        x, y = _data()
        dp.fit(x, y, batch_size=8, epochs=1, verbose=0)
        self.assertGreater(int(dp.optimizer.iterations), 0)


if __name__ == "__main__":
    tf.test.main()
