import keras
import pytest
import tensorflow as tf

from tests.models.model_test_case import ModelTestCase
from tfdp import models


def _resnet18_param_count(num_classes=1000, width=64, in_channels=3):
    """Hand count of the GN ResNet-18 v2: convs (no bias) + GN (2 per channel)."""

    def conv(k, cin, cout):
        return k * k * cin * cout

    def gn(c):
        return 2 * c

    total = conv(7, in_channels, width)  # stem, no norm
    cin = width
    for g in range(4):
        cout = width * 2**g
        for b in range(2):
            total += gn(cin) + conv(3, cin, cout) + gn(cout) + conv(3, cout, cout)
            if b == 0 and cin != cout:
                total += conv(1, cin, cout)  # projection shortcut
            cin = cout
    total += gn(cin) + cin * num_classes + num_classes  # head
    return total


class ResNetV2Test(ModelTestCase):
    def test_resnet18_param_count_at_224(self):
        model = models.resnet18(1000)
        self.assertEqual(_resnet18_param_count(), 11_687_720)
        # Torchvision's BN ResNet-18 v1 has 11,689,512: the 1,792 BN params
        # of its downsample shortcuts and 128 of its stem BN are absent here,
        # and the 1,024 of the head GN are added.
        self.assertParamCount(model, 11_687_720)
        self.assertEqual(model.output_shape, (None, 1000))
        self.assertNoBatchNorm(model)

    def test_bottleneck_param_counts_at_224(self):
        self.assertParamCount(models.resnet50(1000), 25_549_352)
        self.assertParamCount(models.resnet34(1000), 21_795_880)

    def test_stride_on_last_block_resnet18(self):
        model = models.resnet18(1000)
        self.assertEqual(model.get_layer("stem_pool").output.shape[1:3], (56, 56))
        sizes = {}
        for layer in model.layers:
            if layer.name.endswith("_add"):
                sizes[layer.name] = layer.output.shape[1]
        # Only the last block of groups 2-4 halves the resolution.
        self.assertEqual(
            sizes,
            {
                "block_group1_block1_add": 56,
                "block_group1_block2_add": 56,
                "block_group2_block1_add": 56,
                "block_group2_block2_add": 28,
                "block_group3_block1_add": 28,
                "block_group3_block2_add": 14,
                "block_group4_block1_add": 14,
                "block_group4_block2_add": 7,
            },
        )
        self.assertEqual(
            model.get_layer("block_group2_block2_conv2").strides, (2, 2)
        )
        self.assertEqual(
            model.get_layer("block_group2_block1_conv2").strides, (1, 1)
        )
        # The strided block keeps an identity shortcut, subsampled.
        self.assertIn(
            "block_group2_block2_subsample", [l.name for l in model.layers]
        )

    def test_stride_on_last_block_resnet50(self):
        model = models.resnet50(1000)
        sizes = [
            model.get_layer(f"block_group{g}_block{b}_add").output.shape[1]
            for g, b in ((1, 3), (2, 4), (3, 6), (4, 3))
        ]
        self.assertEqual(sizes, [28, 14, 7, 7])
        self.assertEqual(
            model.get_layer("block_group1_block3_conv2").strides, (2, 2)
        )
        self.assertEqual(model.get_layer("block_group1_block1_add").output.shape[-1], 256)
        self.assertEqual(model.get_layer("head_pool").output.shape, (None, 2048))

    def test_stem(self):
        model = models.resnet18(10, (224, 224, 3))
        conv = model.get_layer("stem_conv")
        self.assertEqual(conv.kernel_size, (7, 7))
        self.assertEqual(conv.strides, (2, 2))
        self.assertEqual(conv.padding, "valid")
        self.assertFalse(conv.use_bias)
        self.assertEqual(model.get_layer("stem_conv_pad").padding, ((3, 3), (3, 3)))
        self.assertEqual(model.get_layer("stem_conv").output.shape[1], 112)
        pool = model.get_layer("stem_pool")
        self.assertEqual((pool.pool_size, pool.strides, pool.padding), ((3, 3), (2, 2), "valid"))
        stem_types = {type(l) for l in models.sub_block_layers(model, "stem")}
        self.assertNotIn(keras.layers.GroupNormalization, stem_types)

    def test_norm_and_head(self):
        model = models.resnet18(10, (32, 32, 3))
        norms = [l for l in model.layers if isinstance(l, keras.layers.GroupNormalization)]
        self.assertEqual(len(norms), 17)
        for norm in norms:
            self.assertEqual(norm.groups, 32)
            self.assertEqual(norm.epsilon, 1e-5)
        self.assertIsInstance(model.get_layer("head_norm"), keras.layers.GroupNormalization)
        self.assertIsInstance(model.get_layer("head_pool"), keras.layers.GlobalAveragePooling2D)
        self.assertEqual(model.get_layer("head_dense").units, 10)
        convs = [l for l in model.layers if isinstance(l, keras.layers.Conv2D)]
        self.assertFalse(any(c.use_bias for c in convs))

    def test_every_layer_named_by_sub_block(self):
        model = models.resnet18(10, (32, 32, 3), width=8)
        named = []
        for sub_block in models.SUB_BLOCKS:
            named += models.sub_block_layers(model, sub_block)
        self.assertEqual(len(named), len(model.layers) - 1)  # all but the input
        self.assertEqual(
            [l.name for l in models.sub_block_layers(model, "head")],
            ["head_norm", "head_relu", "head_pool", "head_dense"],
        )

    def test_narrow_resnet18_checks(self):
        model = models.resnet18(10, (32, 32, 3), width=8)
        # gcd clamping: 8 channels -> 8 groups, 64 channels -> 32 groups.
        self.assertEqual(model.get_layer("block_group1_block1_norm1").groups, 8)
        self.assertEqual(model.get_layer("head_norm").groups, 32)
        self.run_model_checks(model, (2, 10), param_count=177_138)
        self.assertEqual(_resnet18_param_count(10, width=8), 177_138)

    def test_narrow_resnet50_checks(self):
        model = models.resnet50(10, (32, 32, 3), width=8)
        self.run_model_checks(model, (2, 10), param_count=375_762, save=False)

    def test_resnet50_output_shape_64(self):
        model = models.resnet50(7, (64, 64, 3), width=16, groups=16)
        self.assertOutputShape(model, (2, 7))
        self.assertEqual(model.get_layer("block_group4_block3_add").output.shape[1:], (2, 2, 512))

    @pytest.mark.slow
    def test_weight_standardization(self):
        plain = models.resnet18(10, (32, 32, 3), width=8)
        model = models.resnet18(10, (32, 32, 3), width=8, weight_standardization=True)
        convs = [l for l in model.layers if isinstance(l, keras.layers.Conv2D)]
        self.assertTrue(all(isinstance(c, models.WSConv2D) for c in convs))
        self.assertEqual(model.count_params(), plain.count_params())
        self.run_model_checks(model, (2, 10))

    def test_group_strides_override(self):
        model = models.resnet18(10, (64, 64, 3), width=8, group_strides=(2, 2, 2, 1))
        self.assertEqual(model.get_layer("block_group4_block2_add").output.shape[1], 2)

    def test_invalid_arguments(self):
        with pytest.raises(ValueError, match="depth=20"):
            models.resnet_v2(20, 10)
        with pytest.raises(ValueError, match="group_strides"):
            models.resnet_v2(18, 10, group_strides=(1, 2))
        with pytest.raises(ValueError, match="num_classes=0"):
            models.resnet_v2(18, 0)


class ResNetV2GradientTest(ModelTestCase):
    def test_every_variable_gets_a_gradient(self):
        model = models.resnet18(4, (16, 16, 3), width=8, weight_standardization=True)
        x = self.random_inputs(model)
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(model(x, training=True) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        self.assertLen(grads, len(model.trainable_variables))
        for variable, grad in zip(model.trainable_variables, grads):
            self.assertIsNotNone(grad, variable.path)
