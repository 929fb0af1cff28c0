"""tfdp's GroupNormalization: Keras's layer, with channel-first moments."""

import os

import keras
import numpy as np
import tensorflow as tf
from absl.testing import parameterized

from tfdp import layers


def _pair(groups, shape, rng, **kwargs):
    """Keras's and tfdp's layer, built for `shape`, with the same random weights."""
    ours = layers.GroupNormalization(groups, **kwargs)
    theirs = keras.layers.GroupNormalization(groups, **kwargs)
    for layer in (ours, theirs):
        layer.build(shape)
    for a, b in zip(ours.weights, theirs.weights):
        value = rng.normal(size=a.shape).astype(np.float32)
        a.assign(value)
        b.assign(value)
    return ours, theirs


class GroupNormalizationTest(tf.test.TestCase, parameterized.TestCase):

    @parameterized.parameters(
        ((5, 6, 6, 8), 4, {}),
        ((3, 14, 14, 16), 4, {"epsilon": 1e-5}),
        ((4, 4, 4, 64), 32, {}),
        ((5, 9, 6), 2, {"center": False}),
        ((6, 12), 3, {"scale": False}),
        ((3, 4, 4, 8), -1, {}),  # One group per channel.
        ((2, 3, 3, 2, 6), 3, {}),  # Rank 5.
        ((4, 6, 5), 2, {"axis": 1}),  # Not channels last: Keras's computation.
    )
    def test_outputs_and_gradients_match_keras(self, shape, groups, kwargs):
        rng = np.random.default_rng(0)
        ours, theirs = _pair(groups, shape, rng, **kwargs)
        # Far from zero mean: a single-pass E[x²] − E[x]² variance would fail here.
        x = tf.constant(rng.normal(50.0, 3.0, size=shape), tf.float32)
        dy = tf.constant(rng.normal(size=shape), tf.float32)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            y_ours, y_theirs = ours(x), theirs(x)
        self.assertAllClose(y_ours, y_theirs, atol=2e-5, rtol=1e-5)
        for a, b in zip(tape.gradient(y_ours, [x] + ours.trainable_weights, dy),
                        tape.gradient(y_theirs, [x] + theirs.trainable_weights, dy)):
            self.assertAllClose(a, b, atol=5e-5, rtol=1e-4)

    def test_statistics_are_each_channels_group_values(self):
        rng = np.random.default_rng(1)
        layer, _ = _pair(2, (3, 4, 4, 6), rng, epsilon=1e-3)
        x = rng.normal(1.0, 2.0, size=(3, 4, 4, 6)).astype(np.float32)
        _, (mean, inv_std) = layer.normalize(tf.constant(x))
        grouped = x.reshape(3, 16, 2, 3)
        expected_mean = grouped.mean(axis=(1, 3))  # [B, groups]
        expected_inv = 1.0 / np.sqrt(grouped.var(axis=(1, 3)) + 1e-3)
        self.assertEqual(mean.shape, (3, 1, 6))
        self.assertAllClose(mean[:, 0, :], np.repeat(expected_mean, 3, axis=1), atol=1e-5)
        self.assertAllClose(inv_std[:, 0, :], np.repeat(expected_inv, 3, axis=1), rtol=1e-4)

    def test_unknown_batch_and_spatial_sizes(self):
        layer = layers.GroupNormalization(2)
        fn = tf.function(layer, input_signature=[tf.TensorSpec([None, None, None, 4])])
        x = tf.random.normal([3, 5, 7, 4])
        self.assertAllClose(fn(x), layer(x))

    def test_mixed_precision_keeps_the_compute_dtype(self):
        layer = layers.GroupNormalization(2, dtype="mixed_bfloat16")
        reference = keras.layers.GroupNormalization(2, dtype="mixed_bfloat16")
        x = tf.random.normal([2, 4, 4, 4])
        y = layer(x)
        self.assertEqual(y.dtype, tf.bfloat16)
        self.assertAllClose(tf.cast(y, tf.float32), tf.cast(reference(x), tf.float32), atol=0.05)

    def test_saves_and_loads_as_tfdp_group_norm(self):
        inputs = keras.Input((4, 4, 4))
        model = keras.Model(inputs, layers.GroupNormalization(2, epsilon=1e-4)(inputs))
        model.layers[-1].gamma.assign([0.5, 1.0, 1.5, 2.0])
        path = os.path.join(self.get_temp_dir(), "gn.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertIsInstance(loaded.layers[-1], layers.GroupNormalization)
        self.assertEqual(loaded.layers[-1].epsilon, 1e-4)
        x = tf.random.normal([2, 4, 4, 4])
        self.assertAllClose(loaded(x), model(x))


if __name__ == "__main__":
    tf.test.main()
