"""`tfdp.finetune.bitfit`: what trains, exactness, frozen weights, skipped work."""

from unittest import mock

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tests.dp import dp_test_case
from tfdp import dp
from tfdp.dp import layer_grads
from tfdp.dp import layer_taps
from tfdp.dp.rules import conv as conv_rules
from tfdp.dp.rules import depthwise_conv
from tfdp.secret_key import SecretKey

METHODS = ("vectorized", "ghost", "mixed", "bk")


def convnet():
    keras.utils.set_random_seed(0)
    return tfdp.models.small_convnet(num_classes=4, input_shape=(8, 8, 1))


def resnet():
    keras.utils.set_random_seed(0)
    return tfdp.models.resnet18(num_classes=4, input_shape=(16, 16, 3), width=8, groups=4)


def vit():
    keras.utils.set_random_seed(0)
    return tfdp.models.vit(4, (16, 16, 3), patch_size=8, width=16, depth=1, num_heads=2)


def conv_family_model():
    """Conv2D, DepthwiseConv2D, SeparableConv2D and a frozen BatchNorm, with biases."""
    keras.utils.set_random_seed(0)
    x = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="tanh", name="conv")(x)
    h = keras.layers.DepthwiseConv2D(3, padding="same", activation="tanh", name="depthwise")(h)
    h = keras.layers.SeparableConv2D(4, 3, activation="tanh", name="separable")(h)
    bn = keras.layers.BatchNormalization(name="bn")
    bn.trainable = False
    h = bn(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(x, keras.layers.Dense(3, name="head")(h))


def sequence_model():
    """Conv1D (the generic conv rule), LayerNorm and Dense on 3-D inputs."""
    keras.utils.set_random_seed(0)
    x = keras.Input((6, 3))
    h = keras.layers.Conv1D(4, 3, padding="same", activation="tanh", name="conv1d")(x)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.Dense(5, activation="tanh", name="dense")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(x, keras.layers.Dense(3, name="head")(h))


def batch(model, n=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n,) + tuple(model.input_shape[1:])).astype("float32")
    x[1] *= 5.0  # One large example, so that C at the median clips some.
    return tf.constant(x), tf.constant(rng.integers(0, classes, n))


def paths(variables):
    return sorted(v.path for v in variables)


class WhatTrainsTest(tf.test.TestCase):
    def test_small_convnet(self):
        model = convnet()
        summary = tfdp.finetune.bitfit(model)
        expected = ["conv1/bias", "conv1_norm/beta", "conv2/bias", "conv2_norm/beta",
                    "dense/bias", "head_dense/bias", "head_dense/kernel"]
        self.assertEqual(paths(model.trainable_variables), expected)
        self.assertEqual(sorted(summary.trainable), expected)
        self.assertEqual(summary.head, ["head_dense"])
        self.assertEqual(summary.trainable_params,
                         sum(int(np.prod(v.shape)) for v in model.trainable_variables))
        self.assertEqual(summary.total_params, model.count_params())
        self.assertLess(summary.trainable_params, summary.total_params / 20)
        self.assertIn(f"{summary.trainable_params:,} of {summary.total_params:,}", str(summary))
        # Frozen per variable: the layers themselves still train.
        self.assertTrue(all(layer.trainable for layer in model.layers))
        self.assertFalse(model.get_layer("conv1").kernel.trainable)
        self.assertEqual(paths(model.get_layer("conv1").trainable_variables), ["conv1/bias"])

    def test_resnet_gn(self):
        model = resnet()
        tfdp.finetune.bitfit(model)
        trained = paths(model.trainable_variables)
        head = ["head_dense/bias", "head_dense/kernel"]
        self.assertEqual([p for p in trained if p not in head],
                         sorted(v.path for v in model.weights if v.path.endswith("/beta")))
        self.assertTrue(set(head) <= set(trained))
        self.assertFalse(any(p.endswith(("/kernel", "/gamma")) for p in trained
                             if p not in head))

    def test_vit(self):
        model = vit()
        tfdp.finetune.bitfit(model)
        trained = paths(model.trainable_variables)
        self.assertIn("block1_attention/query/bias", trained)
        self.assertIn("block1_norm1/beta", trained)
        self.assertIn("head_dense/kernel", trained)
        for path in trained:
            self.assertTrue(path.startswith("head_dense/") or path.endswith(("/bias", "/beta")),
                            msg=path)
        for frozen in ("stem_class_token/token", "stem_position_embedding/embedding",
                       "block1_attention/query/kernel", "block1_norm1/gamma"):
            self.assertNotIn(frozen, trained)

    def test_batchnorm_stays_frozen_and_head_by_name(self):
        model = conv_family_model()
        summary = tfdp.finetune.bitfit(model, head="separable")
        trained = paths(model.trainable_variables)
        self.assertFalse(model.get_layer("bn").trainable)
        self.assertNotIn("bn/beta", trained)
        self.assertEqual(summary.head, ["separable"])
        self.assertIn("separable/depthwise_kernel", trained)
        self.assertIn("head/bias", trained)
        self.assertNotIn("head/kernel", trained)  # Not the head any more: its bias only.

    def test_head_as_layers(self):
        model = convnet()
        summary = tfdp.finetune.bitfit(model, head=[model.get_layer("dense"),
                                                    model.get_layer("head_dense")])
        self.assertEqual(summary.head, ["dense", "head_dense"])
        self.assertIn("dense/kernel", paths(model.trainable_variables))

    def test_refusals(self):
        x = keras.Input((8, 8, 1))
        no_dense = keras.Model(x, keras.layers.GlobalAveragePooling2D()(
            keras.layers.Conv2D(3, 3)(x)))
        with self.assertRaisesRegex(ValueError, "no head.*no Dense layer"):
            tfdp.finetune.bitfit(no_dense)
        with self.assertRaisesRegex(ValueError, "not a layer of the model"):
            tfdp.finetune.bitfit(convnet(), head="missing")
        with self.assertRaisesRegex(ValueError, "owns no variables"):
            tfdp.finetune.bitfit(convnet(), head="flatten")
        with self.assertRaisesRegex(ValueError, "built"):
            tfdp.finetune.bitfit(keras.Sequential([keras.layers.Dense(2)]))
        no_bias = keras.Model(x, keras.layers.Dense(2, use_bias=False)(
            keras.layers.Flatten()(x)))
        no_bias.layers[-1].kernel.trainable = False  # A head with nothing to train.
        with self.assertRaisesRegex(ValueError, "nothing to train"):
            tfdp.finetune.bitfit(no_bias)


class ExactnessTest(dp_test_case.DPTestCase):
    def check(self, model, classes, methods=METHODS):
        tfdp.finetune.bitfit(model)
        for v in model.trainable_variables:
            if v.path.endswith("attention/key/bias"):
                # Its gradient is zero (each query's softmax ignores a shift
                # shared by all keys): float noise, not comparable relatively.
                v.trainable = False
        x, y = batch(model, classes=classes)
        self.assert_methods_match_naive(model, dp_test_case.per_example_xent, x, y, methods)

    def test_small_convnet(self):
        self.check(convnet(), 4)

    def test_conv_family(self):
        self.check(conv_family_model(), 3)

    def test_sequence_model(self):
        self.check(sequence_model(), 3)

    def test_vit(self):
        # "vectorized" is left out: with the key bias frozen, the key
        # projection is untapped and runs Keras's einsum, which oneDNN's CPU
        # BatchMatMul would vectorize wrongly (clipping refuses it).
        self.check(vit(), 4, methods=("ghost", "mixed", "bk"))


class SkippedWorkTest(tf.test.TestCase):
    def test_plan_reports_bias_only_work(self):
        model = conv_family_model()
        tfdp.finetune.bitfit(model)
        plan = dp.plan(model, (8, 8, 2), batch_size=16, method="bk")
        by_name = {layer.name: layer for layer in plan.layers}
        for name, bias in (("conv", 4), ("depthwise", 4), ("separable", 4)):
            self.assertEqual(by_name[name].why, "kernel frozen: bias only", msg=name)
            self.assertEqual(by_name[name].params, bias, msg=name)
            self.assertEqual(by_name[name].memory_bytes, 16 * bias * 4, msg=name)
        self.assertNotEqual(by_name["head"].why, "kernel frozen: bias only")

    def test_no_kernel_norms_or_sums_for_frozen_kernels(self):
        model = conv_family_model()
        tfdp.finetune.bitfit(model)
        x, y = batch(model)
        refuse = AssertionError("kernel work for a frozen kernel")
        for method in ("ghost", "mixed", "bk"):
            with mock.patch.object(layer_grads.LinearFactors, "kernel_sq_norms",
                                   side_effect=refuse), \
                 mock.patch.object(conv_rules.ConvFactors, "kernel_sq_norms",
                                   side_effect=refuse), \
                 mock.patch.object(layer_grads.LinearFactors, "kernel_clipped_sum",
                                   side_effect=refuse), \
                 mock.patch.object(depthwise_conv, "per_example_depthwise_grads",
                                   side_effect=refuse), \
                 mock.patch.object(depthwise_conv, "DepthwiseGhostFactors",
                                   side_effect=refuse):
                # The head is not frozen: let its kernel through.
                model.get_layer("head").trainable = False
                grads, _ = dp.clipped_grad_sum(
                    model, dp_test_case.per_example_xent, x, y, l2_norm_clip=1.0,
                    method=method)
                model.get_layer("head").trainable = True
            self.assertLen(grads, 3)  # conv, depthwise and separable biases.

    def test_frozen_kernel_sums_not_left_to_the_second_backward_pass(self):
        model = conv_family_model()
        tfdp.finetune.bitfit(model)
        x, y = batch(model)
        layer = model.get_layer("conv")
        dp.rules.install_taps(model)
        with tf.GradientTape(persistent=True) as tape:
            with layer_taps.recording() as recorder:
                logits = model(x, training=True)
            loss = tf.reduce_sum(dp_test_case.per_example_xent(y, logits))
        records = [r for r in recorder.records if r.layer is layer]
        grads = tape.gradient(loss, [r.outputs for r in records])
        clip = layer._tfdp_rule.clip(layer, records, grads, dp.rules.ClipContext("ghost"))
        self.assertEqual([v.path for v in clip.variables], ["conv/bias"])
        # The bias's per-example gradients exist already: its sum comes from them.
        self.assertFalse(clip.from_backward)

    def test_generic_conv_rule_skips_frozen_kernel(self):
        model = sequence_model()
        tfdp.finetune.bitfit(model)
        x, _ = batch(model)
        layer = model.get_layer("conv1d")
        dp.rules.install_taps(model)
        with tf.GradientTape() as tape:
            with layer_taps.recording() as recorder:
                out = model(x, training=True)
        records = [r for r in recorder.records if r.layer is layer]
        grads = tape.gradient(out, [r.outputs for r in records])
        rule = layer._tfdp_rule
        self.assertEqual(rule.name, "conv")
        with mock.patch.object(conv_rules, "conv", wraps=conv_rules.conv) as spy:
            per_example = rule.per_example_grads(layer, records, grads, [layer.bias])
        spy.assert_not_called()  # No per-row kernel backprop.
        self.assertEqual(per_example[0].shape, (6, 4))


class FrozenWeightsTest(tf.test.TestCase):
    def assert_frozen_kept(self, model, frozen, trained):
        now = {v.path: v.numpy() for v in model.weights}
        for path, value in frozen.items():
            self.assertAllEqual(value, now[path], msg=path)  # Bit for bit.
        for path, value in trained.items():
            self.assertFalse(np.array_equal(value, now[path]), msg=path)

    def snapshot(self, model):
        frozen = {v.path: v.numpy().copy() for v in model.weights
                  if not any(v is t for t in model.trainable_variables)}
        trained = {v.path: v.numpy().copy() for v in model.trainable_variables}
        return frozen, trained

    def test_keras_fit(self):
        model = convnet()
        tfdp.finetune.bitfit(model)
        frozen, trained = self.snapshot(model)
        private = tfdp.make_private(model)
        private.compile(
            optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(0.5), l2_norm_clip=1.0,
                                       noise_multiplier=1.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = batch(model, n=32, classes=4)
        private.fit(x, y, batch_size=8, epochs=1, verbose=0)
        self.assert_frozen_kept(model, frozen, trained)

    def test_private_train_step(self):
        model = vit()
        tfdp.finetune.bitfit(model)
        frozen, trained = self.snapshot(model)
        step = dp.PrivateTrainStep(
            model, keras.optimizers.SGD(0.5), dp_test_case.per_example_xent,
            l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=8, method="bk",
            secret_key=SecretKey.insecure_from_seed(0))
        x, y = batch(model, n=8, classes=4)
        for _ in range(2):
            step.accumulate(x, y, tf.ones([8]))
            step.apply()
        self.assert_frozen_kept(model, frozen, trained)
