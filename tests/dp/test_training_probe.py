"""The training probe runs at the physical batch size, with the loss of training.

A layer that mixes examples only in batches of some size or more, one that
adds any row into another (a fixed middle row, or a random row per call), one
that mixes only for some input values (non-negative inputs, values above 200,
a preprocessing's range) or only on half of its random draws, a loss that is
not per-example, and a layer that writes non-trainable state from the batch
are refused with an error naming them; a per-example model and loss pass with
a leave-one-out figure of at most C, per-example random noise included.
"""

import types

import keras
import numpy as np
import tensorflow as tf

from tests.dp import dp_test_case
from tfdp.data import preprocessing
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


class AddsRowInto(keras.layers.Layer):
    """Adds `weight` × row `source` into row `target` of the batch.

    `source="middle"` is row `rows // 2`; `source=None` draws the source at
    random at every call (never the target), from TensorFlow's random ops
    without a Keras seed generator.
    """

    def __init__(self, target=0, source=None, weight=0.5, **kwargs):
        super().__init__(**kwargs)
        self.target, self.source, self.weight = target, source, weight

    def call(self, x):
        rows = tf.shape(x)[0]
        if self.source is None:
            source = (self.target + 1 + tf.random.uniform([], 0, rows - 1, tf.int32)) % rows
        elif self.source == "middle":
            source = rows // 2
        else:
            source = tf.constant(self.source)
        onto = tf.reshape(tf.one_hot(self.target, rows, dtype=x.dtype),
                          tf.concat([[rows], tf.ones([tf.rank(x) - 1], tf.int32)], 0))
        return x + self.weight * onto * tf.gather(x, source)[None]


class CentresNonNegative(keras.layers.Layer):
    """Subtracts the batch mean, only when every input is >= 0 (as [0, 1] images are)."""

    def call(self, x):
        centred = x - tf.reduce_mean(x, axis=0, keepdims=True)
        return tf.cond(tf.reduce_min(x) >= 0, lambda: centred, lambda: x)


class AddsRowWhenBright(keras.layers.Layer):
    """Adds the middle row into row 0, only when a value exceeds 200 (as 0-255 pixels do)."""

    def call(self, x):
        x = tf.cast(x, tf.float32)
        rows = tf.shape(x)[0]
        onto = tf.reshape(tf.one_hot(0, rows, dtype=x.dtype),
                          tf.concat([[rows], tf.ones([tf.rank(x) - 1], tf.int32)], 0))
        mixed = x + onto * tf.gather(x, rows // 2)[None]
        return tf.cond(tf.reduce_max(x) > 200, lambda: mixed, lambda: x)


class MixesWithinTwo(keras.layers.Layer):
    """Subtracts the batch mean, only when every input is in [-2, 1.2] and one is below -1.2."""

    def call(self, x):
        centred = x - tf.reduce_mean(x, axis=0, keepdims=True)
        fires = (tf.reduce_min(x) >= -2.0) & (tf.reduce_min(x) < -1.2) & (tf.reduce_max(x) <= 1.2)
        return tf.cond(fires, lambda: centred, lambda: x)


class MixesOnHalfTheDraws(keras.layers.Layer):
    """In training, mixes the batch with its reverse when a generator's draw is below 1/2."""

    def __init__(self, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.generator = tf.random.Generator.from_seed(seed)

    def call(self, x, training=False):
        if not training:
            return x
        coin, weight = tf.unstack(self.generator.uniform([2]))
        mixed = weight * x + (1 - weight) * tf.reverse(x, axis=[0])
        return tf.cond(coin < 0.5, lambda: mixed, lambda: x)


class GeneratorNoise(keras.layers.Layer):
    """In training, adds noise from a tf.random.Generator to each row: per-example."""

    def __init__(self, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.generator = tf.random.Generator.from_seed(seed)

    def call(self, x, training=False):
        if not training:
            return x
        return x + 0.1 * self.generator.normal(tf.shape(x))


class RunningMean(keras.layers.Layer):
    """Keeps a running mean of its training inputs in a non-trainable variable."""

    def build(self, shape):
        self.mean = self.add_weight(shape=shape[-1:], initializer="zeros", trainable=False,
                                    name="running_mean")

    def call(self, x, training=False):
        if training:
            axes = list(range(len(x.shape) - 1))
            self.mean.assign(0.9 * self.mean + 0.1 * tf.reduce_mean(x, axis=axes))
        return x


class StatsAfterOutput(keras.layers.BatchNormalization):
    """A frozen BatchNorm that updates `moving_mean` from the batch after its output."""

    def call(self, x, training=None, mask=None):
        out = super().call(x, training=False, mask=mask)
        self.moving_mean.assign(tf.reduce_mean(x, axis=list(range(len(x.shape) - 1))))
        return out


def dense_model(layer, input_shape=(6, 6, 1)):
    """Flatten, Dense(5), `layer`, Dense(3): `layer` sees `[rows, 5]`."""
    x = keras.Input(input_shape)
    h = keras.layers.Dense(5, activation="tanh")(keras.layers.Flatten()(x))
    return keras.Model(x, keras.layers.Dense(3)(layer(h)))


def input_model(layer, input_shape=(6, 6, 1), dtype="float32"):
    """`layer` on the inputs themselves (giving floats), then Flatten, Dense(3)."""
    x = keras.Input(input_shape, dtype=dtype)
    return keras.Model(x, keras.layers.Dense(3)(keras.layers.Flatten()(layer(x))))


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

    def test_any_row_added_into_another_is_refused_at_every_batch_size(self):
        # Row j of the middle of the batch into row 0, and a random row per
        # call: every row is tested against every other.
        for rows in (4, 7, 16):
            for source in ("middle", None):
                with self.subTest(rows=rows, source=source):
                    model = dense_model(AddsRowInto(0, source, name="adds_row"))
                    with self.assertRaisesRegex(ValueError, "Layer 'adds_row' mixes examples"):
                        guards.check_sensitivity(model, INFO, rows, **CLIP)
        # Into the last row from the first, at 32 rows, on conv feature maps.
        report = model_probe.probe(
            subtle_mixing_model(AddsRowInto(31, 0, 1e-2, name="into_last")), rows=32)
        self.assertEqual(report.mixing_layer, "into_last")

    def test_cross_user_row_refused_at_user_level(self):
        # Users of 2 rows each: a row of user 2 added into a row of user 1.
        model = dense_model(AddsRowInto(0, 2, name="cross_user"))
        with self.assertRaisesRegex(ValueError, "Layer 'cross_user' mixes examples"):
            guards.check_sensitivity(model, INFO, 4, **{**CLIP, "augmentation_multiplicity": 2})

    def test_every_pair_of_rows_is_separated_by_a_changed_set(self):
        for rows in (4, 5, 33, 256):
            sets = model_probe.changed_row_sets(rows)
            for i in range(rows):
                # Rows j that some set holds without i: all but i.
                tested = np.any(sets[sets[:, i] == 0], axis=0)
                self.assertEqual(int(np.sum(tested)), rows - 1, msg=f"rows={rows}, i={i}")

    def test_state_written_from_the_batch_is_refused_naming_it(self):
        for layer, variable in ((RunningMean(name="running"), "running_mean"),
                                (StatsAfterOutput(name="leaky_bn", trainable=False),
                                 "moving_mean")):
            with self.subTest(layer=layer.name):
                model = dense_model(layer)
                before = [v.numpy() for v in model.non_trainable_variables]
                with self.assertRaisesRegex(
                        ValueError, f"Layer '{layer.name}' writes variable '.*{variable}'"):
                    guards.check_sensitivity(model, INFO, 8, **CLIP)
                # The probe leaves the state as it found it.
                for b, v in zip(before, model.non_trainable_variables):
                    self.assertAllEqual(b, v.numpy())

    def test_frozen_batchnorm_and_dropout_pass(self):
        bn = keras.layers.BatchNormalization(name="frozen_bn")
        x = keras.Input((6, 6, 1))
        h = keras.layers.Dense(5, activation="tanh")(keras.layers.Flatten()(x))
        h = keras.layers.Dropout(0.5)(bn(h))
        model = keras.Model(x, keras.layers.Dense(3)(h))
        bn.trainable = False
        report = model_probe.probe(model, rows=8)
        self.assertIsNone(report.mixing_layer)
        self.assertEqual(report.state_writes, [])

    def test_loss_adding_a_middle_row_into_another_refused(self):
        def row_into_first(y_true, logits):
            rows = tf.shape(logits)[0]
            into = tf.one_hot(0, rows)[:, None] * logits[rows // 2][None]
            return dp_test_case.per_example_xent(y_true, logits + into)

        model = plain_model()
        with self.assertRaisesRegex(ValueError, "loss 'row_into_first' mixes examples"):
            sensitivity.probe_training(model, row_into_first, self._batch(model, 8), 1.0)

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

    def test_mixing_only_for_some_input_values_refused_by_the_trainer_probe(self):
        # Centring only when every input is >= 0 (as on [0, 1] images), a row
        # added into another only when a value exceeds 200 (as on 0-255
        # pixels): the standard normal triggers neither, the typical ranges do.
        for layer in (CentresNonNegative(name="centres_non_negative"),
                      AddsRowWhenBright(name="adds_row_when_bright")):
            with self.subTest(layer=layer.name):
                with self.assertRaisesRegex(ValueError, f"Layer '{layer.name}' mixes examples"):
                    guards.check_sensitivity(input_model(layer), INFO, 8, **CLIP)

    def test_float_batches_cover_the_typical_ranges_and_their_edges(self):
        ranges = model_probe.probe_value_ranges("float32")
        self.assertEqual(ranges, [None, ((0.0,), (1.0,)), ((-1.0,), (1.0,)), ((0.0,), (255.0,))])
        model = plain_model()
        for value_range in ranges[1:]:
            (low,), (high,) = value_range
            x, other = (t.numpy() for t in model_probe.probe_inputs(
                model, (6, 6, 1), "float32", 8, value_range=value_range))
            self.assertTrue(np.all(x[0] == low) and np.all(x[1] == high), msg=value_range)
            for t in (x, other):
                self.assertTrue(np.all((t >= low) & (t <= high)), msg=value_range)
            self.assertTrue(np.all(np.any(np.reshape(x != other, [8, -1]), axis=1)))
        # A public range the route knows is added once; the known ones are not repeated.
        self.assertLen(model_probe.probe_value_ranges("float32", [(0.0, 1.0), (-2.0, 1.0)]), 5)

    def test_uint8_inputs_span_0_to_255_and_bright_mixing_is_refused(self):
        model = input_model(AddsRowWhenBright(name="adds_row_when_bright"), dtype="uint8")
        x, _ = model_probe.probe_inputs(model, (6, 6, 1), "uint8", 8)
        x = x.numpy()
        self.assertTrue(np.all(x[0] == 0) and np.all(x[1] == 255))
        self.assertGreater(len(np.unique(x)), 100)
        report = model_probe.probe(model, tf.zeros([8, 6, 6, 1], tf.uint8))
        self.assertEqual(report.mixing_layer, "adds_row_when_bright")

    def test_the_trainers_preprocessing_range_is_probed(self):
        # Normalised with mean 2/3 and std 1/3: inputs in [-2, 1]. The layer
        # mixes only there, which no typical range triggers.
        preprocess = preprocessing.cifar_train_preprocess(padding=0, mean=(2 / 3,),
                                                          std=(1 / 3,))
        value_range = guards.preprocessed_range(preprocess, INFO.image_shape)
        self.assertAllClose(value_range, ((-2.0,), (1.0,)))
        self.assertIsNone(guards.preprocessed_range(None, INFO.image_shape))
        model = input_model(MixesWithinTwo(name="mixes_within_two"))
        figure = guards.check_sensitivity(model, INFO, 8, **CLIP)
        self.assertLessEqual(figure, 1.0 + sensitivity.TOLERANCE)
        with self.assertRaisesRegex(ValueError, "Layer 'mixes_within_two' mixes examples"):
            guards.check_sensitivity(model, INFO, 8, input_range=value_range, **CLIP)

    def test_mixing_on_half_of_a_generators_draws_is_refused_every_time(self):
        # Each trial starts from its own generator state: a draw that mixes
        # comes up in one of them, whatever the generator's seed.
        for seed in range(6):
            with self.subTest(seed=seed):
                layer = MixesOnHalfTheDraws(seed, name="half_the_draws")
                report = model_probe.probe(dense_model(layer), rows=8)
                self.assertEqual(report.mixing_layer, "half_the_draws")

    def test_per_example_generator_noise_passes_and_its_state_is_restored(self):
        layer = GeneratorNoise(name="noise")
        model = dense_model(layer)
        before = layer.generator.state.numpy()
        numpy_before = np.random.get_state()[1].copy()
        for method in ("auto", "naive"):
            figure = sensitivity.probe_training(model, dp_test_case.per_example_xent,
                                                self._batch(model, 8), 1e-3, method)
            self.assertAllClose(figure, 1.0, atol=1e-4, msg=method)
        self.assertAllEqual(layer.generator.state.numpy(), before)
        self.assertAllEqual(np.random.get_state()[1], numpy_before)

    def test_an_unbounded_figure_names_a_fix_that_fits_the_method(self):
        with self.assertRaisesRegex(ValueError, "Use method='naive' or 'vectorized'"):
            sensitivity.refuse_unbounded(1.5, "bk")
        for method in ("naive", "vectorized"):
            with self.assertRaises(ValueError) as caught:
                sensitivity.refuse_unbounded(1.5, method)
            self.assertNotIn("Use method=", str(caught.exception))
            self.assertIn("per-example", str(caught.exception))

    def test_synthetic_batch_rows_are_distinct(self):
        x, y = self._batch(plain_model(), 6)
        self.assertEqual(x.shape[0], 6)
        flat = np.reshape(x.numpy(), [6, -1])
        self.assertLen({row.tobytes() for row in flat}, 6)
        self.assertTrue(np.all((y.numpy() >= 0) & (y.numpy() < 3)))


if __name__ == "__main__":
    tf.test.main()
