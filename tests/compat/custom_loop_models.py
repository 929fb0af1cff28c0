"""TF-Privacy's custom-loop tests' variables, as Keras models a custom loop can declare.

TF-Privacy's tests differentiate losses of bare variables and constants; a
tfdp custom loop trains the variables of a declared Keras model (the
training probe needs its layers and loss). These models hold the same
variables and give the same per-example losses, with the constants as
inputs.
"""

import keras
import numpy as np
import tensorflow as tf


class Offsets(keras.layers.Layer):
    """Each row minus the concatenated weights (TF-Privacy's `var0`, `var1`, ...)."""

    def __init__(self, values, **kwargs):
        super().__init__(**kwargs)
        self.values = [np.asarray(v, "float32") for v in values]

    def build(self, input_shape):
        self.offsets = [
            self.add_weight(shape=v.shape, initializer=keras.initializers.Constant(v),
                            name=f"var{i}")
            for i, v in enumerate(self.values)
        ]

    def call(self, x):
        return x - tf.concat(self.offsets, axis=0)


def offsets_model(*values):
    """`(model, variables)`: `model(x) = x - concat(values)`, one weight per value."""
    width = sum(int(np.size(v)) for v in values)
    model = keras.Sequential([keras.Input((width,)), Offsets(values, name="offsets")])
    return model, model.trainable_variables


def half_squared_norm(y_true, y_pred):
    """0.5·‖prediction‖² per row: with `offsets_model`, 0.5·‖x − var‖², whose gradient is var − x."""
    del y_true
    return 0.5 * tf.reduce_sum(tf.square(y_pred), axis=1)


def squared_norm(y_true, y_pred):
    """‖prediction‖² per row."""
    del y_true
    return tf.reduce_sum(tf.square(y_pred), axis=1)


def zero_loss(y_true, y_pred):
    """0 per row, connected to the weights (zero gradients)."""
    del y_true
    return 0.0 * tf.reduce_sum(y_pred, axis=1)


def linear_model(weights, bias):
    """`(model, (kernel, bias))`: `model(x) = x @ weights.T + bias`, one output."""
    weights = np.asarray(weights, "float32")
    model = keras.Sequential([
        keras.Input((weights.shape[-1],)),
        keras.layers.Dense(1, kernel_initializer=keras.initializers.Constant(weights.T),
                           bias_initializer=keras.initializers.Constant(bias),
                           name="linear")])
    return model, model.trainable_variables


def prediction(y_true, y_pred):
    """The prediction itself, per row, as the loss."""
    del y_true
    return y_pred[:, 0]
