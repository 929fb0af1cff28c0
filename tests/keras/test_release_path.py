"""The one release path: plain gradients never reach the wrapped optimizer.

A `DPModel` subclass whose `train_step` hands its own gradients to
`optimizer.inner_optimizer` would train plain SGD under a printed ε; a
`compute_loss` override would be silently ignored by the private step. Both
are refused before any weight changes, while `fit`, compat `fit` and the
compat custom loop still update through the release.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tests.keras.keras_test_case import digits
from tests.keras.keras_test_case import tiny_model
from tests.keras.keras_test_case import xent
from tfdp.compat import tensorflow_privacy
from tfdp.keras.dp_optimizer import PlainGradientsError


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(0)


def _optimizer():
    return tfdp.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
                            noise_multiplier=1.0, insecure_reproducible_seed=0)


def _weights(model):
    return [v.numpy().copy() for v in model.trainable_variables]


def _assert_unchanged(model, before):
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())


class _Bypass(tfdp.DPModel):
    """Trains plain SGD through the wrapped optimizer (the audit's finding 8)."""

    def train_step(self, data):
        x, y = data[:2]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(self._dp_loss_fn(y, self(x, training=True)))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.inner_optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {}


@pytest.mark.parametrize("call", ["apply_gradients", "apply"])
def test_plain_gradients_to_the_wrapped_optimizer_are_refused(call):
    x, y = digits(64)
    model = _Bypass(tiny_model())
    if call == "apply":
        def train_step(data):
            xb, yb = data[:2]
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model._dp_loss_fn(yb, model(xb, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            model.optimizer.inner_optimizer.apply(grads, model.trainable_variables)
            return {}
        model.train_step = train_step
    model.compile(optimizer=_optimizer(), loss=xent())
    model.build((None, 8, 8, 1))
    before = _weights(model)
    with pytest.raises(PlainGradientsError, match="outside the private release"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    _assert_unchanged(model, before)
    assert int(model.optimizer.iterations) == 0
    # Also eagerly, outside any train step.
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    with pytest.raises(PlainGradientsError):
        model.optimizer.inner_optimizer.apply_gradients(zip(grads, model.trainable_variables))
    _assert_unchanged(model, before)


def test_compat_error_is_the_engines():
    # Code catching either name catches every refusal.
    assert tensorflow_privacy.PlainGradientsError is PlainGradientsError
    assert issubclass(PlainGradientsError, (RuntimeError, AssertionError))


def test_a_compat_dp_model_bypass_is_refused():
    class CompatBypass(tensorflow_privacy.DPSequential):
        train_step = _Bypass.train_step

    x, y = digits(32)
    model = CompatBypass(1.0, 1.0, layers=tiny_model().layers)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=xent())
    model.build((None, 8, 8, 1))
    before = _weights(model)
    with pytest.raises(PlainGradientsError):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    _assert_unchanged(model, before)


def test_a_compute_loss_override_is_refused():
    class Penalised(tfdp.DPModel):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                         training=True):
            return super().compute_loss(x, y, y_pred, sample_weight, training) + 1.0

    x, y = digits(32)
    model = Penalised(tiny_model())
    model.compile(optimizer=_optimizer(), loss=xent())
    model.build((None, 8, 8, 1))
    before = _weights(model)
    with pytest.raises(ValueError, match="Penalised overrides `compute_loss`"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    _assert_unchanged(model, before)


def test_a_compute_metrics_override_still_trains():
    class Metrics(tfdp.DPModel):
        def compute_metrics(self, x, y, y_pred, sample_weight=None):
            return {"rows": tf.cast(tf.shape(x)[0], tf.float32)}

    x, y = digits(32)
    model = Metrics(tiny_model())
    model.compile(optimizer=_optimizer(), loss=xent())
    model.build((None, 8, 8, 1))
    before = _weights(model)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) > 0
    assert any(not np.array_equal(b, v.numpy())
               for b, v in zip(before, model.trainable_variables))


@pytest.mark.parametrize("route", ["native", "compat"])
def test_fit_still_updates_through_the_release(route):
    x, y = digits(32)
    if route == "native":
        model = tfdp.make_private(tiny_model())
        model.compile(optimizer=_optimizer(), loss=xent())
    else:
        model = tensorflow_privacy.DPSequential(1.0, 1.0, layers=tiny_model().layers)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=xent())
    model.build((None, 8, 8, 1))
    before = _weights(model)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(model.optimizer.iterations) > 0
    assert any(not np.array_equal(b, v.numpy())
               for b, v in zip(before, model.trainable_variables))


def test_the_compat_custom_loop_still_applies_its_release():
    # `_compute_gradients` releases; `apply_gradients` applies that release
    # through the wrapped optimizer (`apply_noisy`), once.
    x, y = digits(16)
    model = tiny_model()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    optimizer = tensorflow_privacy.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.1)
    optimizer.declare_model(model, loss_fn)
    before = _weights(model)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    optimizer.apply_gradients(optimizer._compute_gradients(
        loss, model.trainable_variables, tape=tape))
    assert int(optimizer.iterations) == 1
    assert any(not np.array_equal(b, v.numpy())
               for b, v in zip(before, model.trainable_variables))
