"""Rule `einsum_dense`: EinsumDense, as in MultiHeadAttention's projections."""

import keras
import numpy as np
import tensorflow as tf

from tests.dp import dp_test_case
from tests.dp.rules import rule_test_case
from tfdp import dp
from tfdp.dp.rules import einsum_dense


def _attention_model():
    inp = keras.Input((7, 16))
    attention = keras.layers.MultiHeadAttention(2, 8, name="mha")
    h = attention(inp, inp)
    # The key bias adds the same logit to every key of a query, which the
    # softmax cancels: its gradient is zero up to rounding, which no method
    # reproduces. Frozen, so that the sums compared are not rounding noise.
    attention._key_dense.bias.trainable = False
    # Few outputs: the layer-wise rule instantiates this one (2T² > p·D).
    h = keras.layers.EinsumDense("abc,cd->abd", (None, 2), bias_axes="d", name="narrow")(h)
    # An ellipsis, and a bias over the last of two produced axes.
    h = keras.layers.EinsumDense("...c,cde->...de", (3, 2), bias_axes="e", name="ellipsis")(h)
    h = keras.layers.Reshape((7, 6))(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inp, keras.layers.Dense(3, name="head")(h))


def _sequences(batch, seed=0):
    x = np.random.default_rng(seed).normal(size=(batch, 7, 16)).astype("float32")
    x[1] *= 5.0
    return tf.constant(x)


class EinsumDenseRuleTest(rule_test_case.RuleTestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        keras.utils.set_random_seed(4)
        cls.model = _attention_model()

    def test_plan_puts_projections_on_the_rule(self):
        by_name = {l.name: l for l in dp.plan(self.model, (7, 16), 8, method="mixed").layers}
        for name in ("query", "key", "value", "attention_output"):
            self.assertEqual(by_name[name].kind, "einsum_dense")
        # T = 7 positions; query: p = heads·key size = 16, D = 16: 2T² < p·D.
        self.assertEqual((by_name["query"].t, by_name["query"].p, by_name["query"].d), (7, 16, 16))
        self.assertEqual(by_name["query"].mode, "ghost")
        self.assertEqual((by_name["attention_output"].p, by_name["attention_output"].d), (16, 16))
        self.assertEqual(by_name["narrow"].mode, "instantiate")
        self.assertEqual((by_name["ellipsis"].t, by_name["ellipsis"].p), (7, 6))

    def test_matches_naive_with_weight_decay(self):
        self.assert_rule_matches_naive(
            self.model, _sequences(6), tf.constant([0, 1, 2, 0, 1, 2]), "einsum_dense",
            sample_weight=rule_test_case.weights(6), weight_decay=0.05,
            weight_decay_variables=[v for v in self.model.trainable_variables
                                    if v.path.endswith("kernel")],
        )

    def test_bk_instantiates_projections_that_keep_no_more_than_a_ghost_sum(self):
        # T = 20 positions, D = p = 32: 2T² < pD, so the layer-wise rule
        # takes ghost norms; but the per-example gradient (pD = 1024 floats)
        # is no larger than the input and output gradient that bk keeps for
        # a ghost sum (T(D + p) = 1280), so bk instantiates it instead.
        keras.utils.set_random_seed(6)
        inp = keras.Input((20, 32))
        attention = keras.layers.MultiHeadAttention(4, 8, name="mha")
        h = attention(inp, inp)
        attention._key_dense.bias.trainable = False  # As in `_attention_model`.
        h = keras.layers.Dense(32, name="dense")(h)  # The same rule through `Dense`.
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(inp, keras.layers.Dense(3, name="head")(h))
        bk = {l.name: l for l in dp.plan(model, (20, 32), 4, method="bk").layers}
        mixed = {l.name: l for l in dp.plan(model, (20, 32), 4, method="mixed").layers}
        for name in ("query", "key", "value", "attention_output", "dense"):
            self.assertEqual((bk[name].mode, mixed[name].mode), ("instantiate", "ghost"), name)
            self.assertEqual(bk[name].why, "2T²<pD, but bk: pD≤input+output")
            self.assertEqual(bk[name].kept_bytes, 4 * 32 * 32 * 4)  # B·D·p floats.
        x = tf.constant(np.random.default_rng(2).normal(size=(6, 20, 32)), tf.float32)
        self.assert_rule_matches_naive(model, x * [[[1.0]], [[5.0]], [[1.0]], [[1.0]], [[1.0]],
                                                   [[1.0]]], tf.constant([0, 1, 2, 0, 1, 2]),
                                       "einsum_dense", sample_weight=rule_test_case.weights(6))

    def test_rows_per_example(self):
        x, y = _sequences(8, seed=1), tf.constant(np.repeat([0, 1, 2, 0], 2))
        loss = dp_test_case.per_example_xent
        ref, ref_norms = dp.clipped_grad_sum(self.model, loss, x, y, l2_norm_clip=0.5,
                                             method="naive", augmentation_multiplicity=2)
        for method in ("vectorized", "ghost", "mixed", "bk"):
            got, norms = dp.clipped_grad_sum(self.model, loss, x, y, l2_norm_clip=0.5,
                                             method=method, augmentation_multiplicity=2)
            self.assertAllClose(ref_norms, norms, rtol=1e-4, msg=method)
            for r, g in zip(ref, got):
                self.assertAllClose(r, g, rtol=1e-4, atol=1e-6, msg=method)

    def test_other_equations_get_the_generic_rule(self):
        # "abc,bc->abc": the kernel axis b is also an input and output axis.
        layout = einsum_dense.EinsumLayout("abc,bc->abc", 3)
        self.assertFalse(layout.valid)
        # An input axis summed away.
        self.assertFalse(einsum_dense.EinsumLayout("abc,cd->ad", 3).valid)
        self.assertTrue(einsum_dense.EinsumLayout("abcd,cde->abe", 4).valid)


if __name__ == "__main__":
    tf.test.main()
