"""The training probe runs at the physical batch size, with the loss of training.

A layer that mixes examples only in batches of some size or more, and a loss
that is not per-example, are refused with an error naming them; a per-example
model and loss pass with a leave-one-out figure of at most C.
"""

import types

import keras
import numpy as np
import tensorflow as tf

from tests.dp import dp_test_case
from tfdp.training import guards
from tfdp.dp import model_probe
from tfdp.dp import sensitivity


class MixesFrom(keras.layers.Layer):
    """Subtracts the batch mean, but only in batches of `rows` rows or more."""

    def __init__(self, rows=4, **kwargs):
        super().__init__(**kwargs)
        self.rows = rows

    def call(self, x):
        centred = x - tf.reduce_mean(x, axis=0, keepdims=True)
        return tf.cond(tf.shape(x)[0] >= self.rows, lambda: centred, lambda: x)

    def get_config(self):
        return {**super().get_config(), "rows": self.rows}


class LastRowSees(keras.layers.Layer):
    """Adds `weight` × example 0's values to the LAST example only."""

    def __init__(self, weight=1e-2, **kwargs):
        super().__init__(**kwargs)
        self.weight = weight

    def call(self, x):
        extra = tf.one_hot(tf.shape(x)[0] - 1, tf.shape(x)[0])[:, None, None, None]
        return x + self.weight * extra * x[:1]


class OneValueSees(keras.layers.Layer):
    """Moves ONE value of every other example by 1 % of example 0's first value."""

    def call(self, x):
        flat = tf.reshape(x, [tf.shape(x)[0], -1])
        spike = tf.one_hot(7, tf.shape(flat)[1])[None, :] * 1e-2 * flat[:1, :1]
        return tf.reshape(flat + spike * tf.cast(tf.range(tf.shape(x)[0]) > 0, x.dtype)[:, None],
                          tf.shape(x))


def subtle_mixing_model(layer, input_shape=(16, 16, 8)):
    x = keras.Input(input_shape)
    h = keras.layers.Conv2D(8, 3, padding="same")(x)
    h = layer(h)
    return keras.Model(x, keras.layers.Dense(3)(keras.layers.Flatten()(h)))


def mixing_model(rows=4, input_shape=(6, 6, 1)):
    x = keras.Input(input_shape)
    h = keras.layers.Dense(5, activation="tanh")(keras.layers.Flatten()(x))
    h = MixesFrom(rows, name=f"mixes_from_{rows}")(h)
    return keras.Model(x, keras.layers.Dense(3)(h))


def plain_model(input_shape=(6, 6, 1)):
    x = keras.Input(input_shape)
    h = keras.layers.Dense(5, activation="tanh")(keras.layers.Flatten()(x))
    return keras.Model(x, keras.layers.Dense(3)(h))


def batch_mean_xent(y_true, logits):
    """Cross-entropy of p − mean_over_batch(p): not per-example."""
    return keras.losses.sparse_categorical_crossentropy(
        y_true, logits - tf.reduce_mean(logits, axis=0, keepdims=True), from_logits=True)


INFO = types.SimpleNamespace(image_shape=(6, 6, 1), num_classes=3)
CLIP = dict(l2_norm_clip=1.0, method="auto", weight_decay=0.0, augmentation_multiplicity=1)


class TrainingProbeTest(dp_test_case.DPTestCase):

    def _batch(self, model, rows):
        return sensitivity.synthetic_batch(model, rows, INFO.image_shape, "float32",
                                           num_classes=3)

    def test_the_model_probe_has_at_least_four_rows(self):
        model = mixing_model(4)
        report = model_probe.probe(model, tf.zeros([3, 6, 6, 1]))
        self.assertEqual(report.mixing_layer, "mixes_from_4")

    def test_subtle_mixing_is_found_from_the_digests(self):
        # The probe keeps a digest of each layer call's rows, not the rows:
        # a change to one row of 32, or to one value in 2,048 of every row,
        # still names the layer; the plain conv before it does not mix.
        for layer in (LastRowSees(name="last_row_sees"), OneValueSees(name="one_value_sees")):
            with self.subTest(layer=layer.name):
                report = model_probe.probe(subtle_mixing_model(layer), rows=32)
                self.assertEqual(report.mixing_layer, layer.name)
        plain = subtle_mixing_model(keras.layers.Activation("relu", name="relu"))
        self.assertIsNone(model_probe.probe(plain, rows=32).mixing_layer)

    def test_layer_mixing_from_four_rows_refused_by_the_trainer_probe(self):
        with self.assertRaisesRegex(ValueError, "Layer 'mixes_from_4' mixes examples"):
            guards.check_sensitivity(mixing_model(4), INFO, 4, **CLIP)

    def test_probe_runs_at_the_physical_batch_size(self):
        # Mixing from 16 rows on: found at a physical batch of 16, not at 8.
        model = mixing_model(16)
        figure = guards.check_sensitivity(model, INFO, 8, **CLIP)
        self.assertLessEqual(figure, 1.0 + sensitivity.TOLERANCE)
        with self.assertRaisesRegex(ValueError, "Layer 'mixes_from_16' mixes examples"):
            guards.check_sensitivity(model, INFO, 16, **CLIP)

    def test_batch_mean_loss_refused_naming_it(self):
        model = plain_model()
        with self.assertRaisesRegex(ValueError, "loss 'batch_mean_xent' mixes examples"):
            sensitivity.probe_training(model, batch_mean_xent, self._batch(model, 8), 1.0)

    def test_per_example_model_and_loss_pass(self):
        model = plain_model()
        figure = sensitivity.probe_training(model, dp_test_case.per_example_xent,
                                            self._batch(model, 8), 1e-3)
        # C far below the gradient norms: every example is clipped to exactly C.
        self.assertAllClose(figure, 1.0, atol=1e-4)

    def test_synthetic_batch_rows_are_distinct(self):
        x, y = self._batch(plain_model(), 6)
        self.assertEqual(x.shape[0], 6)
        flat = np.reshape(x.numpy(), [6, -1])
        self.assertLen({row.tobytes() for row in flat}, 6)
        self.assertTrue(np.all((y.numpy() >= 0) & (y.numpy() < 3)))


if __name__ == "__main__":
    tf.test.main()
