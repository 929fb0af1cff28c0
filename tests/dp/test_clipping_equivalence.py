"""Every clipping method gives the naive loop's clipped sum and norms."""

import pytest
from unittest import mock

from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf

from tests.dp import dp_test_case
from tfdp import dp
from tfdp import layers
from tfdp import models
from tfdp.dp import layer_grads
from tfdp.dp.rules import conv as conv_rule

ALL_METHODS = ("vectorized", "ghost", "mixed", "bk", "auto")


def _images(batch, size, channels=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, size, size, channels)).astype("float32")
    x[min(1, batch - 1)] *= 5.0  # Spread the norms so that C at the median clips some.
    return tf.constant(x)


def _weights(batch):
    w = np.ones(batch, "float32")
    w[2] = 0.0  # Padding.
    w[3] = 2.0  # A weighted example.
    return tf.constant(w)


class ClippingEquivalenceTest(dp_test_case.DPTestCase, parameterized.TestCase):

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(1)

    def _check_image_model(self, model, size, batch=6, weight_decay=0.0, methods=ALL_METHODS):
        x = _images(batch, size)
        y = tf.constant(np.arange(batch) % model.output_shape[-1], tf.int32)
        self.assert_methods_match_naive(
            model, dp_test_case.per_example_xent, x, y, methods,
            sample_weight=_weights(batch), weight_decay=weight_decay,
        )

    def test_resnet18_gn_32px(self):
        model = models.resnet18(num_classes=10, input_shape=(32, 32, 3))
        self._check_image_model(model, 32)

    @pytest.mark.slow
    def test_narrow_resnet50_gn_bottlenecks(self):
        model = models.resnet_v2(50, num_classes=5, input_shape=(16, 16, 3), width=8, groups=4)
        self._check_image_model(model, 16, batch=4)

    def test_vgg_style(self):
        model = models.vgg_cifar(num_classes=10, input_shape=(16, 16, 3), group_norm=True, groups=8)
        self._check_image_model(model, 16)

    def test_small_convnet_with_weight_decay(self):
        model = models.small_convnet(num_classes=10, input_shape=(28, 28, 1))
        x = _images(6, 28, channels=1)
        y = tf.constant([0, 1, 2, 3, 4, 5])
        self.assert_methods_match_naive(
            model, dp_test_case.per_example_xent, x, y, ALL_METHODS,
            sample_weight=_weights(6), weight_decay=0.05,
        )

    @parameterized.named_parameters(
        ("stride2_same_bias", dict(strides=2, padding="same")),
        ("stride3_valid_nobias", dict(strides=3, padding="valid", use_bias=False)),
        ("dilated_valid", dict(dilation_rate=2, padding="valid")),
        ("dilated_same", dict(dilation_rate=2, padding="same")),
        ("rect_kernel_stride", dict(kernel_size=(3, 1), strides=(2, 1), padding="same")),
        # Stride 1: ghost norms from shifted pixel Gram matrices, no unfolding.
        ("stride1_same", dict(padding="same")),
        ("stride1_valid_5x3", dict(kernel_size=(5, 3), padding="valid", use_bias=False)),
        ("stride1_dilated_2x1_same", dict(kernel_size=(3, 2), dilation_rate=(2, 1), padding="same")),
        # 1×1: the unfolded input is a strided slice of the input.
        ("pointwise_stride2", dict(kernel_size=1, strides=2, padding="same")),
    )
    def test_conv_geometries(self, conv_kwargs):
        conv_kwargs = {"kernel_size": 3, **conv_kwargs}
        # 48 input channels: enough for stride-1 ghost norms to take the
        # pixel-Gram route, which is cheaper than unfolding only then.
        inp = keras.Input((11, 11, 48))
        h = keras.layers.Conv2D(6, activation="relu", **conv_kwargs)(inp)
        h = keras.layers.GroupNormalization(3, epsilon=1e-5)(h)
        h = keras.layers.Conv2D(4, 1)(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        x = _images(6, 11, channels=48)
        y = tf.constant([0, 1, 2, 0, 1, 2])
        gram = conv_rule.conv_input_gram
        with mock.patch.object(conv_rule, "conv_input_gram", wraps=gram) as spy:
            self.assert_methods_match_naive(
                model, dp_test_case.per_example_xent, x, y, ALL_METHODS,
                sample_weight=_weights(6), weight_decay=0.01,
            )
        used = [r for r in (gram(*c.args, **c.kwargs) for c in spy.call_args_list) if r is not None]
        stride_one = conv_kwargs.get("strides", 1) == 1 and conv_kwargs["kernel_size"] != 1
        self.assertEqual(bool(used), stride_one)

    def test_dense_embedding_layernorm_shared_layer(self):
        model = dp_test_case.text_model()
        rng = np.random.default_rng(0)
        x = tf.constant(rng.integers(0, 20, size=(6, 7)), tf.int32)
        x = tf.tensor_scatter_nd_update(x, [[0, 1]], [x[0, 0]])  # A repeated token.
        y = tf.constant([0, 1, 2, 0, 1, 2])
        self.assert_methods_match_naive(
            model, dp_test_case.per_example_xent, x, y, ALL_METHODS, sample_weight=_weights(6),
        )

    def test_unknown_trainable_layer_falls_back_per_layer(self):

        class Scale(keras.layers.Layer):
            def build(self, shape):
                self.scale = self.add_weight(shape=(shape[-1],), initializer="ones")

            def call(self, x):
                return x * self.scale + tf.sin(x)

        inp = keras.Input((8, 8, 2))
        h = keras.layers.Conv2D(4, 3)(inp)
        h = Scale()(h)
        h = keras.layers.Flatten()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        p = dp.plan(model, (8, 8, 2), 6)
        self.assertEqual([l.kind for l in p.layers], ["conv2d", "generic", "dense"])
        x = _images(6, 8, channels=2)
        y = tf.constant([0, 1, 2, 0, 1, 2])
        self.assert_methods_match_naive(
            model, dp_test_case.per_example_xent, x, y, ALL_METHODS, sample_weight=_weights(6),
        )

    def test_vit_like_attention_block(self):
        # Rules einsum_dense (attention projections), elementwise (class
        # token, position embedding, layer scale), norm, dense and conv2d.
        inp = keras.Input((8, 8, 3))
        h = keras.layers.Conv2D(8, 4, strides=4)(inp)
        h = keras.layers.Reshape((4, 8))(h)
        h = layers.ClassToken(initializer="random_normal")(h)
        h = layers.AddPositionEmbedding()(h)
        y = keras.layers.LayerNormalization(epsilon=1e-6)(h)
        attention = keras.layers.MultiHeadAttention(2, 4)
        y = attention(y, y)
        # Softmax cancels the key bias: its gradient is rounding noise.
        attention._key_dense.bias.trainable = False
        h = h + layers.LayerScale(0.5)(y)
        h = h + keras.layers.Dense(8)(keras.layers.Dense(16, activation="gelu")(h))
        h = keras.layers.Lambda(lambda t: t[:, 0])(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        self.assertNotIn("generic", {l.kind for l in dp.plan(model, (8, 8, 3), 6).layers})
        self._check_image_model(model, 8, weight_decay=0.01)

    def test_depthwise_and_separable_geometries(self):
        inp = keras.Input((10, 10, 3))
        h = keras.layers.DepthwiseConv2D(3, strides=2, padding="same", depth_multiplier=2)(inp)
        h = keras.layers.DepthwiseConv2D(3, dilation_rate=2, padding="same", use_bias=False)(h)
        h = keras.layers.DepthwiseConv2D((3, 2), padding="valid", activation="relu")(h)
        h = keras.layers.SeparableConv2D(8, 3, dilation_rate=2, padding="same")(h)
        h = keras.layers.SeparableConv2D(6, 2, strides=2, use_bias=False)(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        self.assertEqual({l.kind for l in dp.plan(model, (10, 10, 3), 6).layers},
                         {"depthwise", "dense"})
        self._check_image_model(model, 10, weight_decay=0.01)

    def test_wide_depthwise_kernels_geometries(self):
        # More than `MAX_BACKPROP_TAPS` taps: per-example gradients by correlation.
        inp = keras.Input((20, 20, 3))
        # A strided VALID conv that leaves the last row and column unread.
        h = keras.layers.DepthwiseConv2D(5, strides=2, depth_multiplier=2)(inp)
        # Odd SAME padding: one more row or column after than before.
        h = keras.layers.DepthwiseConv2D(5, strides=2, padding="same")(h)
        h = keras.layers.DepthwiseConv2D((4, 5), padding="same", activation="relu")(h)
        h = keras.layers.DepthwiseConv2D((5, 3), strides=(1, 2), padding="same",
                                         use_bias=False)(h)
        h = keras.layers.DepthwiseConv2D(4, dilation_rate=2, padding="same")(h)
        h = keras.layers.SeparableConv2D(8, 5, padding="same")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        self.assertEqual({l.kind for l in dp.plan(model, (20, 20, 3), 6).layers},
                         {"depthwise", "dense"})
        self._check_image_model(model, 20, weight_decay=0.01)

    def test_vectorized_refuses_what_tf_would_miscompute(self):

        class Projection(keras.layers.Layer):
            """A matmul of [B, T, D] by [D, p]: vectorized per example, a
            broadcasting BatchMatMul that oneDNN's CPU kernel gets wrong."""

            def build(self, shape):
                self.w = self.add_weight(shape=(shape[-1], 4))

            def call(self, x):
                return tf.matmul(x, self.w)

        inp = keras.Input((5, 6))
        h = Projection(name="projection")(inp)
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        x = tf.random.stateless_normal([6, 5, 6], seed=[1, 2])
        y = tf.constant([0, 1, 2, 0, 1, 2])
        loss = dp_test_case.per_example_xent
        probe = tf.function(lambda t: tf.vectorized_map(lambda r: tf.matmul(r[None], model.layers[1].w), t))
        miscomputed = layer_grads.miscomputed_batch_matmuls(
            probe.get_concrete_function(x).graph)
        if miscomputed:  # oneDNN on, on a CPU: refused, the process survives.
            with self.assertRaisesRegex(ValueError, "layer 'projection'.*method='bk'"):
                dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=1.0, method="vectorized")
            methods = ("ghost", "mixed", "bk")  # The generic rule loops over examples.
        else:
            methods = ("vectorized", "ghost", "mixed", "bk")
        self.assert_methods_match_naive(model, loss, x, y, methods)

    def test_padding_contributes_nothing(self):
        model = models.small_convnet(num_classes=10, input_shape=(28, 28, 1))
        x = _images(4, 28, channels=1)
        y = tf.constant([1, 2, 3, 4])
        garbage = tf.random.normal([3, 28, 28, 1]) * 100.0
        x_padded = tf.concat([x, garbage], 0)
        y_padded = tf.concat([y, [0, 0, 0]], 0)
        w_padded = tf.constant([1, 1, 1, 1, 0, 0, 0], tf.float32)
        for method in ("naive", "vectorized", "ghost", "mixed", "bk"):
            ref, ref_norms = dp.clipped_grad_sum(
                model, dp_test_case.per_example_xent, x, y, l2_norm_clip=0.5, method=method,
                weight_decay=0.01,
            )
            got, norms = dp.clipped_grad_sum(
                model, dp_test_case.per_example_xent, x_padded, y_padded, l2_norm_clip=0.5,
                method=method, sample_weight=w_padded, weight_decay=0.01,
            )
            self.assertAllClose(ref_norms, norms[:4], rtol=1e-5)
            self.assertAllEqual(norms[4:], [0.0, 0.0, 0.0])
            for r, g in zip(ref, got):
                self.assertAllClose(r, g, rtol=1e-5, atol=1e-6)

    def test_augmentation_multiplicity_matches_naive_and_means_rows(self):
        model = models.small_convnet(num_classes=10, input_shape=(28, 28, 1))
        k = 3
        x = _images(12, 28, channels=1)
        y = tf.constant(np.repeat([1, 2, 3, 4], k), tf.int32)
        w = tf.constant(np.repeat([1.0, 0.0, 1.0, 2.0], k), tf.float32)  # Example 1: padding.
        loss = dp_test_case.per_example_xent
        ref, ref_norms = dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=0.3, method="naive",
                                             sample_weight=w, weight_decay=0.01,
                                             augmentation_multiplicity=k)
        self.assertEqual(ref_norms.shape, [4])
        self.assertEqual(float(ref_norms[1]), 0.0)
        for method in ("vectorized", "ghost", "mixed", "bk"):
            got, norms = dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=0.3, method=method,
                                             sample_weight=w, weight_decay=0.01,
                                             augmentation_multiplicity=k)
            self.assertAllClose(ref_norms, norms, rtol=1e-4, msg=method)
            for r, g in zip(ref, got):
                self.assertAllClose(r, g, rtol=1e-4, atol=1e-6, msg=method)
        # K identical augmentations: the mean gradient is the single one.
        x1, y1 = x[::k], y[::k]
        same = tf.repeat(x1, k, axis=0)
        _, single = dp.clipped_grad_sum(model, loss, x1, y1, l2_norm_clip=0.3, method="bk")
        _, repeated = dp.clipped_grad_sum(model, loss, same, y, l2_norm_clip=0.3, method="bk",
                                          augmentation_multiplicity=k)
        self.assertAllClose(single, repeated, rtol=1e-5)

    def test_nonfinite_example_is_dropped_not_poisoning(self):
        model = models.small_convnet(num_classes=10, input_shape=(28, 28, 1))
        x = _images(5, 28, channels=1).numpy()
        x[2, 3, 4, 0] = np.nan
        x = tf.constant(x)
        y = tf.constant([0, 1, 2, 3, 4])
        loss = dp_test_case.per_example_xent
        dropped = tf.constant([1, 1, 0, 1, 1], tf.float32)
        clean_x = tf.where(tf.math.is_finite(x), x, tf.zeros_like(x))
        for method in ("naive", "vectorized", "ghost", "mixed", "bk"):
            ref, _ = dp.clipped_grad_sum(model, loss, clean_x, y, l2_norm_clip=0.5, method=method,
                                         sample_weight=dropped)
            got, norms = dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=0.5, method=method)
            self.assertFalse(np.isfinite(norms.numpy()[2]), method)
            for r, g in zip(ref, got):
                self.assertAllClose(r, g, rtol=1e-5, atol=1e-6, msg=method)
        # Also inside a tf.function (the training path).
        fn = tf.function(lambda: dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=0.5,
                                                     method="mixed")[0])
        for r, g in zip(ref, fn()):
            self.assertAllClose(r, g, rtol=1e-5, atol=1e-6)

    def test_clipped_examples_have_norm_at_most_c(self):
        model = models.small_convnet(num_classes=10, input_shape=(28, 28, 1))
        x = _images(1, 28, channels=1) * 10.0
        grads, norms = dp.clipped_grad_sum(
            model, dp_test_case.per_example_xent, x, tf.constant([3]), l2_norm_clip=0.01,
            method="bk",
        )
        self.assertGreater(float(norms[0]), 0.01)
        self.assertAllClose(float(tf.linalg.global_norm(grads)), 0.01, rtol=1e-4)


if __name__ == "__main__":
    tf.test.main()


class ConvInputGramTest(tf.test.TestCase, parameterized.TestCase):
    """The pixel-Gram ghost norm input side equals the unfolded U Uᵀ."""

    def _tapped_conv(self, **kwargs):
        return keras.layers.Conv2D(5, **kwargs)

    @parameterized.named_parameters(
        ("same_3x3", dict(kernel_size=3, padding="same")),
        ("valid_3x3", dict(kernel_size=3, padding="valid")),
        ("same_even_4x2", dict(kernel_size=(4, 2), padding="same")),
        ("dilated_same", dict(kernel_size=3, dilation_rate=2, padding="same")),
        ("dilated_valid_rect", dict(kernel_size=(2, 3), dilation_rate=(3, 2), padding="valid")),
    )
    def test_equals_unfolded_gram_for_calls_and_rows(self, conv_kwargs):
        layer = self._tapped_conv(**conv_kwargs)
        rng = np.random.default_rng(0)
        k, batch = 2, 3
        # Two calls of a shared layer, each with k rows per example.
        inputs = [tf.constant(rng.normal(size=(batch * k, 10, 12, 160)), tf.float32) for _ in range(2)]
        outputs = [layer(x) for x in inputs]
        got = conv_rule.conv_input_gram(layer, inputs, outputs, k)
        self.assertIsNotNone(got)
        u = tf.concat([layer_grads.flatten_bt(conv_rule.unfold(layer, x), k)
                       for x in inputs], axis=1)
        want = tf.matmul(u, u, transpose_b=True)
        self.assertEqual(got.shape, want.shape)
        self.assertAllClose(want, got, rtol=1e-5, atol=1e-4)

    def test_not_used_where_it_does_not_apply(self):
        x = tf.ones([2, 8, 8, 3])
        strided = self._tapped_conv(kernel_size=3, strides=2, padding="same")
        pointwise = self._tapped_conv(kernel_size=1)
        shared = self._tapped_conv(kernel_size=3, padding="same")
        small = tf.ones([2, 6, 6, 3])
        self.assertIsNone(conv_rule.conv_input_gram(strided, [x], [strided(x)]))
        self.assertIsNone(conv_rule.conv_input_gram(pointwise, [x], [pointwise(x)]))
        # One input channel: P (10² per example) is larger than U and U Uᵀ
        # (4·9·1 + 4²), so the unfolded route is taken.
        thin, thin_conv = tf.ones([2, 2, 2, 1]), self._tapped_conv(kernel_size=3, padding="same")
        self.assertIsNone(conv_rule.conv_input_gram(thin_conv, [thin], [thin_conv(thin)]))
        # Calls at two resolutions: the unfolded path handles them.
        self.assertIsNone(
            conv_rule.conv_input_gram(shared, [x, small], [shared(x), shared(small)])
        )

    def test_pointwise_unfold_is_a_strided_slice_of_extract_patches(self):
        rng = np.random.default_rng(1)
        for size in (8, 9):
            x = tf.constant(rng.normal(size=(2, size, size, 3)), tf.float32)
            for padding in ("same", "valid"):
                layer = self._tapped_conv(kernel_size=1, strides=2, padding=padding)
                want = tf.image.extract_patches(x, [1, 1, 1, 1], [1, 2, 2, 1], [1, 1, 1, 1],
                                                padding.upper())
                want = tf.reshape(want, [2, -1, 3])
                self.assertAllEqual(want, conv_rule.unfold(layer, x))
