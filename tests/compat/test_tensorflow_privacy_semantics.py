"""TF-Privacy's own tests' behaviour on tfdp.compat: outputs, regularizers, custom loops."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.compat import tensorflow_privacy


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(0)


def _two_class_data():
    x = np.array([[2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0]], np.float32)
    y = np.array([[0], [1], [1], [0]])
    return x, y


def _two_layer_model(outputs, num_microbatches=None):
    return tensorflow_privacy.DPSequential(
        l2_norm_clip=1.0e9, noise_multiplier=0.0, num_microbatches=num_microbatches,
        layers=[keras.Input((2,)),
                keras.layers.Dense(4, use_bias=False, kernel_initializer="zeros"),
                keras.layers.Dense(outputs)],
    )


@pytest.mark.parametrize("num_microbatches", [None, 2])
def test_one_logit_under_sparse_crossentropy_is_refused(num_microbatches):
    # One logit is one class: label 1 is out of range. TF-Privacy's test only
    # passes because its default use_xla=True compiles the step with XLA,
    # which skips the range check and trains on a NaN loss.
    x, y = _two_class_data()
    model = _two_layer_model(1, num_microbatches)
    model.compile(optimizer=keras.optimizers.SGD(1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(tf.errors.InvalidArgumentError, match="outside the valid range"):
        model.fit(x, y, epochs=1, batch_size=4, shuffle=False, verbose=0)


@pytest.mark.parametrize("num_microbatches", [None, 1, 2])
def test_multi_dimensional_output_trains(num_microbatches):
    x, y = _two_class_data()
    model = _two_layer_model(2, num_microbatches)
    model.compile(optimizer=keras.optimizers.SGD(1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, epochs=1, batch_size=4, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)
