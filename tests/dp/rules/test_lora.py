"""Rule `lora`: LoRA-enabled Dense, EinsumDense, attention and convolutions."""

from unittest import mock

import keras
import pytest
import numpy as np
import tensorflow as tf

from tests.dp import dp_test_case
from tests.dp.rules import rule_test_case
from tfdp import dp
from tfdp.dp import rules
from tfdp.dp.rules import conv as conv_rules
from tfdp.dp.rules import lora as lora_rules


def enable(layer, rank=2, lora_alpha=None, seed=0):
    """Keras's `enable_lora`, with B drawn non-zero (zero, A's gradient would be too)."""
    layer.enable_lora(rank, lora_alpha=lora_alpha)
    b = layer.lora_kernel_b
    b.assign(0.5 * np.random.default_rng(seed).normal(size=b.shape).astype("float32"))


def freeze_biases(model):
    for v in model.trainable_variables:
        if v.path.endswith("bias") and not v.path.startswith("head/"):
            v.trainable = False


def sequences(batch, steps, width, seed=0):
    x = np.random.default_rng(seed).normal(size=(batch, steps, width)).astype("float32")
    x[1] *= 5.0  # One large example, so that C at the median clips some.
    return tf.constant(x)


LABELS = tf.constant([0, 1, 2, 0, 1, 2])


def dense_model():
    """Dense on 2-D and on 3-D inputs, α ≠ rank."""
    keras.utils.set_random_seed(1)
    x = keras.Input((5, 8))
    seq = keras.layers.Dense(6, activation="tanh", name="seq")
    flat = keras.layers.Dense(7, activation="tanh", name="flat")
    h = flat(keras.layers.Flatten()(seq(x)))
    model = keras.Model(x, keras.layers.Dense(3, name="head")(h))
    enable(seq, rank=2, lora_alpha=3)
    enable(flat, rank=3, seed=1)
    return model


def attention_model():
    """MultiHeadAttention's four projections and an EinsumDense with an ellipsis."""
    keras.utils.set_random_seed(2)
    x = keras.Input((5, 8))
    attention = keras.layers.MultiHeadAttention(2, 4, name="mha")
    h = attention(x, x)
    ellipsis = keras.layers.EinsumDense("...c,cde->...de", (3, 2), bias_axes="e",
                                        name="ellipsis")
    h = ellipsis(h)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Reshape((5, 6))(h))
    model = keras.Model(x, keras.layers.Dense(3, name="head")(h))
    for seed, layer in enumerate([attention._query_dense, attention._key_dense,
                                  attention._value_dense, attention._output_dense, ellipsis]):
        enable(layer, seed=seed)
    # The key bias adds one logit to all keys of a query, which the softmax
    # cancels: its gradient is rounding noise, which no method reproduces.
    attention._key_dense.bias.trainable = False
    return model


def conv_model():
    """Conv2D (same; strided valid), causal Conv1D and Conv3D."""
    keras.utils.set_random_seed(3)
    x = keras.Input((6, 6, 2))
    c2 = keras.layers.Conv2D(4, 3, padding="same", activation="tanh", name="c2")
    c2s = keras.layers.Conv2D(3, 2, strides=2, name="c2s")
    h = c2s(c2(x))  # [3, 3, 3]
    c3 = keras.layers.Conv3D(2, 2, name="c3")
    h3 = c3(keras.layers.Reshape((3, 3, 3, 1))(h))
    c1 = keras.layers.Conv1D(4, 2, padding="causal", name="c1")
    h1 = c1(keras.layers.Reshape((9, 3))(h))
    h = keras.layers.Concatenate()([keras.layers.GlobalAveragePooling3D()(h3),
                                    keras.layers.GlobalAveragePooling1D()(h1)])
    model = keras.Model(x, keras.layers.Dense(3, name="head")(h))
    for seed, layer in enumerate([c2, c2s, c3, c1]):
        enable(layer, seed=seed)
    return model


class LoraRuleTest(rule_test_case.RuleTestCase):

    def kinds(self, model, input_shape, method="bk"):
        return {l.name: l.kind for l in dp.plan(model, input_shape, 4, method=method).layers}

    def test_dense_with_bias_and_weight_decay(self):
        model = dense_model()
        self.assertEqual(self.kinds(model, (5, 8)), {"seq": "lora", "flat": "lora",
                                                    "head": "dense"})
        self.assert_rule_matches_naive(
            model, sequences(6, 5, 8), LABELS, "lora",
            sample_weight=rule_test_case.weights(6), weight_decay=0.05,
            weight_decay_variables=[v for v in model.trainable_variables
                                    if "lora_kernel" in v.path],
        )

    def test_dense_factors_only(self):
        model = dense_model()
        freeze_biases(model)
        self.assertEqual(
            sorted(v.path for v in model.get_layer("seq").trainable_variables),
            ["seq/lora_kernel_a", "seq/lora_kernel_b"])
        self.assert_rule_matches_naive(model, sequences(6, 5, 8), LABELS, "lora")

    @pytest.mark.slow
    def test_attention_with_bias(self):
        model = attention_model()
        kinds = self.kinds(model, (5, 8))
        for name in ("query", "key", "value", "attention_output", "ellipsis"):
            self.assertEqual(kinds[name], "lora", msg=name)
        self.assert_rule_matches_naive(
            model, sequences(6, 5, 8, seed=1), LABELS, "lora",
            sample_weight=rule_test_case.weights(6), weight_decay=0.05,
            weight_decay_variables=[v for v in model.trainable_variables
                                    if "lora_kernel" in v.path],
        )

    @pytest.mark.slow  # The ViT test of tests/finetune/test_lora.py covers attention fast.
    def test_attention_factors_only(self):
        model = attention_model()
        freeze_biases(model)
        self.assert_rule_matches_naive(model, sequences(6, 5, 8, seed=2), LABELS, "lora")

    def test_conv2d_and_causal_conv1d(self):
        keras.utils.set_random_seed(5)
        x = keras.Input((5, 5, 2))
        c2 = keras.layers.Conv2D(3, 3, padding="same", activation="tanh", name="c2")
        c1 = keras.layers.Conv1D(2, 2, padding="causal", name="c1")
        h = c1(keras.layers.Reshape((25, 3))(c2(x)))
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(x, keras.layers.Dense(3, name="head")(h))
        enable(c2)
        enable(c1, seed=1)
        self.assert_rule_matches_naive(model, rule_test_case.images(6, 5, channels=2), LABELS,
                                       "lora", sample_weight=rule_test_case.weights(6))

    @pytest.mark.slow
    def test_convs_with_and_without_bias(self):
        model = conv_model()
        kinds = self.kinds(model, (6, 6, 2))
        for name in ("c2", "c2s", "c3", "c1"):
            self.assertEqual(kinds[name], "lora", msg=name)
        x = rule_test_case.images(6, 6, channels=2)
        self.assert_rule_matches_naive(model, x, LABELS, "lora",
                                       sample_weight=rule_test_case.weights(6))
        freeze_biases(model)
        self.assert_rule_matches_naive(model, x, LABELS, "lora")

    @pytest.mark.slow
    def test_conv2d_by_backprop_per_example(self):
        # Past the unfolded-input bound, A's per-example gradients come from
        # a conv backprop per example, as for a plain conv.
        model = conv_model()
        x = rule_test_case.images(6, 6, channels=2, seed=1)
        with mock.patch.object(conv_rules, "MAX_UNFOLDED_PER_EXAMPLE", 0):
            self.assert_rule_matches_naive(model, x, LABELS, "lora",
                                           methods=("mixed", "bk"))

    def test_rows_per_example(self):
        model = attention_model()
        x, y = sequences(8, 5, 8, seed=3), tf.constant(np.repeat([0, 1, 2, 0], 2))
        loss = dp_test_case.per_example_xent
        ref, ref_norms = dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=0.5,
                                             method="naive", augmentation_multiplicity=2)
        for method in ("ghost", "mixed", "bk"):
            got, norms = dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=0.5,
                                             method=method, augmentation_multiplicity=2)
            self.assertAllClose(ref_norms, norms, rtol=1e-4, msg=method)
            for r, g in zip(ref, got):
                self.assertAllClose(r, g, rtol=1e-4, atol=1e-6, msg=method)

    def test_factor_modes_follow_the_layerwise_rule(self):
        keras.utils.set_random_seed(4)
        x = keras.Input((40, 8))
        # 2T² ≥ D·p, and forming the kernel's per-example gradient costs less
        # than the factor route (D·p < 2r(D + p)): both factors are projected
        # from it.
        long = keras.layers.Dense(6, name="long")
        # 2T² ≥ D·p too, but D·p > 2r(D + p): the factor route, instantiated.
        wide_seq = keras.layers.Dense(128, name="wide_seq")
        h = keras.layers.GlobalAveragePooling1D()(wide_seq(long(x)))
        wide = keras.layers.Dense(64, name="wide")  # T = 1: ghost.
        model = keras.Model(x, keras.layers.Dense(3, name="head")(wide(h)))
        enable(long)
        enable(wide_seq)
        enable(wide)
        by_name = {l.name: l for l in dp.plan(model, (40, 8), 4, method="mixed").layers}
        self.assertEqual(by_name["long"].why,
                         "r=2: factors projected from the kernel's per-example gradient")
        self.assertEqual(by_name["long"].mode, "instantiate")
        # Per example: M [8, 6] while projecting; A [8, 2], B [2, 6] and the
        # bias [6] kept.
        self.assertEqual(by_name["long"].memory_bytes, 4 * (48 + 16 + 12 + 6) * 4)
        self.assertEqual(by_name["long"].kept_bytes, 4 * (16 + 12 + 6) * 4)
        self.assertEqual(by_name["wide_seq"].why, "r=2: A inst., B inst.")
        # Per example: A [6, 2], B [2, 128] and the bias [128].
        self.assertEqual(by_name["wide_seq"].memory_bytes, 4 * (12 + 256 + 128) * 4)
        self.assertEqual(by_name["wide"].why, "r=2: A ghost, B ghost")
        with mock.patch.object(lora_rules.LoraLayout, "projects", return_value=False):
            by_name = {l.name: l for l in dp.plan(model, (40, 8), 4, method="mixed").layers}
        self.assertEqual(by_name["long"].why, "r=2: A inst., B inst.")
        self.assertEqual(by_name["long"].memory_bytes, 4 * (16 + 12 + 6) * 4)

    def test_projected_factors_and_the_factor_route_agree(self):
        # Dense on 3-D inputs and a small conv project both factors from the
        # kernel's per-example gradient under "mixed" and "bk" ("ghost" keeps
        # ghost norms); the wide conv (2T² < D·p) takes the factor route, with
        # A as a conv of its own. Both routes equal the naive loop, forced
        # either way.
        keras.utils.set_random_seed(6)
        x = keras.Input((5, 5, 2))
        small = keras.layers.Conv2D(3, 3, padding="same", activation="tanh", name="small")
        wide = keras.layers.Conv2D(16, 3, name="wide")  # T = 9, D = 27, p = 16.
        seq = keras.layers.Dense(3, activation="tanh", name="seq")
        h = seq(keras.layers.Reshape((9, 16))(wide(small(x))))
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(x, keras.layers.Dense(3, name="head")(h))
        for seed, layer in enumerate([small, wide, seq]):
            enable(layer, seed=seed)
        plan = {l.name: l.why for l in dp.plan(model, (5, 5, 2), 6, method="bk").layers}
        self.assertIn("projected", plan["small"])
        self.assertIn("projected", plan["seq"])
        self.assertNotIn("projected", plan["wide"])
        images = rule_test_case.images(6, 5, channels=2, seed=2)
        self.assert_rule_matches_naive(model, images, LABELS, "lora",
                                       sample_weight=rule_test_case.weights(6))
        with mock.patch.object(lora_rules.LoraLayout, "projects", return_value=False):
            # With in-loss weight decay on the factors: its cross term ⟨g_i, A⟩.
            self.assert_rule_matches_naive(
                model, images, LABELS, "lora", methods=("mixed", "bk"), weight_decay=0.05,
                weight_decay_variables=[v for v in model.trainable_variables
                                        if "lora_kernel" in v.path])

    def test_other_layers_get_other_rules(self):
        plain = keras.layers.Dense(3)
        plain.build((None, 4))
        self.assertEqual(rules.rule_for(plain).name, "dense")
        trained_kernel = keras.layers.Dense(3)
        trained_kernel.build((None, 4))
        trained_kernel.enable_lora(2)
        self.assertEqual(rules.rule_for(trained_kernel).name, "lora")
        # The base kernel trainable again: its own per-example gradient is needed.
        next(v for v in trained_kernel.weights if v.path.endswith("/kernel")).trainable = True
        self.assertEqual(rules.rule_for(trained_kernel).name, "generic")
        # The kernel's last axis contracted: B would act on the input.
        contracted = keras.layers.EinsumDense("ab,cb->ac", (3,))
        contracted.build((None, 4))
        contracted.enable_lora(2)
        self.assertEqual(rules.rule_for(contracted).name, "generic")

    def test_base_kernel_unfrozen_after_taps_is_refused(self):
        model = dense_model()
        x = sequences(6, 5, 8)
        rules.install_taps(model)
        layer = model.get_layer("seq")
        next(v for v in layer.weights if v.path.endswith("/kernel")).trainable = True
        with self.assertRaisesRegex(ValueError, "LoRA rule clips a layer's factors"):
            dp.clipped_grad_sum(model, dp_test_case.per_example_xent, x, LABELS,
                                l2_norm_clip=1.0, method="bk")


if __name__ == "__main__":
    tf.test.main()
