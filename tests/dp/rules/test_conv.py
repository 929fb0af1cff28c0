"""Rule `conv2d`: unfolded, pixel-Gram and instantiated norms (more geometries:
tests/dp/test_clipping_equivalence.py)."""

import keras
import tensorflow as tf

from tests.dp.rules import rule_test_case
from tfdp import dp


class Conv2DRuleTest(rule_test_case.RuleTestCase):

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(3)

    def test_convnet_with_weight_decay(self):
        inp = keras.Input((10, 10, 3))
        h = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(inp)
        h = keras.layers.Conv2D(6, 3, strides=2, use_bias=False)(h)
        h = keras.layers.Conv2D(4, 1)(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        self.assertEqual({l.kind for l in dp.plan(model, (10, 10, 3), 6).layers},
                         {"conv2d", "dense"})
        self.assert_rule_matches_naive(
            model, rule_test_case.images(6, 10), tf.constant([0, 1, 2, 0, 1, 2]), "conv2d",
            sample_weight=rule_test_case.weights(6), weight_decay=0.02,
        )

    def test_grouped_conv_falls_back_to_generic(self):
        inp = keras.Input((6, 6, 4))
        h = keras.layers.Conv2D(4, 3, groups=2, name="grouped")(inp)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        kinds = {l.name: l.kind for l in dp.plan(model, (6, 6, 4), 6).layers}
        self.assertEqual(kinds["grouped"], "generic")
        self.assert_rule_matches_naive(
            model, rule_test_case.images(6, 6, channels=4), tf.constant([0, 1, 2, 0, 1, 2]),
            "generic",
        )


if __name__ == "__main__":
    tf.test.main()
