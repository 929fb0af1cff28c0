"""Rule `frozen_batch_norm`: BatchNormalization refused while trainable,
accepted frozen (inference mode: an affine map per example)."""

import keras
import numpy as np
import tensorflow as tf

from tests.dp.rules import rule_test_case
from tfdp import dp


def _model():
    inp = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", name="conv")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(3, name="head")(h))


class BatchNormRuleTest(rule_test_case.RuleTestCase):

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(8)

    def test_trainable_batch_norm_is_refused_by_every_method(self):
        model = _model()
        x, y = rule_test_case.images(4, 6), tf.constant([0, 1, 2, 0])
        for method in ("naive", "vectorized", "bk", "auto"):
            with self.assertRaisesRegex(ValueError, "'bn'.*replace_batchnorm"):
                dp.clipped_grad_sum(model, lambda t, p: tf.reduce_sum(p, -1), x, y,
                                    l2_norm_clip=1.0, method=method)
        with self.assertRaisesRegex(ValueError, "'bn'"):
            dp.plan(model, (6, 6, 3), 4)

    def test_frozen_batch_norm_is_accepted_and_planned(self):
        model = _model()
        bn = model.get_layer("bn")
        # Moving statistics away from 0 and 1, so that the affine map matters.
        bn.moving_mean.assign(np.linspace(-1, 1, 4).astype("float32"))
        bn.moving_variance.assign(np.linspace(0.5, 2, 4).astype("float32"))
        bn.trainable = False
        plan = dp.plan(model, (6, 6, 3), 4, method="bk")
        self.assertIn("bn", [name for name, _ in plan.notes])
        self.assertIn("frozen BatchNormalization", str(plan))
        self.assertNotIn("bn", [l.name for l in plan.layers])
        self.assert_rule_matches_naive(
            model, rule_test_case.images(6, 6), tf.constant([0, 1, 2, 0, 1, 2]), "conv2d",
            sample_weight=rule_test_case.weights(6),
        )
        # Frozen means frozen: training steps leave the statistics alone.
        self.assertAllClose(bn.moving_mean, np.linspace(-1, 1, 4))


if __name__ == "__main__":
    tf.test.main()
