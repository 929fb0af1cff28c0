"""Every method bounds each example's contribution by C, or refuses the model.

Models the per-layer taps once got wrong (tied weights, a layer mixing
examples, in-layer dropout, mixed precision): for each method, either a clear
error, or a leave-one-out sensitivity ≤ C·(1 + 1e-4) and the naive loop's sum.
"""

import pytest
import keras
import numpy as np
import tensorflow as tf

from tests.dp import dp_test_case
from tfdp import dp

METHODS = ("naive", "vectorized", "ghost", "mixed", "bk", "auto")
TAPPED = ("ghost", "mixed", "bk")


class TiedOutput(keras.layers.Layer):
    """Logits from the transposed embedding table (tied input/output embeddings)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return tf.matmul(h, tf.cast(self.embedding.embeddings, h.dtype), transpose_b=True)


class TransposedDense(keras.layers.Layer):
    """Uses another Dense layer's kernel, transposed (a tied autoencoder)."""

    def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense

    def call(self, x):
        return tf.matmul(x, self.dense.kernel, transpose_b=True)


class BatchCenter(keras.layers.Layer):
    """Subtracts the batch mean: example i's output depends on every example."""

    def call(self, x):
        return x - tf.reduce_mean(x, axis=0, keepdims=True)


class DropoutDense(keras.layers.Layer):
    """A weight-owning layer with dropout inside its own call."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dropout = keras.layers.Dropout(0.3, seed=3)

    def build(self, shape):
        self.kernel = self.add_weight(shape=(shape[-1], self.units), name="kernel")

    def call(self, x, training=None):
        return self.dropout(tf.matmul(x, self.kernel), training=training)


def tied_embedding_model(vocab=12, seq=5, dim=6):
    ids = keras.Input((seq,), dtype="int32")
    embedding = keras.layers.Embedding(vocab, dim, name="embedding")
    h = keras.layers.Dense(dim, activation="tanh", name="mix")(embedding(ids))
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(ids, TiedOutput(embedding, name="tied_output")(h))


def tied_dense_model():
    x = keras.Input((8,))
    encoder = keras.layers.Dense(4, activation="tanh", name="encoder")
    h = TransposedDense(encoder, name="decoder")(encoder(x))
    return keras.Model(x, keras.layers.Dense(3, name="head")(h))


def batch_mean_model():
    x = keras.Input((8,))
    h = keras.layers.Dense(6, activation="tanh")(x)
    h = BatchCenter(name="batch_center")(h)
    return keras.Model(x, keras.layers.Dense(3)(h))


def shared_dense_model():
    x = keras.Input((8,))
    shared = keras.layers.Dense(8, activation="tanh", name="shared")
    h = shared(shared(x))  # Called twice: the taps concatenate both calls.
    return keras.Model(x, keras.layers.Dense(3)(h))


def dropout_model():
    x = keras.Input((8,))
    h = keras.layers.Dense(8, activation="relu")(x)
    h = DropoutDense(6, name="dropout_dense")(h)
    return keras.Model(x, keras.layers.Dense(3)(keras.layers.Activation("tanh")(h)))


def bf16_convnet():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        x = keras.Input((8, 8, 3))
        h = keras.layers.Conv2D(6, 3, activation="relu")(x)
        h = keras.layers.GroupNormalization(3)(h)
        h = keras.layers.Conv2D(4, 3, strides=2, padding="same")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        out = keras.layers.Dense(3, dtype="float32")(keras.layers.Dense(8, activation="tanh")(h))
        return keras.Model(x, out)
    finally:
        keras.config.set_dtype_policy(previous)


def bf16_text_model():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        return dp_test_case.text_model()
    finally:
        keras.config.set_dtype_policy(previous)


def _floats(shape, seed=0):
    x = np.random.default_rng(seed).normal(size=shape).astype("float32")
    x[1] *= 4.0  # Spread the norms: C at the median clips some examples.
    return tf.constant(x)


def _ids(shape, vocab, seed=0):
    return tf.constant(np.random.default_rng(seed).integers(0, vocab, size=shape), tf.int32)


class SensitivityTest(dp_test_case.DPTestCase):

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(1)

    def _median_clip(self, model, x, y, training=True):
        _, norms = dp.clipped_grad_sum(
            model, dp_test_case.per_example_xent, x, y, l2_norm_clip=1e9, method="naive",
            training=training,
        )
        return float(np.median(norms.numpy()))

    def check_methods(self, model, x, y, refused=(), error="", grad_rtol=1e-4,
                      compare_in_inference=False):
        """Refused methods raise `error`; the others are bounded and match naive.

        With `compare_in_inference` (random layers), sums are compared with
        dropout off; sensitivity is measured with it on.
        """
        loss = dp_test_case.per_example_xent
        clip, ref = 1.0, None
        if "naive" not in refused:
            clip = self._median_clip(model, x, y, training=not compare_in_inference)
            ref, _ = dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=clip, method="naive",
                                         training=not compare_in_inference)
        for method in METHODS:
            if method in refused:
                with self.assertRaisesRegex(ValueError, error, msg=method):
                    dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=clip, method=method)
                continue
            probe = (x[:4], y[:4])  # Example 1, scaled up, is clipped.
            figure = dp.check_sensitivity(model, loss, probe, clip, method)
            self.assertLessEqual(figure, 1.0 + 1e-4, msg=method)
            self.assertGreater(figure, 0.99, msg=method)  # The clipped examples reach C.
            # C tiny: every example is clipped, so every contribution is exactly C.
            tiny = dp.check_sensitivity(model, loss, probe, 1e-3 * clip, method)
            self.assertAllClose(tiny, 1.0, atol=1e-4, msg=method)
            grads, _ = dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=clip, method=method,
                                           training=not compare_in_inference)
            # Relative to the largest entry of all sums: under bf16 a small sum
            # of cancelling terms (a bias) differs by more than its own scale.
            scale = max(float(tf.reduce_max(tf.abs(r))) for r in ref) + 1e-6
            for v, g, r in zip(model.trainable_variables, grads, ref):
                self.assertAllClose(r / scale, g / scale, rtol=grad_rtol, atol=grad_rtol,
                                    msg=f"{v.path}, method={method}")

    def test_tied_input_output_embeddings(self):
        model = tied_embedding_model()
        x, y = _ids((6, 5), 12), tf.constant([0, 3, 5, 7, 9, 11])
        self.check_methods(model, x, y, refused=TAPPED,
                           error="'tied_output' reads variable 'embedding/embeddings'")
        self.assertEqual(dp.resolve_method(model, "auto", x), "vectorized")

    def test_tied_dense(self):
        model = tied_dense_model()
        x, y = _floats((6, 8)), tf.constant([0, 1, 2, 0, 1, 2])
        self.check_methods(model, x, y, refused=TAPPED,
                           error="'decoder' reads variable 'encoder/kernel'.*method='vectorized'")

    def test_batch_mean_layer_is_refused_by_every_method(self):
        model = batch_mean_model()
        x, y = _floats((6, 8)), tf.constant([0, 1, 2, 0, 1, 2])
        self.check_methods(model, x, y, refused=METHODS, error="'batch_center' mixes examples")
        with self.assertRaisesRegex(ValueError, "mixes examples"):
            dp.check_sensitivity(model, dp_test_case.per_example_xent, (x, y), 1.0, "bk")

    def test_shared_layer_called_twice(self):
        model = shared_dense_model()
        x, y = _floats((6, 8)), tf.constant([0, 1, 2, 0, 1, 2])
        self.check_methods(model, x, y)

    def test_dropout_inside_a_weight_owning_layer(self):
        model = dropout_model()
        x, y = _floats((6, 8)), tf.constant([0, 1, 2, 0, 1, 2])
        self.check_methods(model, x, y, compare_in_inference=True)

    @pytest.mark.slow  # tests/test_distribute.py checks bf16 clipping norms fast.
    def test_mixed_bfloat16_convnet(self):
        model = bf16_convnet()
        x, y = _floats((6, 8, 8, 3)), tf.constant([0, 1, 2, 0, 1, 2])
        # bf16 forward passes of one example and of the batch round differently.
        self.check_methods(model, x, y, grad_rtol=3e-2)

    @pytest.mark.slow
    def test_mixed_bfloat16_text_model(self):
        model = bf16_text_model()
        x, y = _ids((6, 7), 20), tf.constant([0, 1, 2, 0, 1, 2])
        self.check_methods(model, x, y, grad_rtol=3e-2)

    def test_returns_a_figure_per_method(self):
        model = shared_dense_model()
        x, y = _floats((4, 8)), tf.constant([0, 1, 2, 0])
        figures = dp.check_sensitivity(model, dp_test_case.per_example_xent, (x, y), 1e-3,
                                       ("bk", "ghost"))
        self.assertEqual(set(figures), {"bk", "ghost"})
        for figure in figures.values():  # C tiny: every example is clipped to exactly C.
            self.assertAllClose(figure, 1.0, atol=1e-4)


if __name__ == "__main__":
    tf.test.main()
