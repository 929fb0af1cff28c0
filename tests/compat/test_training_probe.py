"""The TF-Privacy compat route runs the training probe before its first update."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tests.dp.test_training_probe import AddsRowInto
from tests.dp.test_training_probe import AddsRowWhenBright
from tests.dp.test_training_probe import CentresNonNegative
from tests.dp.test_training_probe import MixesFrom
from tests.dp.test_training_probe import RunningMean
from tests.dp.test_training_probe import batch_mean_xent
from tfdp.compat import tensorflow_privacy


def _data(n=16):
    x = tf.random.stateless_normal([n, 6, 6, 1], seed=[0, 1]).numpy()
    return x, (np.arange(n) % 3).astype("int32")


def _layers(mixing):
    """A small Sequential stack; `mixing` names a layer to put in its middle."""
    layers = [keras.Input((6, 6, 1)), keras.layers.Flatten(),
              keras.layers.Dense(5, activation="tanh")]
    if mixing:
        layers.append({True: MixesFrom(4, name="mixes_from_4"),
                       "adds_row": AddsRowInto(0, "middle", name="adds_row"),
                       "running": RunningMean(name="running")}[mixing])
    return layers + [keras.layers.Dense(3)]


def _xent():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def _fit_refused(model, pattern):
    before = [v.numpy() for v in model.trainable_variables]
    x, y = _data()
    with pytest.raises(ValueError, match=pattern):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())


@pytest.mark.parametrize("mixing, loss, pattern", [
    (True, _xent, "Layer 'mixes_from_4' mixes examples"),
    (False, lambda: batch_mean_xent, "loss 'batch_mean_xent' mixes examples"),
])
def test_private_model_with_a_tf_privacy_optimizer(mixing, loss, pattern):
    model = tfdp.make_private(keras.Sequential(_layers(mixing)))
    model.compile(optimizer=tensorflow_privacy.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.1), loss=loss())
    _fit_refused(model, pattern)


@pytest.mark.parametrize("mixing, loss, pattern", [
    (True, _xent, "Layer 'mixes_from_4' mixes examples"),
    ("adds_row", _xent, "Layer 'adds_row' mixes examples"),
    ("running", _xent, "Layer 'running' writes variable"),
    (False, lambda: batch_mean_xent, "loss 'batch_mean_xent' mixes examples"),
])
def test_dp_sequential(mixing, loss, pattern):
    model = tensorflow_privacy.DPSequential(l2_norm_clip=1.0, noise_multiplier=0.0,
                                            layers=_layers(mixing))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())
    _fit_refused(model, pattern)


@pytest.mark.parametrize("layer", [CentresNonNegative, AddsRowWhenBright])
def test_dp_sequential_mixing_only_for_some_input_values(layer):
    # On the inputs, which are standard normal here: the probe's ranges
    # trigger what this training would not.
    model = tensorflow_privacy.DPSequential(
        l2_norm_clip=1.0, noise_multiplier=0.0,
        layers=[keras.Input((6, 6, 1)), layer(name="value_mixing"), keras.layers.Flatten(),
                keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_xent())
    _fit_refused(model, "Layer 'value_mixing' mixes examples")


class _MixUpSequential(tensorflow_privacy.DPSequential):
    """TF-Privacy's DPSequential with MixUp across the batch in its train_step."""

    def train_step(self, data):
        x = data[0]
        weight = tf.random.uniform([])
        x = weight * x + (1.0 - weight) * tf.reverse(x, axis=[0])
        return super().train_step((x,) + tuple(data[1:]))


def test_dp_sequential_whose_train_step_mixes_the_batch():
    model = _MixUpSequential(l2_norm_clip=1.0, noise_multiplier=0.0, layers=_layers(False))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_xent())
    _fit_refused(model, "_MixUpSequential.train_step mixes examples")
    assert int(model.optimizer.iterations) == 0
