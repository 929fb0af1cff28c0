"""`tfdp.finetune.lora`: what trains, the plan, frozen weights, saving and merging."""

import os
import tempfile

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tests.dp import dp_test_case
from tfdp import dp
from tfdp.secret_key import SecretKey


def convnet():
    keras.utils.set_random_seed(0)
    return tfdp.models.small_convnet(num_classes=4, input_shape=(8, 8, 1))


def vit():
    keras.utils.set_random_seed(0)
    return tfdp.models.vit(4, (16, 16, 3), patch_size=8, width=16, depth=1, num_heads=2)


def batch(model, n=8, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n,) + tuple(model.input_shape[1:])).astype("float32")
    x[1] *= 5.0
    return tf.constant(x), tf.constant(rng.integers(0, classes, n))


def paths(variables):
    return sorted(v.path for v in variables)


def base_kernels(model):
    """{path: value} of every LoRA layer's frozen kernel."""
    return {v.path: v.numpy().copy() for layer in tfdp.finetune.lora_layers(model)
            for v in layer.weights if v.path.endswith("/kernel")}


class WhatTrainsTest(tf.test.TestCase):
    def test_small_convnet(self):
        model = convnet()
        x, _ = batch(model)
        before = model(x)
        summary = tfdp.finetune.lora(model, 2)
        factors = [f"{name}/lora_kernel_{ab}" for name in ("conv1", "conv2", "dense")
                   for ab in "ab"]
        self.assertEqual(paths(model.trainable_variables),
                         sorted(factors + ["head_dense/bias", "head_dense/kernel"]))
        self.assertEqual(summary.adapted, ["conv1", "conv2", "dense"])
        self.assertEqual(summary.head, ["head_dense"])
        self.assertEqual((summary.rank, summary.lora_alpha), (2, 2.0))
        self.assertEqual(summary.trainable_params,
                         sum(int(np.prod(v.shape)) for v in model.trainable_variables))
        self.assertEqual(summary.total_params, model.count_params())
        self.assertIn(f"{summary.trainable_params:,} of {summary.total_params:,}", str(summary))
        self.assertStartsWith(str(summary), "LoRA r=2:")
        # B starts at zero: the outputs are unchanged.
        self.assertAllClose(before, model(x), atol=1e-6)

    def test_vit_with_offsets_and_alpha(self):
        model = vit()
        summary = tfdp.finetune.lora(model, 3, lora_alpha=6, train_offsets=True)
        trained = paths(model.trainable_variables)
        for path in ("block1_attention/query/lora_kernel_a", "block1_mlp_dense2/lora_kernel_b",
                     "stem_patch_embed/lora_kernel_a", "block1_attention/query/bias",
                     "block1_norm1/beta", "head_dense/kernel"):
            self.assertIn(path, trained)
        for path in ("block1_attention/query/kernel", "block1_norm1/gamma",
                     "stem_class_token/token", "stem_position_embedding/embedding"):
            self.assertNotIn(path, trained)
        query = model.get_layer("block1_attention")._query_dense
        self.assertEqual((query.lora_rank, query.lora_alpha), (3, 6))
        self.assertEqual(summary.lora_alpha, 6.0)

    def test_frozen_and_already_enabled_layers(self):
        model = convnet()
        model.get_layer("conv1").trainable = False
        conv2 = model.get_layer("conv2")
        conv2.enable_lora(5)  # Kept, with its own rank.
        conv2.lora_kernel_a.assign(tf.zeros(conv2.lora_kernel_a.shape))  # As after loading.
        summary = tfdp.finetune.lora(model, 2)
        self.assertEqual(summary.adapted, ["conv2", "dense"])
        self.assertFalse(getattr(model.get_layer("conv1"), "lora_enabled", False))
        self.assertEqual(model.get_layer("conv1").trainable_variables, [])
        self.assertEqual(conv2.lora_rank, 5)
        self.assertTrue(np.any(conv2.lora_kernel_a.numpy()))  # Drawn again.

    def test_head_by_name(self):
        model = convnet()
        summary = tfdp.finetune.lora(model, 2, head=["dense", "head_dense"])
        self.assertEqual(summary.adapted, ["conv1", "conv2"])
        self.assertIn("dense/kernel", paths(model.trainable_variables))

    def test_refusals(self):
        for rank in (0, -1, 2.0, True, "4", None):
            with self.assertRaisesRegex(ValueError, "positive integer rank.*Received: rank="):
                tfdp.finetune.lora(convnet(), rank)
        with self.assertRaisesRegex(ValueError, "positive lora_alpha.*Received: lora_alpha=0"):
            tfdp.finetune.lora(convnet(), 2, lora_alpha=0)
        with self.assertRaisesRegex(ValueError, "built"):
            tfdp.finetune.lora(keras.Sequential([keras.layers.Dense(2)]), 2)
        with self.assertRaisesRegex(ValueError, "lora: the head 'missing'"):
            tfdp.finetune.lora(convnet(), 2, head="missing")
        x = keras.Input((4,))
        only_head = keras.Model(x, keras.layers.Dense(2)(x))
        with self.assertRaisesRegex(ValueError, "no trainable Dense, EinsumDense or Conv"):
            tfdp.finetune.lora(only_head, 2)
        model = convnet()
        model.get_layer("head_dense").enable_lora(2)
        with self.assertRaisesRegex(ValueError, "has LoRA enabled"):
            tfdp.finetune.lora(model, 2, head="head_dense")


class PlanAndTrainingTest(dp_test_case.DPTestCase):
    def test_plan_has_no_generic_layer(self):
        for model, shape in ((vit(), (16, 16, 3)), (convnet(), (8, 8, 1))):
            tfdp.finetune.lora(model, 2)
            kinds = {layer.name: layer.kind for layer in dp.plan(model, shape, 4).layers}
            self.assertNotIn("generic", kinds.values(), msg=kinds)
            self.assertEqual(kinds["head_dense"], "dense")
            self.assertEqual({k for n, k in kinds.items() if n != "head_dense"}, {"lora"})

    def test_vit_matches_naive(self):
        model = vit()
        tfdp.finetune.lora(model, 2)
        for layer in tfdp.finetune.lora_layers(model):  # B non-zero: A's gradient too.
            b = layer.lora_kernel_b
            b.assign(0.3 * np.random.default_rng(0).normal(size=b.shape).astype("float32"))
        x, y = batch(model, n=6)
        self.assert_methods_match_naive(model, dp_test_case.per_example_xent, x, y,
                                        ("vectorized", "ghost", "mixed", "bk"))

    def assert_trained(self, model, kernels, factors):
        for path, value in base_kernels(model).items():
            self.assertAllEqual(kernels[path], value, msg=path)  # Bit for bit.
        now = {v.path: v.numpy() for v in model.trainable_variables}
        for path, value in factors.items():
            self.assertFalse(np.array_equal(value, now[path]), msg=path)

    def test_keras_fit_keeps_base_kernels(self):
        model = convnet()
        tfdp.finetune.lora(model, 2)
        kernels = base_kernels(model)
        factors = {v.path: v.numpy().copy() for v in model.trainable_variables
                   if v.path.endswith("lora_kernel_b")}
        private = tfdp.make_private(model)
        private.compile(
            optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(0.5), l2_norm_clip=1.0,
                                       noise_multiplier=1.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = batch(model, n=16)
        private.fit(x, y, batch_size=8, epochs=1, verbose=0)
        self.assert_trained(model, kernels, factors)

    def test_private_train_step_keeps_base_kernels(self):
        model = vit()
        tfdp.finetune.lora(model, 2)
        kernels = base_kernels(model)
        factors = {v.path: v.numpy().copy() for v in model.trainable_variables
                   if v.path.endswith("lora_kernel_b")}
        step = dp.PrivateTrainStep(
            model, keras.optimizers.SGD(0.5), dp_test_case.per_example_xent,
            l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=8, method="bk",
            secret_key=SecretKey.insecure_from_seed(0))
        x, y = batch(model)
        step.accumulate(x, y, tf.ones([8]))
        step.apply()
        self.assert_trained(model, kernels, factors)


class SaveAndMergeTest(tf.test.TestCase):
    def trained_vit(self):
        model = vit()
        tfdp.finetune.lora(model, 2)
        for layer in tfdp.finetune.lora_layers(model):  # As if fine-tuned.
            b = layer.lora_kernel_b
            b.assign(0.3 * np.random.default_rng(1).normal(size=b.shape).astype("float32"))
        return model

    def test_keras_saves_merged_kernels(self):
        model = self.trained_vit()
        x, _ = batch(model)
        expected = model(x)
        directory = tempfile.mkdtemp()
        path = os.path.join(directory, "lora.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertAllClose(expected, loaded(x), atol=1e-5)
        # The weights file holds the merged kernels: a model without LoRA loads it.
        weights = os.path.join(directory, "lora.weights.h5")
        model.save_weights(weights)
        plain = vit()
        plain.load_weights(weights)
        self.assertAllClose(expected, plain(x), atol=1e-5)
        # Keras zeroes the loaded factors; `lora` draws A again to go on training.
        dense = loaded.get_layer("block1_mlp_dense1")
        self.assertTrue(dense.lora_enabled)
        self.assertFalse(np.any(dense.lora_kernel_a.numpy()))
        tfdp.finetune.lora(loaded, 2)
        self.assertTrue(np.any(dense.lora_kernel_a.numpy()))
        self.assertAllClose(expected, loaded(x), atol=1e-5)

    def test_checkpoint_keeps_factors(self):
        model = self.trained_vit()
        x, _ = batch(model)
        path = tf.train.Checkpoint(model=model).write(os.path.join(tempfile.mkdtemp(), "ck"))
        restored = vit()
        tfdp.finetune.lora(restored, 2)
        tf.train.Checkpoint(model=restored).read(path).assert_consumed()
        self.assertAllClose(model(x), restored(x), atol=1e-6)
        for a, b in zip(model.trainable_variables, restored.trainable_variables):
            self.assertAllEqual(a.numpy(), b.numpy(), msg=a.path)

    def test_merge_lora(self):
        model = self.trained_vit()
        x, _ = batch(model)
        expected = model(x)
        a_before = {layer.name: layer.lora_kernel_a.numpy().copy()
                    for layer in tfdp.finetune.lora_layers(model)}
        merged = tfdp.finetune.merge_lora(model)
        self.assertLen(merged, 7)  # Patch embedding, 4 projections, 2 MLP layers.
        self.assertAllClose(expected, model(x), atol=1e-5)
        for layer in tfdp.finetune.lora_layers(model):
            self.assertFalse(np.any(layer.lora_kernel_b.numpy()), msg=layer.name)
            self.assertAllEqual(a_before[layer.name], layer.lora_kernel_a.numpy())


if __name__ == "__main__":
    tf.test.main()
