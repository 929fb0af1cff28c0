import gin
import keras
import pytest

from tests.models.model_test_case import ModelTestCase
from tfdp import models


class WideResNetTest(ModelTestCase):
    def test_wrn_16_4_param_count(self):
        model = models.wide_resnet_gn()
        # Matches the usual 2.75M of WRN-16-4 (GN has BN's 2 params/channel).
        self.assertParamCount(model, 2_748_890)
        sizes = [
            model.get_layer(f"block_group{g}_block2_add").output.shape[1:]
            for g in (1, 2, 3)
        ]
        self.assertEqual(sizes, [(32, 32, 64), (16, 16, 128), (8, 8, 256)])
        self.assertEqual(model.get_layer("block_group2_block1_conv1").strides, (2, 2))

    def test_wrn_10_1_checks(self):
        self.run_model_checks(models.wide_resnet_gn(10, 1), (2, 10), param_count=77_850)

    def test_invalid_depth(self):
        with pytest.raises(ValueError, match="depth=15"):
            models.wide_resnet_gn(15)


class VGGCifarTest(ModelTestCase):
    def test_default_checks(self):
        model = models.vgg_cifar()
        self.run_model_checks(model, (2, 10), param_count=550_570, save=False)
        self.assertEqual(model.get_layer("block3_pool").output.shape[1:], (4, 4, 128))

    def test_group_norm_variant(self):
        model = models.vgg_cifar(
            block_filters=((8,), (16,)), dense_units=None, group_norm=True, activation="relu"
        )
        norms = [l for l in model.layers if isinstance(l, keras.layers.GroupNormalization)]
        self.assertEqual([n.groups for n in norms], [8, 16])
        # conv 3*9*8+8, GN 16, conv 8*9*16+16, GN 32, dense 8*8*16*10+10
        self.run_model_checks(model, (2, 10), param_count=224 + 16 + 1168 + 32 + 10250)


class SmallConvnetTest(ModelTestCase):
    def test_default_checks(self):
        model = models.small_convnet()
        self.run_model_checks(model, (2, 10), param_count=26_106)
        self.assertEqual(model.get_layer("flatten").output.shape, (None, 512))
        self.assertEqual(model.get_layer("conv1_norm").groups, 4)

    def test_8x8_digits(self):
        model = models.small_convnet(input_shape=(8, 8, 1))
        self.assertEqual(model.get_layer("conv2").padding, "same")
        self.run_model_checks(model, (2, 10), param_count=10_746, save=False)

    def test_configurable(self):
        model = models.small_convnet(filters=(8, 16), dense_units=16, activation="relu", groups=None)
        self.assertFalse(any(isinstance(l, keras.layers.GroupNormalization) for l in model.layers))
        self.assertOutputShape(model, (2, 10))

    def test_gin_binding(self):
        gin.clear_config()
        try:
            gin.parse_config("tfdp.models.small_convnet.dense_units = 8")
            model = models.small_convnet()
        finally:
            gin.clear_config()
        self.assertEqual(model.get_layer("dense").units, 8)
