"""Keras `fit` runs the training probe before its first update.

At the fit batch size, with the compiled loss: a layer that mixes examples
only from 4 rows on, one that adds any row into another (also across users
at user level), one that mixes only for some input values or on half of its
random draws, one that writes non-trainable state from the batch, and a
loss that is not per-example, are refused, and the weights stay as they were;
per-example random noise trains.

A `DPModel` subclass whose own `train_step` mixes the batch before the private
update (MixUp, also on half of its random draws) or hands one example over
twice (the batch and a flipped copy) is refused naming the train_step, on
arrays and on a stream; one that flips each row by its own draw and scales x
trains. A stream warns once that its pipeline is not checked.
"""

import warnings

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


class MixUp(tfdp.DPModel):
    """MixUp across the batch in `train_step`: each row mixed with a shuffled partner."""

    def train_step(self, data):
        x = data[0]
        weight = tf.random.uniform([])
        partner = tf.random.shuffle(tf.range(tf.shape(x)[0]))
        x = weight * x + (1.0 - weight) * tf.gather(x, partner)
        return super().train_step((x,) + tuple(data[1:]))


class MixUpHalfTheTime(tfdp.DPModel):
    """MixUp with the reversed batch on half of the steps, drawn from a tf.random.Generator."""

    def __init__(self, model, seed=0, **kwargs):
        super().__init__(model, **kwargs)
        self.generator = tf.random.Generator.from_seed(seed)

    def train_step(self, data):
        x = data[0]
        coin, weight = tf.unstack(self.generator.uniform([2]))
        mixed = weight * x + (1.0 - weight) * tf.reverse(x, axis=[0])
        return super().train_step((tf.cond(coin < 0.5, lambda: mixed, lambda: x),)
                                  + tuple(data[1:]))


class WithFlippedCopy(tfdp.DPModel):
    """Hands the batch and a flipped copy of it to the update: each example twice."""

    def train_step(self, data):
        x, y, weights = data[:3]
        return super().train_step((tf.concat([x, tf.reverse(x, axis=[2])], 0),
                                   tf.concat([y, y], 0), tf.concat([weights, weights], 0))
                                  + tuple(data[3:]))


class FlipsEachRow(tfdp.DPModel):
    """Flips each row by its own random draw and scales x: per-example."""

    def train_step(self, data):
        x = data[0]
        flip = tf.random.uniform([tf.shape(x)[0], 1, 1, 1]) < 0.5
        x = 0.5 * tf.where(flip, tf.reverse(x, axis=[2]), x)
        return super().train_step((x,) + tuple(data[1:]))


def _data(n=16):
    x = tf.random.stateless_normal([n, 6, 6, 1], seed=[0, 1]).numpy()
    y = (tf.range(n) % 3).numpy().astype("int32")
    return x, y


def _private(model, loss, method="auto", wrapper=tfdp.make_private, **kwargs):
    dp = wrapper(model)
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

    def test_a_train_step_that_mixes_the_batch_is_refused_naming_it(self):
        x, y = _data()
        stream = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        for wrapper, data in ((MixUp, (x, y)), (MixUp, stream), (MixUpHalfTheTime, (x, y))):
            with self.subTest(train_step=wrapper.__name__, stream=data is stream):
                dp = _private(plain_model(), ktc.xent(), wrapper=wrapper,
                              dataset_size=16 if data is stream else None)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # The stream's warning.
                    self._refused(dp, f"{wrapper.__name__}.train_step mixes examples", data)
        # Whatever the generator's seed: each trial draws from its own state.
        for seed in range(1, 4):
            with self.subTest(seed=seed):
                self._refused(
                    _private(plain_model(), ktc.xent(),
                             wrapper=lambda m, seed=seed: MixUpHalfTheTime(m, seed)),
                    "MixUpHalfTheTime.train_step mixes examples", (x, y))

    def test_a_train_step_that_hands_an_example_over_twice_is_refused(self):
        self._refused(_private(plain_model(), ktc.xent(), wrapper=WithFlippedCopy),
                      "WithFlippedCopy.train_step hands one example to the private update "
                      "in more than one clipping unit", _data())

    def test_a_per_example_train_step_trains(self):
        dp = _private(plain_model(), ktc.xent(), wrapper=FlipsEachRow)
        x, y = _data()
        dp.fit(x, y, batch_size=8, epochs=1, verbose=0)
        self.assertGreater(int(dp.optimizer.iterations), 0)
        # A subclass that keeps DPModel's train_step is not replayed.
        self.assertIs(type("Plain", (tfdp.DPModel,), {}).train_step, tfdp.DPModel.train_step)

    def test_a_stream_warns_once_that_its_pipeline_is_not_checked(self):
        x, y = _data()
        stream = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        dp = _private(plain_model(), ktc.xent(), dataset_size=16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dp.fit(x, y, batch_size=8, epochs=1, verbose=0)
            dp.fit(stream, epochs=1, verbose=0)
            dp.fit(stream, epochs=1, verbose=0)
        said = [str(w.message) for w in caught if "MixUp, CutMix" in str(w.message)]
        self.assertLen(said, 1)
        self.assertIn("pipeline", said[0])

    def test_per_example_model_trains(self):
        dp = _private(plain_model(), ktc.xent())
        x, y = _data()
        dp.fit(x, y, batch_size=8, epochs=1, verbose=0)
        self.assertGreater(int(dp.optimizer.iterations), 0)


if __name__ == "__main__":
    tf.test.main()
