import keras
import numpy as np

from tests.models.model_test_case import ModelTestCase
from tfdp.layers import WSConv2D


class WSConv2DTest(ModelTestCase):
    def test_kernel_is_standardized(self):
        layer = WSConv2D(4, 3, padding="same")
        layer.build((None, 8, 8, 3))
        w = keras.ops.convert_to_numpy(layer.standardized_kernel())
        self.assertAllClose(w.mean(axis=(0, 1, 2)), np.zeros(4), atol=1e-5)
        self.assertAllClose(w.std(axis=(0, 1, 2)), np.ones(4), atol=1e-3)

    def test_matches_conv_with_standardized_kernel(self):
        layer = WSConv2D(4, 3, strides=2, use_bias=True, bias_initializer="ones")
        x = np.random.RandomState(0).randn(2, 9, 9, 3).astype("float32")
        y = layer(x)
        plain = keras.layers.Conv2D(4, 3, strides=2)
        plain.build(x.shape)
        plain.set_weights([keras.ops.convert_to_numpy(layer.standardized_kernel()), np.ones(4)])
        self.assertAllClose(y, plain(x), atol=1e-5)
        # Same variables as a plain conv, so DP engines see nothing unusual.
        self.assertEqual([v.name for v in layer.weights], ["kernel", "bias"])

    def test_config_round_trip(self):
        layer = WSConv2D(4, 3, ws_epsilon=1e-4, name="ws")
        clone = WSConv2D.from_config(layer.get_config())
        self.assertEqual(clone.ws_epsilon, 1e-4)
        self.assertEqual(clone.filters, 4)
        restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
        self.assertIsInstance(restored, WSConv2D)

    def test_invalid_epsilon(self):
        with self.assertRaisesRegex(ValueError, "ws_epsilon=0"):
            WSConv2D(4, 3, ws_epsilon=0)
