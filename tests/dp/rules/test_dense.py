"""Rule `dense`: ghost and instantiated norms, 2-D and 3-D inputs, weight decay."""

import keras
import numpy as np
import tensorflow as tf

from tests.dp.rules import rule_test_case
from tfdp import dp
from tfdp.dp import rules


class DenseRuleTest(rule_test_case.RuleTestCase):

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(2)

    def test_2d_inputs_with_weight_decay(self):
        x = keras.Input((10,))
        h = keras.layers.Dense(7, activation="tanh")(x)
        model = keras.Model(x, keras.layers.Dense(3, use_bias=False)(h))
        data = tf.constant(np.random.default_rng(0).normal(size=(6, 10)), tf.float32)
        self.assert_rule_matches_naive(
            model, data * [[1.0]] * 6, tf.constant([0, 1, 2, 0, 1, 2]), "dense",
            sample_weight=rule_test_case.weights(6), weight_decay=0.05,
        )

    def test_sequence_inputs_take_both_norm_modes(self):
        x = keras.Input((12, 16))
        wide = keras.layers.Dense(64, activation="relu", name="wide")(x)  # 2T² < pD: ghost.
        narrow = keras.layers.Dense(2, name="narrow")(wide)  # Instantiated.
        h = keras.layers.GlobalAveragePooling1D()(narrow)
        model = keras.Model(x, keras.layers.Dense(3)(h))
        p = dp.plan(model, (12, 16), 6, method="mixed")
        modes = {layer.name: layer.mode for layer in p.layers}
        self.assertEqual((modes["wide"], modes["narrow"]), ("ghost", "instantiate"))
        data = tf.constant(np.random.default_rng(1).normal(size=(6, 12, 16)), tf.float32)
        self.assert_rule_matches_naive(model, data, tf.constant([0, 1, 2, 0, 1, 2]), "dense")

    def test_modified_call_is_not_this_rule(self):

        class Doubled(keras.layers.Dense):
            def call(self, x):
                return 2.0 * super().call(x)

        layer = Doubled(3)
        layer.build((None, 4))
        self.assertEqual(rules.rule_for(layer).name, "generic")
        plain = keras.layers.Dense(3)
        plain.build((None, 4))
        self.assertEqual(rules.rule_for(plain).name, "dense")


if __name__ == "__main__":
    tf.test.main()
