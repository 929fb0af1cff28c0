"""Rule `elementwise`: class token, position embedding and layer scale."""

import keras
import tensorflow as tf

from tests.dp.rules import rule_test_case
from tfdp import dp
from tfdp.dp.rules import elementwise
from tfdp.layers import vit_layers


def _tiny_vit():
    """Patch embedding, class token, position embedding, one pre-norm block."""
    inp = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 4, strides=4, name="patches")(inp)
    h = keras.layers.Reshape((4, 8))(h)
    h = vit_layers.ClassToken(initializer="random_normal", name="cls")(h)
    h = vit_layers.AddPositionEmbedding(name="pos")(h)
    y = keras.layers.LayerNormalization(epsilon=1e-6)(h)
    attention = keras.layers.MultiHeadAttention(2, 4)
    y = attention(y, y)
    # Its gradient is zero up to rounding (the softmax cancels it): frozen,
    # so that the sums compared are not rounding noise.
    attention._key_dense.bias.trainable = False
    h = h + vit_layers.LayerScale(0.5, name="scale")(y)
    y = keras.layers.Dense(16, activation="gelu")(h)
    h = h + vit_layers.LayerScale(0.3, name="mlp_scale")(keras.layers.Dense(8)(y))
    h = keras.layers.Lambda(lambda t: t[:, 0])(h)
    return keras.Model(inp, keras.layers.Dense(3, name="head")(h))


def _convnet_with_keras_layer_scale():
    inp = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(4, 3, padding="same")(inp)
    h = elementwise.KerasLayerScale(0.5, 4, name="keras_scale")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(3)(h))


class ElementwiseRuleTest(rule_test_case.RuleTestCase):

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(5)

    def test_vit_block_matches_naive(self):
        model = _tiny_vit()
        plan = dp.plan(model, (8, 8, 3), 6, method="mixed")
        by_name = {l.name: l for l in plan.layers}
        for name in ("cls", "pos", "scale", "mlp_scale"):
            self.assertEqual(by_name[name].kind, "elementwise")
        self.assertEqual(by_name["pos"].mode, "ghost")
        self.assertNotIn("generic", {l.kind for l in plan.layers})
        self.assert_rule_matches_naive(
            model, rule_test_case.images(6, 8), tf.constant([0, 1, 2, 0, 1, 2]), "elementwise",
            sample_weight=rule_test_case.weights(6), weight_decay=0.05,
            weight_decay_variables=[model.get_layer("pos").embedding,
                                    model.get_layer("scale").gamma],
        )

    def test_keras_layer_scale_matches_naive(self):
        self.assertIsNotNone(elementwise.KerasLayerScale)
        model = _convnet_with_keras_layer_scale()
        self.assert_rule_matches_naive(
            model, rule_test_case.images(6, 6), tf.constant([0, 1, 2, 0, 1, 2]), "elementwise",
            sample_weight=rule_test_case.weights(6),
        )


if __name__ == "__main__":
    tf.test.main()
