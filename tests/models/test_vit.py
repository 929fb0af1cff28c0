"""The vision transformers: shapes, parameter counts, saving and the DP engine."""

import numpy as np
import pytest

from tests.models.model_test_case import ModelTestCase
from tfdp import dp
from tfdp import models


def _tiny_vit(**kwargs):
    return models.vit(10, (32, 32, 3), width=32, depth=2, num_heads=2, mlp_dim=64, **kwargs)


def _xent(y_true, logits):
    import keras

    return keras.losses.sparse_categorical_crossentropy(y_true, logits, from_logits=True)


class VitTest(ModelTestCase):

    def test_tiny_vit_builds_saves_and_round_trips(self):
        model = _tiny_vit()
        self.run_model_checks(model, (2, 10))
        # 4 patches of 16x16 and the class token.
        self.assertEqual(model.get_layer("stem_position_embedding").embedding.shape, (1, 5, 32))
        self.assertEqual(model.get_layer("stem_class_token").token.shape, (1, 1, 32))

    @pytest.mark.slow  # 20-40 s on 2 cores: with the slow tests (CI runs them).
    def test_named_sizes_have_the_reference_parameter_counts(self):
        # timm's vit_tiny/small/base_patch16_224 (qkv biases, 1000 classes).
        for builder, params in ((models.vit_ti16, 5_717_416), (models.vit_s16, 22_050_664),
                                (models.vit_b16, 86_567_656)):
            with self.subTest(builder.__name__):
                model = builder()
                self.assertEqual(model.name, builder.__name__)
                self.assertParamCount(model, params)
        self.check_vit_b16_plans(model)

    def check_vit_b16_plans(self, model):
        # At a GPU's batch, mixed keeps the attention's ghost norms, not their
        # per-example gradients or output gradients.
        mixed = dp.plan(model, (224, 224, 3), 128, method="mixed")
        self.assertLessEqual(mixed.memory_bytes, 2**30)
        bk = dp.plan(model, (224, 224, 3), 128, method="bk")
        self.assertGreater(bk.memory_bytes, 4 * 2**30)
        # Under a budget that bk exceeds, "auto" takes mixed and says why.
        chosen = dp.plan(model, (224, 224, 3), 128, memory_budget_mb=4096)
        self.assertEqual(chosen.method, "mixed")
        self.assertEqual(chosen.memory_bytes, mixed.memory_bytes)
        self.assertRegex(chosen.reason(), r"auto chose mixed, its estimated [\d.]+ MiB fits the "
                         r"clipping-memory budget of 4096.0 MiB \(bk needs [\d.]+ MiB\)")
        self.assertEqual(dp.plan(model, (224, 224, 3), 128, memory_budget_mb=10**6).method, "bk")
        tight = dp.plan(model, (224, 224, 3), 128, memory_budget_mb=1)
        self.assertEqual(tight.method, "mixed")
        self.assertIn("a smaller physical batch would fit", tight.reason())
        with self.assertRaisesRegex(ValueError, "needs method='auto'"):
            dp.plan(model, (224, 224, 3), 128, method="bk", memory_budget_mb=4096)

    def test_layer_scale_and_dropout(self):
        model = _tiny_vit(layer_scale=0.1, dropout=0.1)
        scales = [l for l in model.layers if isinstance(l, models.LayerScale)]
        self.assertLen(scales, 4)  # Two branches per block.
        self.assertAllClose(scales[0].gamma, np.full([32], 0.1))
        self.assertOutputShape(model, (2, 10))
        self.assertSavingRoundTrip(model)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "multiples of `patch_size`"):
            models.vit(10, (40, 40, 3), width=32, depth=1, num_heads=2)
        with self.assertRaisesRegex(ValueError, "must divide `width`"):
            models.vit(10, (32, 32, 3), width=30, depth=1, num_heads=4)

    def test_private_clipping_is_bounded(self):
        model = _tiny_vit(layer_scale=0.5)
        x = self.random_inputs(model, batch_size=3)
        figure = dp.check_sensitivity(model, _xent, (x, np.arange(3)), 1e-2, "bk")
        self.assertLessEqual(figure, 1 + 1e-4)
        self.assertGreater(figure, 0.5)  # Every example is clipped at this C.
        plan = dp.plan(model, (32, 32, 3), 4, method="bk")
        # The attention's projections (EinsumDense), the class token, the position
        # embedding and the layer-scales each have a rule of their own.
        self.assertEqual({layer.name for layer in plan.layers if layer.kind == "generic"}, set())
        # Every trainable weight is on some rule (the attention's projections are
        # the sublayers of `MultiHeadAttention`).
        self.assertEqual(sum(layer.params for layer in plan.layers),
                         sum(int(np.prod(v.shape)) for v in model.trainable_variables))
