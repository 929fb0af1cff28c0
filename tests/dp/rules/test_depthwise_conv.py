"""Rule `depthwise`: DepthwiseConv2D and SeparableConv2D (more geometries:
tests/dp/test_clipping_equivalence.py)."""

import keras
import tensorflow as tf

from tests.dp import dp_test_case
from tests.dp.rules import rule_test_case
from tfdp import dp
from tfdp.dp.rules import depthwise_conv


def _model():
    inp = keras.Input((9, 9, 4))
    h = keras.layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2, name="dw")(inp)
    # More than `MAX_BACKPROP_TAPS` taps: the correlation route.
    h = keras.layers.DepthwiseConv2D(5, padding="same", name="dw_wide")(h)
    h = keras.layers.DepthwiseConv2D(3, strides=3, use_bias=False, activation="relu",
                                     name="dw_strided")(h)
    # 3×3 outputs (T = 9), 16 -> 16 channels: 2T² < p·D, a ghost pointwise norm.
    h = keras.layers.SeparableConv2D(16, 3, padding="same", depth_multiplier=2, name="sep")(h)
    # Few outputs: the pointwise kernel is instantiated.
    h = keras.layers.SeparableConv2D(2, 2, dilation_rate=1, name="sep_narrow")(h)
    # A 3×3 kernel over a 2×2 input: the correlation route (`takes_backprop_route`).
    h = keras.layers.DepthwiseConv2D(3, padding="same", name="dw_small_input")(h)
    # One output position (T = 1): 2T² < p·D per channel, ghost norms, from
    # the input taps of a stride that skips a row and a column.
    h = keras.layers.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2,
                                     name="dw_one_position")(h)
    h = keras.layers.SeparableConv2D(4, 3, padding="same", name="sep_one_position")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(3, name="head")(h))


class DepthwiseConvRuleTest(rule_test_case.RuleTestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        keras.utils.set_random_seed(7)
        cls.model = _model()

    def test_plan(self):
        by_name = {l.name: l for l in dp.plan(self.model, (9, 9, 4), 8, method="mixed").layers}
        self.assertEqual({by_name[n].kind
                          for n in ("dw", "dw_wide", "dw_strided", "sep", "sep_narrow", "dw_small_input",
                                       "dw_one_position", "sep_one_position")},
                         {"depthwise"})
        self.assertEqual(by_name["dw"].mode, "instantiate")
        self.assertEqual((by_name["sep"].t, by_name["sep"].p, by_name["sep"].d), (9, 16, 16))
        self.assertEqual(by_name["sep"].mode, "ghost")
        self.assertEqual(by_name["sep_narrow"].mode, "instantiate")
        self.assertEqual(by_name["dw_small_input"].mode, "instantiate")
        for name in ("dw_one_position", "sep_one_position"):
            self.assertEqual(by_name[name].t, 1)
            self.assertEqual(by_name[name].mode, "ghost")
            self.assertRegex(by_name[name].why, "^depthwise: T=1, 2T²<pD per channel")
        # bk keeps the input and output gradient of a ghost depthwise kernel
        # (2×2×2 and 1×1×4 per example), not its 3×3×2×2 gradient.
        bk = {l.name: l for l in dp.plan(self.model, (9, 9, 4), 8, method="bk").layers}
        self.assertEqual(bk["dw_one_position"].kept_bytes, 8 * (8 + 4) * 4)
        self.assertEqual(bk["dw_small_input"].kept_bytes, 8 * 3 * 3 * 2 * 4)

    def test_route_by_kernel_and_input_size(self):
        route = depthwise_conv.takes_backprop_route
        layers = {n: self.model.get_layer(n) for n in ("dw", "dw_wide", "dw_small_input")}
        shapes = {n: layer.input.shape for n, layer in layers.items()}
        self.assertTrue(route(layers["dw"], [shapes["dw"]], layers["dw"].kernel.shape))
        self.assertFalse(route(layers["dw_wide"], [shapes["dw_wide"]],
                               layers["dw_wide"].kernel.shape))
        small = layers["dw_small_input"]
        self.assertEqual(tuple(shapes["dw_small_input"][1:3]), (2, 2))
        self.assertFalse(route(small, [shapes["dw_small_input"]], small.kernel.shape))
        # Every call must fit the kernel; unknown sizes count as fitting.
        self.assertFalse(route(small, [(4, 3, 3, 2), (4, 2, 2, 2)], small.kernel.shape))
        self.assertTrue(route(small, [(4, 3, 3, 2), (None, None, None, 2)], small.kernel.shape))

    def test_ghost_factors_equal_instantiated_gradients(self):
        # One output position: "same" kernels overhanging 1x1 and 2x2 inputs
        # (a stride), a "valid" one, a multiplier: norms, weight dots, clipped sums.
        rng = tf.random.Generator.from_seed(3)
        for kernel, strides, padding, size in ((3, 1, "same", 1), (5, 2, "same", 2),
                                               (3, 1, "valid", 3)):
            layer = keras.layers.DepthwiseConv2D(kernel, strides=strides, padding=padding,
                                                 depth_multiplier=2)
            layer.build((None, size, size, 3))
            x = rng.normal([4, size, size, 3])
            g = rng.normal(layer(x).shape)
            self.assertEqual(g.shape[1:3], (1, 1))
            with self.subTest(kernel=kernel, padding=padding):
                want = depthwise_conv.per_example_depthwise_grads(layer, [x], [g],
                                                                  layer.kernel.shape)
                ghost = depthwise_conv.DepthwiseGhostFactors(layer, x, g, layer.kernel.shape)
                self.assertAllClose(ghost.sq_norms(),
                                    tf.reduce_sum(tf.square(want), [1, 2, 3, 4]), rtol=1e-5)
                self.assertAllClose(ghost.dot(layer.kernel),
                                    tf.reduce_sum(want * layer.kernel[None], [1, 2, 3, 4]),
                                    rtol=1e-5, atol=1e-5)
                coeffs = tf.constant([0.5, 1.0, 0.0, 2.0])
                keep = tf.constant([True, True, False, True])
                self.assertAllClose(ghost.clipped_sum(coeffs, keep),
                                    tf.tensordot(coeffs, want, axes=1), rtol=1e-5, atol=1e-5)
        self.assertEqual(depthwise_conv.depthwise_norm_mode(1, (3, 3, 8, 1), rows=2),
                         "instantiate")
        self.assertEqual(depthwise_conv.depthwise_norm_mode(2, (3, 3, 8, 1)), "instantiate")
        self.assertEqual(depthwise_conv.depthwise_norm_mode(1, (1, 1, 8, 1)), "instantiate")

    def test_matches_naive_with_weight_decay(self):
        self.assert_rule_matches_naive(
            self.model, rule_test_case.images(6, 9, channels=4), tf.constant([0, 1, 2, 0, 1, 2]),
            "depthwise", sample_weight=rule_test_case.weights(6), weight_decay=0.05,
            weight_decay_variables=[v for v in self.model.trainable_variables
                                    if "kernel" in v.path],
        )

    def test_rows_per_example_traced(self):
        x = rule_test_case.images(8, 9, channels=4, seed=2)
        y = tf.constant([0, 0, 1, 1, 2, 2, 0, 0])
        loss = dp_test_case.per_example_xent
        ref, ref_norms = dp.clipped_grad_sum(self.model, loss, x, y, l2_norm_clip=0.5,
                                             method="naive", augmentation_multiplicity=2)
        for method in ("mixed", "bk"):
            fn = tf.function(lambda x, y, method=method: dp.clipped_grad_sum(
                self.model, loss, x, y, l2_norm_clip=0.5, method=method,
                augmentation_multiplicity=2))
            got, norms = fn(x, y)
            self.assertAllClose(ref_norms, norms, rtol=1e-4, msg=method)
            for r, g in zip(ref, got):
                self.assertAllClose(r, g, rtol=1e-4, atol=1e-6, msg=method)


if __name__ == "__main__":
    tf.test.main()
