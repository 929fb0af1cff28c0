import pytest
import os

import numpy as np

from tests.models.model_test_case import ModelTestCase
from tfdp import models


def _model(num_classes=10, width=8, **kwargs):
    return models.resnet18(num_classes, (32, 32, 3), width=width, **kwargs)


class SubBlocksTest(ModelTestCase):
    def test_sub_block_layers(self):
        model = _model()
        group2 = models.sub_block_layers(model, "block_group2")
        self.assertTrue(group2)
        self.assertTrue(all(l.name.startswith("block_group2_") for l in group2))
        self.assertEqual(models.sub_block_layers(model, "block_group5"), [])
        self.assertEqual(
            [l.name for l in models.sub_block_layers(model, "stem")],
            ["stem_conv_pad", "stem_conv", "stem_pool_pad", "stem_pool"],
        )


class ReplaceHeadTest(ModelTestCase):
    def test_replace_head(self):
        model = _model(10)
        new = models.replace_head(model, 3)
        self.assertEqual(new.output_shape, (None, 3))
        self.assertEqual(new.get_layer("head_dense").units, 3)
        self.assertIsNot(new.get_layer("head_dense"), model.get_layer("head_dense"))
        for name in ("stem_conv", "block_group4_block2_conv2", "head_norm"):
            self.assertIs(new.get_layer(name), model.get_layer(name))
        self.assertEqual(
            new.count_params(), model.count_params() - 65 * 10 + 65 * 3
        )
        self.assertOutputShape(new, (2, 3))
        self.assertConfigRoundTrip(new)

    def test_missing_head(self):
        with self.assertRaisesRegex(ValueError, "classifier"):
            models.replace_head(_model(), 3, layer_name="classifier")


class FreezeSubBlocksTest(ModelTestCase):
    def test_freeze_paper_setting(self):
        model = _model()
        models.freeze_sub_blocks(model, 4)
        for sub_block in ("stem", "block_group1", "block_group2", "block_group3"):
            for layer in models.sub_block_layers(model, sub_block):
                self.assertFalse(layer.trainable, layer.name)
        for sub_block in ("block_group4", "head"):
            for layer in models.sub_block_layers(model, sub_block):
                self.assertTrue(layer.trainable, layer.name)
        trainable = {v.path.split("/")[0] for v in model.trainable_variables}
        self.assertTrue(all(n.startswith(("block_group4_", "head_")) for n in trainable))
        self.assertIn("head_norm", trainable)

    def test_refreeze_and_bounds(self):
        model = _model()
        models.freeze_sub_blocks(model, 5)
        self.assertEqual(
            {v.path.split("/")[0] for v in model.trainable_variables},
            {"head_norm", "head_dense"},
        )
        models.freeze_sub_blocks(model, 0)
        self.assertEqual(len(model.trainable_variables), len(model.variables))
        models.freeze_sub_blocks(model, 1)
        self.assertFalse(model.get_layer("stem_conv").trainable)
        self.assertTrue(model.get_layer("block_group1_block1_conv1").trainable)
        with self.assertRaisesRegex(ValueError, "k=6"):
            models.freeze_sub_blocks(model, 6)
        with self.assertRaisesRegex(ValueError, "block_group4"):
            models.freeze_sub_blocks(models.wide_resnet_gn(10, 1), 5)


class LoadWeightsMatchingTest(ModelTestCase):
    @pytest.mark.slow
    def test_loads_all_but_head(self):
        source = _model(10)
        target = _model(3)
        loaded = models.load_weights_matching(target, source)
        self.assertNotIn("head_dense", loaded)
        self.assertIn("stem_conv", loaded)
        self.assertAllEqual(
            target.get_layer("block_group3_block1_proj").kernel,
            source.get_layer("block_group3_block1_proj").kernel,
        )
        self.assertNotAllClose(
            target.get_layer("head_dense").kernel[:, :3],
            source.get_layer("head_dense").kernel[:, :3],
        )

    def test_loads_from_keras_file(self):
        source = _model(10)
        path = os.path.join(self.get_temp_dir(), "source.keras")
        source.save(path)
        target = _model(10)
        models.load_weights_matching(target, path, skip=())
        x = self.random_inputs(target)
        self.assertAllClose(target(x), source(x), atol=1e-5)

    def test_mismatches_are_listed(self):
        source = _model(10, width=16)
        target = _model(3, width=8)
        before = [np.copy(w) for w in target.get_weights()]
        with self.assertRaises(ValueError) as ctx:
            models.load_weights_matching(target, source)
        message = str(ctx.exception)
        self.assertIn("stem_conv: shape mismatch", message)
        self.assertIn("block_group4_block2_conv2: shape mismatch", message)
        self.assertNotIn("head_dense", message)
        # Atomic: nothing was assigned.
        for a, b in zip(before, target.get_weights()):
            self.assertAllEqual(a, b)

    def test_missing_layers_are_listed(self):
        source = models.resnet34(10, (32, 32, 3), width=8)
        target = _model(10)
        with self.assertRaises(ValueError) as ctx:
            models.load_weights_matching(target, source)
        message = str(ctx.exception)
        self.assertIn("block_group1_block3_conv1: in the source but not in the model", message)
        with self.assertRaises(ValueError) as ctx:
            models.load_weights_matching(source, target)
        self.assertIn("block_group3_block6_norm1: missing from the source", str(ctx.exception))

    def test_bad_source(self):
        with self.assertRaisesRegex(ValueError, "weights.h5"):
            models.load_weights_matching(_model(), "x.weights.h5")
