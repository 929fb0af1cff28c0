"""Rule `conv2d`: unfolded, pixel-Gram and instantiated norms (more geometries:
tests/dp/test_clipping_equivalence.py)."""

from unittest import mock

import keras
import tensorflow as tf

from tests.dp import dp_test_case
from tests.dp.rules import rule_test_case
from tfdp import dp
from tfdp.dp import layer_grads
from tfdp.dp.rules import conv as conv_rule


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

    def test_pixel_gram_norms_in_chunks_of_the_batch(self):
        inp = keras.Input((6, 6, 32))
        h = keras.layers.Conv2D(32, 3, padding="same", name="wide")(inp)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        wide = {l.name: l for l in dp.plan(model, (6, 6, 32), 6).layers}["wide"]
        self.assertEqual(wide.rule, "ghost-pixel")
        x, y = rule_test_case.images(6, 6, channels=32), tf.constant([0, 1, 2, 0, 1, 2])

        def clipped(k):
            return dp.clipped_grad_sum(model, dp_test_case.per_example_xent, x, y,
                                       l2_norm_clip=1.0, method="bk", augmentation_multiplicity=k)

        expected = {k: clipped(k) for k in (1, 2)}
        # Two examples per chunk: for 5 examples, three chunks, the last padded.
        per_example = conv_rule.pixel_gram_floats(([1, 1], [1, 1]), x.shape, x.shape, 1)
        self.enter_context(mock.patch.object(
            layer_grads, "MAX_GHOST_WORK_BYTES", 2 * tf.float32.size * per_example))
        chunks = []
        chunked = layer_grads.over_example_chunks
        self.enter_context(mock.patch.object(
            layer_grads, "over_example_chunks",
            lambda *a: chunks.append(a[3:]) or chunked(*a)))
        self.assert_rule_matches_naive(model, x[:5], y[:5], "conv2d",
                                       sample_weight=rule_test_case.weights(5))
        self.assertEqual(set(chunks), {(2, 1)})
        # With two augmentations per example, an example's rows stay in one
        # chunk (here of one example: its work is 4x as large).
        for k, (sums, norms) in expected.items():
            got_sums, got_norms = clipped(k)
            self.assertAllClose(got_norms, norms, rtol=1e-5)
            for a, b in zip(got_sums, sums):
                self.assertAllClose(a, b, rtol=1e-5, atol=1e-6)
        self.assertIn((1, 2), chunks)

    def test_grouped_conv_takes_the_conv_rule(self):
        inp = keras.Input((6, 6, 4))
        h = keras.layers.Conv2D(4, 3, groups=2, name="grouped")(inp)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        kinds = {l.name: l.kind for l in dp.plan(model, (6, 6, 4), 6).layers}
        self.assertEqual(kinds["grouped"], "conv")
        self.assert_rule_matches_naive(
            model, rule_test_case.images(6, 6, channels=4), tf.constant([0, 1, 2, 0, 1, 2]),
            "conv",
        )


if __name__ == "__main__":
    tf.test.main()
