"""User-level clipping: every method clips the mean of each user's gradients once.

A batch laid out as user blocks of k rows (`tfdp.dp.user_groups`) with
`augmentation_multiplicity=k` must give Σ_users clip_C(mean of the user's
per-example gradients), computed here independently by one tape per example.
The tapped methods' ghost norms of a group hold the cross terms between its
rows; the norms are compared too.
"""

from absl.testing import parameterized
import keras
import numpy as np
import tensorflow as tf

from tests.dp import dp_test_case
from tfdp import dp
from tfdp.dp import sensitivity
from tfdp.dp import user_groups

METHODS = ("naive", "vectorized", "ghost", "mixed", "bk")
K = 3  # max_examples_per_user.
# Users of 1, 2 and k rows, a user with no row (a padding block), a user of 2.
USER_ROWS = (1, 2, K, 0, 2)


def _conv_model():
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(3, 3, activation="tanh", name="conv")(inputs)
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(4, name="head")(h)
    return keras.Model(inputs, outputs)


def _user_batch(example_shape, num_classes, integer_inputs=False, seed=0):
    """Rows laid out as user blocks, with their weights and each block's real rows."""
    rng = np.random.default_rng(seed)
    counts = np.array(USER_ROWS)
    rows = len(counts) * K
    if integer_inputs:
        x = rng.integers(0, 20, size=(rows,) + example_shape).astype("int32")
    else:
        x = rng.normal(size=(rows,) + example_shape).astype("float32")
        x[K:2 * K] *= 4.0  # Spread the users' norms so that C clips some.
    y = rng.integers(0, num_classes, size=rows).astype("int32")
    weights = user_groups.block_weights(counts, K)
    real = weights > 0
    x[~real] = 0
    y[~real] = 0
    return tf.constant(x), tf.constant(y), tf.constant(weights), counts


def _user_means(model, loss_fn, x, y, counts, group):
    """Each user's mean per-example gradient (flattened), by one tape per row."""
    means = []
    for u, c in enumerate(counts):
        rows = range(u * group, u * group + group)
        grads = []
        for r in rows:
            if r - u * group >= c * (group // K):
                continue
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(loss_fn(y[r:r + 1], model(x[r:r + 1], training=True)))
            g = tape.gradient(loss, model.trainable_variables,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
            grads.append(tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v in g], 0))
        means.append(tf.reduce_mean(tf.stack(grads), 0) if grads else None)
    return means


def _flat(grads):
    return tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) for g in grads], 0)


class UserLevelClippingTest(dp_test_case.DPTestCase, parameterized.TestCase):

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(3)

    def _check(self, model, loss_fn, x, y, weights, counts, augmentation_multiplicity=1):
        group = K * augmentation_multiplicity
        if augmentation_multiplicity > 1:
            # Each row's augmentations sit next to it: blocks of k·K rows.
            x = tf.repeat(x, augmentation_multiplicity, axis=0)
            if x.dtype.is_floating:
                noise = np.random.default_rng(1).normal(size=x.shape).astype("float32")
                x = x + 0.1 * noise * tf.cast(tf.reduce_any(x != 0, axis=list(
                    range(1, x.shape.rank)), keepdims=True), x.dtype)
            y = tf.repeat(y, augmentation_multiplicity, axis=0)
            weights = tf.repeat(weights, augmentation_multiplicity, axis=0)
        means = _user_means(model, loss_fn, x, y, counts, group)
        norms = np.array([0.0 if m is None else float(tf.norm(m)) for m in means])
        real = norms[norms > 0]
        clip = float(np.sqrt(real.min() * real.max()))  # Clips some users, not all.
        self.assertGreater(np.sum(real > clip * 1.01), 0)
        self.assertGreater(np.sum(real < clip * 0.99), 0)
        expected = tf.add_n([m * min(1.0, clip / float(tf.norm(m))) for m in means
                             if m is not None])
        scale = float(tf.reduce_max(tf.abs(expected)))
        for method in METHODS:
            grads, got_norms = dp.clipped_grad_sum(
                model, loss_fn, x, y, l2_norm_clip=clip, method=method, sample_weight=weights,
                augmentation_multiplicity=group)
            self.assertAllClose(got_norms, norms, rtol=1e-4, atol=1e-6, msg=method)
            self.assertAllClose(_flat(grads) / scale, expected / scale, atol=1e-4, msg=method)
        return x, y, weights, clip

    @parameterized.parameters(1, 2)
    def test_conv_model_every_method_clips_each_users_mean(self, augmentation_multiplicity):
        model = _conv_model()
        x, y, w, counts = _user_batch((6, 6, 2), 4)
        self._check(model, dp_test_case.per_example_xent, x, y, w, counts,
                    augmentation_multiplicity)

    def test_sequence_model_ghost_cross_terms(self):
        # Dense on 3-D inputs, a layer called twice, LayerNorm, an embedding:
        # a user's ghost norm sums the cross terms over rows and positions.
        model = dp_test_case.text_model()
        x, y, w, counts = _user_batch((7,), 3, integer_inputs=True)
        self._check(model, dp_test_case.per_example_embedding_loss, x, y, w, counts)

    def test_leave_one_user_out_moves_the_sum_by_at_most_c(self):
        model = _conv_model()
        x, y, w, counts = _user_batch((6, 6, 2), 4)
        clip = 1e-3  # Every user is clipped: each one's removal moves the sum by C.
        figures = sensitivity.check_sensitivity(
            model, dp_test_case.per_example_xent, (x, y, w), clip, method=METHODS,
            augmentation_multiplicity=K)
        for method, figure in figures.items():
            self.assertLessEqual(figure, 1.0 + sensitivity.TOLERANCE, msg=method)
            self.assertGreater(figure, 0.999, msg=method)

    def test_per_row_clipping_of_a_users_rows_exceeds_c(self):
        # The same user's k rows clipped one by one: removing the user moves
        # the sum by up to k·C. User-level clipping must not do this.
        model = _conv_model()
        x, y, w, counts = _user_batch((6, 6, 2), 4)
        user = USER_ROWS.index(K)
        block = slice(user * K, user * K + K)
        x = x.numpy()
        y = y.numpy()
        x[block] = x[block][:1] + 0.01 * x[block]  # Similar examples: aligned gradients.
        y[block] = y[block][0]
        x, y = tf.constant(x), tf.constant(y)
        keep = np.ones(len(USER_ROWS) * K, "float32")
        keep[block] = 0.0
        clip = 1e-3

        def moved(augmentation_multiplicity):
            sums = []
            for weights, inputs in ((w, x), (w * keep, x * keep[:, None, None, None])):
                grads, _ = dp.clipped_grad_sum(
                    model, dp_test_case.per_example_xent, inputs, y, l2_norm_clip=clip,
                    method="bk", sample_weight=weights,
                    augmentation_multiplicity=augmentation_multiplicity)
                sums.append(_flat(grads))
            return float(tf.norm(sums[0] - sums[1])) / clip

        self.assertGreater(moved(1), 2.0)
        self.assertAllClose(moved(K), 1.0, rtol=1e-4)


if __name__ == "__main__":
    tf.test.main()
