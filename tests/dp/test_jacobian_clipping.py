"""The "jacobian" method (a loss vector and its tape) gives the naive loop's clipped sum."""

import keras
import numpy as np
import tensorflow as tf

from tests.dp import dp_test_case
from tfdp import dp
from tfdp import models

MODEL_METHODS = ("vectorized", "ghost", "mixed", "bk", "auto")
BATCH = 6


def _conv_group_norm_dense():
    inp = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, activation="relu")(inp)
    h = models.GroupNormalization(2, epsilon=1e-5)(h)
    h = keras.layers.Conv2D(4, 3, strides=2)(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(inp, keras.layers.Dense(3)(h))


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, 8, 8, 3)).astype("float32")
    x[1] *= 5.0  # Spread the norms so that C at the median clips some.
    return x, tf.constant(np.arange(BATCH) % 3, tf.int32)


def _jacobian(model, x, y, clip, rows_per_unit=1):
    """The custom loop's way: a loss vector (units' mean losses) and its tape."""
    with tf.GradientTape() as tape:
        losses = dp_test_case.per_example_xent(y, model(x, training=True))
        losses = tf.reduce_mean(tf.reshape(losses, [-1, rows_per_unit]), axis=1)
    return dp.jacobian_clipped_sum(tape, losses, model.trainable_variables, clip)


class JacobianClippingTest(dp_test_case.DPTestCase):

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(1)

    def assert_sums_close(self, model, want, got, rtol=1e-4):
        self.assertLen(got, len(model.trainable_variables))
        for v, r, g in zip(model.trainable_variables, want, got):
            scale = float(tf.reduce_max(tf.abs(r))) + 1e-6
            self.assertAllClose(r / scale, g / scale, rtol=rtol, atol=rtol, msg=v.path)

    def test_per_example_matches_naive_and_every_method(self):
        model = _conv_group_norm_dense()
        x, y = _batch()
        loss = dp_test_case.per_example_xent
        # Every model method equals the naive loop at C = the median norm.
        clip = self.assert_methods_match_naive(model, loss, x, y, MODEL_METHODS)
        want, want_norms = dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=clip,
                                               method="naive")
        got, norms = _jacobian(model, tf.constant(x), y, clip)
        self.assertAllClose(want_norms, norms, rtol=1e-4)
        self.assert_sums_close(model, want, got)

    def test_microbatches_of_two_rows_match_naive_on_microbatch_means(self):
        model = _conv_group_norm_dense()
        x, y = _batch(seed=2)
        loss = dp_test_case.per_example_xent
        # The naive loop's example of k rows is the mean of their losses:
        # TF-Privacy's microbatch.
        _, norms = dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=1e9, method="naive",
                                       augmentation_multiplicity=2)
        clip = float(np.median(norms.numpy()))
        self.assertGreater(np.sum(norms.numpy() > clip * 1.001), 0)
        want, want_norms = dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=clip,
                                               method="naive", augmentation_multiplicity=2)
        got, got_norms = _jacobian(model, tf.constant(x), y, clip, rows_per_unit=2)
        self.assertEqual(got_norms.shape, [BATCH // 2])
        self.assertAllClose(want_norms, got_norms, rtol=1e-4)
        self.assert_sums_close(model, want, got)
        for method in MODEL_METHODS:
            other, _ = dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=clip, method=method,
                                           augmentation_multiplicity=2)
            self.assert_sums_close(model, other, got)

    def test_in_a_tf_function_as_eagerly(self):
        model = _conv_group_norm_dense()
        x, y = _batch()
        eager, eager_norms = _jacobian(model, tf.constant(x), y, 0.5)
        traced, traced_norms = tf.function(lambda: _jacobian(model, tf.constant(x), y, 0.5))()
        self.assertAllClose(eager_norms, traced_norms, rtol=1e-5)
        self.assert_sums_close(model, eager, traced, rtol=1e-5)

    def test_nonfinite_example_drops_every_unit_its_nan_reaches(self):
        # The model methods drop the NaN example alone; a tape cannot: the
        # recorded backward pass contracts each weight gradient over the
        # batch, so the example's NaN activations times another unit's zero
        # output gradient make that unit's row NaN too. Every such unit is
        # dropped (coefficient 0, rows zeroed) and reported non-finite.
        model = _conv_group_norm_dense()
        x, y = _batch()
        x[2, 3, 4, 0] = np.nan
        loss = dp_test_case.per_example_xent
        _, naive_norms = dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=0.5,
                                             method="naive")
        self.assertEqual(np.isfinite(naive_norms.numpy()).tolist(),
                         [True, True, False, True, True, True])
        for rows_per_unit in (1, 2):
            got, norms = _jacobian(model, tf.constant(x), y, 0.5, rows_per_unit)
            self.assertFalse(np.any(np.isfinite(norms.numpy())), rows_per_unit)
            for g in got:
                self.assertAllEqual(g, tf.zeros_like(g))

    def test_refusals(self):
        model = _conv_group_norm_dense()
        x, y = _batch()
        loss = dp_test_case.per_example_xent
        self.assertIn("jacobian", dp.TAPE_METHODS)
        self.assertNotIn("jacobian", dp.METHODS)
        self.assertNotEqual(dp.resolve_method(model, "auto", tf.constant(x)), "jacobian")
        with self.assertRaisesRegex(ValueError, "jacobian_clipped_sum.*Received: method='jacobian'"):
            dp.clipped_grad_sum(model, loss, x, y, l2_norm_clip=1.0, method="jacobian")
        with tf.GradientTape() as tape:
            losses = loss(y, model(x))
        with self.assertRaisesRegex(ValueError, r"a vector of losses.*Received: losses of shape"):
            dp.jacobian_clipped_sum(tape, losses[:, None], model.trainable_variables, 1.0)
        with self.assertRaisesRegex(ValueError, "l2_norm_clip must be > 0"):
            dp.jacobian_clipped_sum(tape, losses, model.trainable_variables, 0.0)

    def test_unconnected_variable(self):
        model = _conv_group_norm_dense()
        x, y = _batch()
        variables = model.trainable_variables + [tf.Variable(tf.ones([2]), name="unused")]
        for to_zero in (False, True):
            # A tape per call: `jacobian` uses up a non-persistent one.
            with tf.GradientTape() as tape:
                losses = dp_test_case.per_example_xent(y, model(x))
            if not to_zero:
                with self.assertRaisesRegex(ValueError, r"unconnected_gradients_to_zero=True"):
                    dp.jacobian_clipped_sum(tape, losses, variables, 1.0)
                continue
            got, _ = dp.jacobian_clipped_sum(tape, losses, variables, 1.0,
                                             unconnected_gradients_to_zero=True)
            self.assertAllEqual(got[-1], [0.0, 0.0])

if __name__ == "__main__":
    tf.test.main()
