"""Shared helpers for the tfdp.keras tests."""

import keras
import numpy as np
import tensorflow as tf

import tfdp


def tiny_model(input_shape=(8, 8, 1), num_classes=10, name="tiny"):
    """Conv + GroupNorm + Dense: every tapped kind, fast."""
    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Conv2D(4, 3, name="conv"),
            keras.layers.GroupNormalization(2, name="norm"),
            keras.layers.Activation("tanh"),
            keras.layers.Flatten(),
            keras.layers.Dense(num_classes, name="head"),
        ],
        name=name,
    )


def digits(n=None):
    """sklearn digits (8x8x1, offline): (x, y) float32/int32."""
    train, _, _ = tfdp.data.load_offline("digits")
    x, y = train.images, train.labels
    if n is not None:
        x, y = x[:n], y[:n]
    return x.astype("float32"), y.astype("int32")


def xent():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class KerasTestCase(tf.test.TestCase):
    def setUp(self):
        super().setUp()
        keras.utils.set_random_seed(0)

    def private(self, model, optimizer=None, **dp_kwargs):
        """make_private + compile with a DPOptimizer(SGD) (defaults below)."""
        kw = dict(l2_norm_clip=1.0, noise_multiplier=0.0)
        kw.update(dp_kwargs)
        optimizer = optimizer or keras.optimizers.SGD(0.1)
        dp = tfdp.make_private(model)
        dp.compile(
            optimizer=tfdp.DPOptimizer(optimizer, **kw),
            loss=xent(),
            metrics=["accuracy"],
        )
        return dp

    def assertWeightsClose(self, a, b, rtol=1e-5, atol=1e-6):
        self.assertEqual(len(a), len(b))
        for u, v in zip(a, b):
            self.assertAllClose(u, v, rtol=rtol, atol=atol)


def weights(model):
    return [np.array(w) for w in model.get_weights()]


def nonprivate_sgd_step(model, x, y, lr, divisor=None, sample_weight=None):
    """One plain SGD step on Σ_i w_i L_i / divisor (divisor defaults to B)."""
    divisor = len(x) if divisor is None else divisor
    w = tf.ones([len(x)]) if sample_weight is None else tf.constant(sample_weight, tf.float32)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    with tf.GradientTape() as tape:
        losses = loss_fn(y, model(x, training=True))
        loss = tf.reduce_sum(losses * w) / divisor
    grads = tape.gradient(loss, model.trainable_variables)
    for v, g in zip(model.trainable_variables, grads):
        v.assign_sub(lr * g)
