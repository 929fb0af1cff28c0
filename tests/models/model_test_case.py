"""Shared checks for the tfdp model builders."""

import os

import keras
import numpy as np
import tensorflow as tf

from tfdp.models import find_batchnorm


class ModelTestCase(tf.test.TestCase):
    """`tf.test.TestCase` with the checks every tfdp model must pass."""

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(0)

    def random_inputs(self, model, batch_size=2):
        shape = (batch_size,) + tuple(model.input_shape[1:])
        return np.random.RandomState(0).uniform(-1, 1, shape).astype("float32")

    def assertNoBatchNorm(self, model):
        self.assertEqual(find_batchnorm(model), [])

    def assertParamCount(self, model, expected):
        self.assertEqual(model.count_params(), expected)

    def assertOutputShape(self, model, expected, x=None):
        x = self.random_inputs(model) if x is None else x
        y = model(x, training=False)
        self.assertEqual(tuple(y.shape), tuple(expected))
        self.assertTrue(np.all(np.isfinite(keras.ops.convert_to_numpy(y))))
        return y

    def assertConfigRoundTrip(self, model, x=None):
        x = self.random_inputs(model) if x is None else x
        clone = model.__class__.from_config(model.get_config())
        self.assertEqual(clone.count_params(), model.count_params())
        self.assertEqual(
            [layer.name for layer in clone.layers],
            [layer.name for layer in model.layers],
        )
        clone.set_weights(model.get_weights())
        self.assertAllClose(clone(x), model(x), atol=1e-5, rtol=1e-5)

    def assertSavingRoundTrip(self, model, x=None):
        x = self.random_inputs(model) if x is None else x
        path = os.path.join(self.get_temp_dir(), f"{model.name}.keras")
        model.save(path)
        restored = keras.models.load_model(path, compile=False)
        self.assertEqual(restored.count_params(), model.count_params())
        self.assertAllClose(restored(x), model(x), atol=1e-5, rtol=1e-5)

    def run_model_checks(self, model, output_shape, param_count=None, save=True):
        """Runs every generic check on `model`."""
        self.assertNoBatchNorm(model)
        if param_count is not None:
            self.assertParamCount(model, param_count)
        x = self.random_inputs(model)
        self.assertOutputShape(model, output_shape, x)
        self.assertConfigRoundTrip(model, x)
        if save:
            self.assertSavingRoundTrip(model, x)
