"""Rule `norm`: closed-form γ/β gradients of GroupNormalization/LayerNormalization."""

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from tests.dp.rules import rule_test_case
from tfdp import models
from tfdp.dp import layer_taps
from tfdp.dp import rules

# Keras's layer, and tfdp's with channel-first moments (its own statistics).
GROUP_NORMS = (("keras", keras.layers.GroupNormalization), ("tfdp", models.GroupNormalization))


class NormRuleTest(rule_test_case.RuleTestCase, parameterized.TestCase):

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(5)

    @parameterized.named_parameters(*GROUP_NORMS)
    def test_group_norm(self, group_norm):
        inp = keras.Input((8, 8, 3))
        h = keras.layers.Conv2D(8, 3)(inp)
        h = group_norm(4, epsilon=1e-5)(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        self.assert_rule_matches_naive(
            model, rule_test_case.images(6, 8), tf.constant([0, 1, 2, 0, 1, 2]), "norm",
        )

    @parameterized.named_parameters(*GROUP_NORMS)
    def test_group_norm_on_sequences_with_uneven_gamma(self, group_norm):
        inp = keras.Input((7, 6))
        h = keras.layers.Dense(6, activation="tanh")(inp)
        norm = group_norm(3, epsilon=1e-5, name="gn")
        h = norm(h)
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        norm.gamma.assign(np.linspace(-2.0, 2.0, 6))
        norm.beta.assign(np.linspace(1.0, -1.0, 6))
        x = tf.constant(np.random.default_rng(1).normal(3.0, 2.0, size=(6, 7, 6)), tf.float32)
        self.assert_rule_matches_naive(model, x, tf.constant([0, 1, 2, 0, 1, 2]), "norm")

    @parameterized.named_parameters(*GROUP_NORMS)
    def test_group_norm_tap_computes_the_layer_output_bit_for_bit(self, group_norm):
        # The tap replaces the layer's call to keep its statistics; the output
        # must be the layer's own, so a private and a non-private forward agree.
        rng = np.random.default_rng(2)
        for shape, groups, scale, center in [((5, 6, 6, 8), 4, True, True),
                                             ((5, 9, 6), 2, True, False),
                                             ((5, 4, 4, 6), 3, False, True)]:
            layer = group_norm(groups, scale=scale, center=center)
            x = tf.constant(rng.normal(2.0, 3.0, size=shape), tf.float32)
            layer.build(x.shape)
            for v in layer.trainable_variables:
                v.assign(rng.normal(size=v.shape))
            expected = layer(x)
            # Graph optimisations may round differently from eager execution.
            expected_traced = tf.function(lambda x, layer=layer: layer(x))(x)
            rules.install_taps(keras.Sequential([keras.Input(shape[1:]), layer]))

            @tf.function
            def tapped(x, layer=layer):
                with layer_taps.recording() as recorder:
                    out = layer(x)
                return out, recorder.records[0].statistics

            for (out, statistics), reference in ((tapped(x), expected_traced),
                                                 (tapped.python_function(x), expected)):
                self.assertAllEqual(out, reference)
                self.assertLen(statistics, 2)
            self.assertAllEqual(layer(x), expected)  # Taps off: the layer's own call.
            self.assertEqual(rules.rule_for(layer).name, "norm")

    def test_tfdp_group_norm_on_another_axis_uses_the_generic_rule(self):
        layer = models.GroupNormalization(2, axis=1)
        layer.build((None, 4, 3))
        self.assertFalse(layer.channels_last)
        self.assertEqual(rules.rule_for(layer).name, "generic")

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
