"""Keras `fit` runs the training probe before its first update.

At the fit batch size, with the compiled loss: a layer that mixes examples
only from 4 rows on, one that adds any row into another (also across users
at user level), one that mixes only for some input values or on half of its
random draws, one that writes non-trainable state from the batch, and a
loss that is not per-example, are refused, and the weights stay as they were;
per-example random noise trains.
"""

import keras
import tensorflow as tf

import tfdp
from tests.dp.test_training_probe import AddsRowInto
from tests.dp.test_training_probe import AddsRowWhenBright
from tests.dp.test_training_probe import CentresNonNegative
from tests.dp.test_training_probe import GeneratorNoise
from tests.dp.test_training_probe import MixesOnHalfTheDraws
from tests.dp.test_training_probe import RunningMean
from tests.dp.test_training_probe import StatsAfterOutput
from tests.dp.test_training_probe import batch_mean_xent
from tests.dp.test_training_probe import dense_model
from tests.dp.test_training_probe import input_model
from tests.dp.test_training_probe import mixing_model
from tests.dp.test_training_probe import plain_model
from tests.keras import keras_test_case as ktc


def _data(n=16):
    x = tf.random.stateless_normal([n, 6, 6, 1], seed=[0, 1]).numpy()
    y = (tf.range(n) % 3).numpy().astype("int32")
    return x, y


def _private(model, loss, method="auto", **kwargs):
    dp = tfdp.make_private(model)
    dp.compile(optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
                                          noise_multiplier=0.0, method=method,
                                          insecure_reproducible_seed=0, **kwargs), loss=loss)
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

    def test_a_middle_or_random_row_added_into_row_0_refused(self):
        for source in ("middle", None):
            self._refused(_private(dense_model(AddsRowInto(0, source, name="adds_row")),
                                   ktc.xent()), "Layer 'adds_row' mixes examples", _data())

    def test_mixing_only_for_some_input_values_refused(self):
        # The data is standard normal: neither layer would fire in this
        # training, and both are refused, on arrays and on a stream.
        x, y = _data()
        for layer in (CentresNonNegative(name="centres_non_negative"),
                      AddsRowWhenBright(name="adds_row_when_bright")):
            with self.subTest(layer=layer.name):
                self._refused(_private(input_model(layer), ktc.xent()),
                              f"Layer '{layer.name}' mixes examples", (x, y))
        stream = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        self._refused(_private(input_model(CentresNonNegative(name="centres")), ktc.xent()),
                      "Layer 'centres' mixes examples", stream)

    def test_random_mixing_refused_and_random_per_example_noise_trains(self):
        self._refused(_private(dense_model(MixesOnHalfTheDraws(1, name="half_the_draws")),
                               ktc.xent()), "Layer 'half_the_draws' mixes examples", _data())
        dp = _private(dense_model(GeneratorNoise(name="noise")), ktc.xent())
        x, y = _data()
        dp.fit(x, y, batch_size=8, epochs=1, verbose=0)
        self.assertGreater(int(dp.optimizer.iterations), 0)

    def test_a_row_of_another_user_refused_at_user_level(self):
        x, y = _data()
        dp = _private(dense_model(AddsRowInto(0, 2, name="cross_user")), ktc.xent(),
                      privacy_unit="user", max_examples_per_user=2)
        before = ktc.weights(dp)
        with self.assertRaisesRegex(ValueError, "Layer 'cross_user' mixes examples"):
            dp.fit(x, y, user_ids=tf.range(16).numpy() // 2, batch_size=8, epochs=1,
                   verbose=0)
        self.assertWeightsClose(ktc.weights(dp), before, rtol=0, atol=0)

    def test_state_written_from_the_batch_refused(self):
        for layer in (RunningMean(name="running"),
                      StatsAfterOutput(name="leaky_bn", trainable=False)):
            dp = _private(dense_model(layer), ktc.xent())
            state = [v.numpy() for v in dp.non_trainable_variables]
            self._refused(dp, f"Layer '{layer.name}' writes variable", _data())
            for b, v in zip(state, dp.non_trainable_variables):
                self.assertAllEqual(b, v.numpy())

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
