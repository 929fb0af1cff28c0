"""Rule `generic` (the fallback), and registering a rule for a new layer type."""

import keras
import tensorflow as tf

from tests.dp.rules import rule_test_case
from tfdp import dp
from tfdp.dp import rules


class Scale(keras.layers.Layer):
    """x·s + sin(x): no dedicated rule."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", name="scale")

    def call(self, x):
        return x * self.scale + tf.sin(x)


class Bias(keras.layers.Layer):
    """x + b: a layer type given its own rule below."""

    def build(self, shape):
        self.b = self.add_weight(shape=(shape[-1],), initializer="zeros", name="b")

    def call(self, x):
        return x + self.b


@rules.register_rule(Bias)
class BiasRule(rules.Rule):
    """∂L/∂b for example i is Σ_positions G_i: no recomputation."""

    name = "bias"

    def clip(self, layer, records, output_grads, context):
        per_row = tf.add_n([
            tf.reduce_sum(tf.reshape(g, [tf.shape(g)[0], -1, g.shape[-1]]), 1)
            for g in output_grads
        ])
        per_example = tf.reduce_sum(tf.reshape(per_row, [-1, context.k, per_row.shape[-1]]), 1)
        return rules.registry.PerExampleClip([layer.b], [per_example])

    def cost(self, layer, records, method, batch_size):
        return rules.Cost(0, 0, 0, "instantiate", batch_size * int(layer.b.shape[0]) * 4)


def _model(middle):
    inp = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(4, 3)(inp)
    h = middle(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(inp, keras.layers.Dense(3)(h))


class GenericRuleTest(rule_test_case.RuleTestCase):

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(6)

    def test_custom_layer_falls_back(self):
        model = _model(Scale())
        self.assertEqual([l.kind for l in dp.plan(model, (8, 8, 2), 6).layers],
                         ["conv2d", "generic", "dense"])
        self.assert_rule_matches_naive(
            model, rule_test_case.images(6, 8, channels=2), tf.constant([0, 1, 2, 0, 1, 2]),
            "generic", sample_weight=rule_test_case.weights(6),
        )

    def test_registered_rule_is_used(self):
        model = _model(Bias())
        self.assertEqual([l.kind for l in dp.plan(model, (8, 8, 2), 6).layers],
                         ["conv2d", "bias", "dense"])
        self.assert_rule_matches_naive(
            model, rule_test_case.images(6, 8, channels=2), tf.constant([0, 1, 2, 0, 1, 2]),
            "bias", sample_weight=rule_test_case.weights(6), weight_decay=0.1,
            weight_decay_variables=model.layers[2].trainable_variables,
        )


if __name__ == "__main__":
    tf.test.main()
