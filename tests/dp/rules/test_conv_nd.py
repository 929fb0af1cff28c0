"""Rule `conv`: Conv1D (causal, same, strided, dilated), Conv3D and grouped Conv2D."""

import pytest
from unittest import mock

import keras
import numpy as np
import tensorflow as tf

from tests.dp.rules import rule_test_case
from tfdp import dp
from tfdp.dp.rules import depthwise_conv


class ConvRuleTest(rule_test_case.RuleTestCase):

    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(9)
        self.y = tf.constant([0, 1, 2, 0, 1, 2])

    def _check(self, model, x, names):
        plan = {l.name: l for l in dp.plan(model, x.shape[1:], 6).layers}
        for name in names:
            self.assertEqual(plan[name].kind, "conv", msg=name)
        self.assert_rule_matches_naive(
            model, x, self.y, "conv", sample_weight=rule_test_case.weights(6),
            weight_decay=0.02,
        )

    def test_conv1d(self):
        inp = keras.Input((12, 3))
        h = keras.layers.Conv1D(4, 3, padding="causal", dilation_rate=2, name="causal")(inp)
        h = keras.layers.Conv1D(5, 3, strides=2, padding="same", name="strided")(h)
        h = keras.layers.Conv1D(4, 2, use_bias=False, activation="relu", name="valid")(h)
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        x = np.random.default_rng(0).normal(size=(6, 12, 3)).astype("float32")
        x[1] *= 5.0
        self._check(model, tf.constant(x), ["causal", "strided", "valid"])

    @pytest.mark.slow
    def test_conv3d_and_grouped_conv2d(self):
        inp = keras.Input((5, 5, 4))
        h = keras.layers.Conv2D(6, 3, groups=2, padding="same", name="grouped")(inp)
        # One input channel per group, two outputs each: computed as a depthwise conv.
        h = keras.layers.Conv2D(12, 3, groups=6, strides=2, padding="same", name="dw")(h)
        h = keras.layers.Conv2D(6, 1, name="pointwise")(h)
        h = keras.layers.Conv2D(6, (3, 2), groups=6, dilation_rate=(1, 2), padding="same",
                                name="dw_dilated")(h)
        # 12 taps: above `MAX_BACKPROP_TAPS`, the depthwise correlation route.
        h = keras.layers.Conv2D(6, (4, 3), groups=6, padding="same", name="dw_wide")(h)
        h = keras.layers.Reshape((3, 3, 6, 1))(h)
        h = keras.layers.Conv3D(2, (2, 2, 3), strides=(1, 2, 1), padding="same", name="conv3d")(h)
        h = keras.layers.GlobalAveragePooling3D()(h)
        model = keras.Model(inp, keras.layers.Dense(3)(h))
        depthwise = depthwise_conv.per_example_depthwise_grads
        with mock.patch.object(depthwise_conv, "per_example_depthwise_grads",
                               wraps=depthwise) as spy:
            self._check(model, rule_test_case.images(6, 5, channels=4),
                        ["grouped", "dw", "dw_dilated", "dw_wide", "conv3d"])
        # The three one-channel-per-group convs, for each tapped method and probe.
        self.assertGreater(spy.call_count, 0)
        self.assertEqual({c.args[0].name for c in spy.call_args_list},
                         {"dw", "dw_dilated", "dw_wide"})


if __name__ == "__main__":
    tf.test.main()
