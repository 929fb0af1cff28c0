"""Rule `norm`: closed-form γ/β gradients of GroupNormalization/LayerNormalization."""

import keras
import numpy as np
import tensorflow as tf

from tests.dp.rules import rule_test_case
from tfdp.dp import rules


class NormRuleTest(rule_test_case.RuleTestCase):

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(5)

    def test_group_norm(self):
        inp = keras.Input((8, 8, 3))
        h = keras.layers.Conv2D(8, 3)(inp)
        h = keras.layers.GroupNormalization(4, epsilon=1e-5)(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        self.assert_rule_matches_naive(
            model, rule_test_case.images(6, 8), tf.constant([0, 1, 2, 0, 1, 2]), "norm",
        )

    def test_layer_norm_rms_and_two_axes(self):
        inp = keras.Input((5, 6))
        h = keras.layers.Dense(6, activation="tanh")(inp)
        h = keras.layers.LayerNormalization(rms_scaling=True, name="rms")(h)
        h = keras.layers.LayerNormalization(axis=[1, 2], name="two_axes")(h)
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        x = tf.constant(np.random.default_rng(0).normal(size=(6, 5, 6)), tf.float32)
        self.assert_rule_matches_naive(model, x, tf.constant([0, 1, 2, 0, 1, 2]), "norm")

    def test_bfloat16_norm_uses_the_generic_rule(self):
        layer = keras.layers.LayerNormalization(dtype="mixed_bfloat16")
        layer.build((None, 4))
        self.assertEqual(rules.rule_for(layer).name, "generic")


if __name__ == "__main__":
    tf.test.main()
