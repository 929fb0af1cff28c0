import keras
import numpy as np

from tests.models.model_test_case import ModelTestCase
from tfdp import models


def _bn_model():
    inner = keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(48, 3, name="inner_conv"),
            keras.layers.BatchNormalization(name="inner_bn"),
            keras.layers.ReLU(name="inner_relu"),
        ],
        name="backbone",
    )
    inputs = keras.Input((8, 8, 3))
    x = inner(inputs)
    x = keras.layers.Conv2D(16, 3, use_bias=False, name="conv")(x)
    x = keras.layers.BatchNormalization(epsilon=1e-5, center=False, name="bn")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = keras.layers.Dense(5, name="head_dense")(x)
    return keras.Model(inputs, outputs, name="bn_model")


class FindBatchNormTest(ModelTestCase):
    def test_finds_nested(self):
        self.assertEqual(models.find_batchnorm(_bn_model()), ["backbone/inner_bn", "bn"])

    def test_none_in_tfdp_models(self):
        self.assertEqual(models.find_batchnorm(models.small_convnet()), [])


class ReplaceBatchNormTest(ModelTestCase):
    def test_replaces_and_preserves_weights(self):
        model = _bn_model()
        x = self.random_inputs(model)
        model(x)
        new = models.replace_batchnorm(model, groups=32)
        self.assertNoBatchNorm(new)
        self.assertEqual(models.find_batchnorm(model), ["backbone/inner_bn", "bn"])

        inner_gn = new.get_layer("backbone").get_layer("inner_bn")
        self.assertIsInstance(inner_gn, keras.layers.GroupNormalization)
        self.assertEqual(inner_gn.groups, 16)  # gcd(32, 48)
        gn = new.get_layer("bn")
        self.assertIsInstance(gn, keras.layers.GroupNormalization)
        self.assertEqual((gn.groups, gn.epsilon, gn.center), (16, 1e-5, False))
        self.assertAllClose(gn.gamma, np.ones(16))
        self.assertAllClose(inner_gn.beta, np.zeros(48))

        for old_layer, new_layer in (
            (model.get_layer("backbone").get_layer("inner_conv"),
             new.get_layer("backbone").get_layer("inner_conv")),
            (model.get_layer("conv"), new.get_layer("conv")),
            (model.get_layer("head_dense"), new.get_layer("head_dense")),
        ):
            self.assertIsNot(old_layer, new_layer)
            for a, b in zip(old_layer.get_weights(), new_layer.get_weights()):
                self.assertAllEqual(a, b)
        self.assertOutputShape(new, (2, 5), x)
        self.assertEqual(
            new.count_params(), model.count_params() - 4 * 48 - 3 * 16 + 2 * 48 + 16
        )

    def test_round_trips(self):
        new = models.replace_batchnorm(_bn_model())
        self.assertConfigRoundTrip(new)
        self.assertSavingRoundTrip(new)

    def test_sequential(self):
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8), keras.layers.BatchNormalization()]
        )
        new = models.replace_batchnorm(model, groups=3)
        self.assertIsInstance(new, keras.Sequential)
        self.assertEqual(new.layers[1].groups, 1)  # gcd(3, 8)
        self.assertNoBatchNorm(new)

    def test_subclassed_model_raises(self):
        class Subclassed(keras.Model):
            def __init__(self):
                super().__init__()
                self.dense = keras.layers.Dense(2)

            def call(self, x):
                return self.dense(x)

        with self.assertRaisesRegex(ValueError, "Subclassed"):
            models.replace_batchnorm(Subclassed())
