"""keras.applications backbones: GroupNorm or frozen BatchNorm, and the DP engine."""

import keras
import numpy as np
import pytest

from tests.models.model_test_case import ModelTestCase
from tfdp import dp
from tfdp import models

_SHAPE = (32, 32, 3)  # The smallest input every one of them accepts.


def _xent(y_true, logits):
    return keras.losses.sparse_categorical_crossentropy(y_true, logits, from_logits=True)


class BoundedTestCase(ModelTestCase):

    def assert_bounded(self, model, methods=("bk",)):
        x = self.random_inputs(model, batch_size=2)
        figures = dp.check_sensitivity(model, _xent, (x, np.array([1, 2])), 1e-3, list(methods))
        for method, figure in figures.items():
            self.assertLessEqual(figure, 1 + 1e-4, method)
            self.assertGreater(figure, 0.5, method)  # Both examples are clipped at this C.


class ApplicationsTest(BoundedTestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        keras.utils.set_random_seed(0)
        # MobileNetV2 at width 0.35: the same layer types at a seventh of the cost.
        cls.group_norm = models.mobilenet_v2(10, _SHAPE, alpha=0.35)
        cls.frozen = models.mobilenet_v2(10, _SHAPE, alpha=0.35, batchnorm="freeze")

    def test_group_norm_backbone_with_a_new_head(self):
        model = self.group_norm
        self.assertNoBatchNorm(model)
        self.assertEqual(model.get_layer("head_dense").units, 10)
        self.assertIsNone(model.get_layer("head_dense").activation(None))  # Logits.
        norms = [l for l in model.layers if isinstance(l, keras.layers.GroupNormalization)]
        self.assertLen(norms, 52)
        # 16 groups where the channels allow (Bu et al. 2022), gcd otherwise.
        self.assertEqual({n.groups for n in norms}, {8, 16})
        self.assertOutputShape(model, (2, 10))

    @pytest.mark.slow
    def test_group_norm_backbone_is_bounded_with_no_generic_layer(self):
        model = self.group_norm
        self.assert_bounded(model)
        plan = dp.plan(model, _SHAPE, 2, method="bk")
        self.assertEqual({layer.name for layer in plan.layers if layer.kind == "generic"}, set())
        self.assertIn("depthwise", {layer.kind for layer in plan.layers})

    def test_frozen_batchnorm_runs_in_inference_mode(self):
        model = self.frozen
        bn = [l for l in model.layers if isinstance(l, keras.layers.BatchNormalization)]
        self.assertLen(bn, 52)
        self.assertTrue(all(not l.trainable for l in bn))
        self.assertEqual(models.freeze_batchnorm(model), [l.name for l in bn])
        x = self.random_inputs(model)
        moving_mean = bn[0].moving_mean.numpy()
        # Training mode changes nothing: no batch statistics, no update of the moving ones.
        self.assertAllClose(model(x, training=True), model(x, training=False))
        self.assertAllClose(bn[0].moving_mean, moving_mean)
        trainable = {v.path.rsplit("/", 1)[0] for v in model.trainable_variables}
        self.assertFalse(trainable & {l.name for l in bn})

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "Unknown keras.applications architecture"):
            models.keras_application("mobilenet_v9", 10, _SHAPE)
        with self.assertRaisesRegex(ValueError, "`batchnorm` must be one of"):
            models.mobilenet_v2(10, _SHAPE, alpha=0.35, batchnorm="drop")


@pytest.mark.slow
class LargerApplicationsTest(BoundedTestCase):
    """The larger applications, and others by constructor name: minutes on 2 cores."""

    def test_each_is_accepted_and_bounded(self):
        for name in ("efficientnet_b0", "convnext_tiny", "densenet121"):
            with self.subTest(name):
                model = getattr(models, name)(10, _SHAPE)
                self.assertNoBatchNorm(model)
                self.assert_bounded(model)
                plan = dp.plan(model, _SHAPE, 2, method="bk")
                self.assertEqual(
                    {layer.name for layer in plan.layers if layer.kind == "generic"}, set())
                keras.backend.clear_session()

    def test_other_constructors_by_name(self):
        # Any keras.applications constructor, by its name (docs/FINETUNING.md).
        # 75 px: InceptionV3's smallest input.
        shape = (75, 75, 3)
        for name in ("MobileNet", "MobileNetV3Small", "EfficientNetV2B0", "ResNet50V2",
                     "VGG16", "Xception", "InceptionV3"):
            with self.subTest(name):
                model = models.keras_application(name, 10, shape)
                self.assertNoBatchNorm(model)
                plan = dp.plan(model, shape, 2, method="bk")
                self.assertEqual(
                    {layer.name for layer in plan.layers if layer.kind == "generic"}, set())
                x = np.random.default_rng(0).uniform(0, 255, (2,) + shape).astype("float32")
                figure = dp.check_sensitivity(model, _xent, (x, np.array([1, 2])), 1e-3, "bk")
                self.assertLessEqual(figure, 1 + 1e-4)
                self.assertGreater(figure, 0.5)
                keras.backend.clear_session()
