"""The TF-Privacy custom loop runs the training probe before its first release.

`minimize` and `_compute_gradients` are handed a loss vector; the model and
per-example loss are declared (`declare_model`) and probed as on every other
route. A layer or a loss through which one row depends on another, or a
layer writing state from the batch, is refused before any variable changes.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp.compat import tensorflow_privacy

ROWS = 8


class MixUp(keras.layers.Layer):
    """Mixes each row with the next one (MixUp inside the model)."""

    def call(self, x):
        return 0.5 * x + 0.5 * tf.roll(x, 1, axis=0)


class Centre(keras.layers.Layer):
    """Subtracts the batch mean."""

    def call(self, x):
        return x - tf.reduce_mean(x, axis=0, keepdims=True)


class BatchSoftmax(keras.layers.Layer):
    """A softmax over the batch axis."""

    def call(self, x):
        return tf.nn.softmax(x, axis=0)


class RunningMean(keras.layers.Layer):
    """Writes the batch mean into a non-trainable variable while training."""

    def build(self, input_shape):
        self.mean = self.add_weight(shape=input_shape[1:], initializer="zeros",
                                    trainable=False, name="running_mean")

    def call(self, x, training=None):
        if training:
            self.mean.assign(tf.reduce_mean(x, axis=0))
        return x


def _model(layer=None):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((4,)), keras.layers.Dense(4, name="hidden")]
    if layer is not None:
        layers.append(layer)
    layers.append(keras.layers.Dense(3, name="head"))
    return keras.Sequential(layers, name="net")


def _xent():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def centred_xent(y_true, y_pred):
    """A per-example loss minus the batch mean: each row depends on every other."""
    values = _xent()(y_true, y_pred)
    return values - tf.reduce_mean(values)


def _batch():
    rng = np.random.default_rng(1)
    return (rng.normal(size=(ROWS, 4)).astype("float32"),
            rng.integers(0, 3, size=(ROWS,)).astype("int32"))


def _optimizer(**kwargs):
    kwargs.setdefault("learning_rate", 0.5)
    return tensorflow_privacy.DPKerasSGDOptimizer(
        l2_norm_clip=1.0e6, noise_multiplier=0.0, **kwargs)


def _minimize(optimizer, model, loss_fn, x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    optimizer.minimize(loss, model.trainable_variables, tape=tape)


def _compute_gradients(optimizer, model, loss_fn, x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    optimizer._compute_gradients(loss, model.trainable_variables, tape=tape)


CASES = [
    (MixUp(name="mixup"), _xent, "Layer 'mixup' mixes examples"),
    (Centre(name="centre"), _xent, "Layer 'centre' mixes examples"),
    (BatchSoftmax(name="batch_softmax"), _xent, "Layer 'batch_softmax' mixes examples"),
    (RunningMean(name="running"), _xent, "Layer 'running' writes variable"),
    (None, lambda: centred_xent, "The loss 'centred_xent' mixes examples"),
]


@pytest.mark.parametrize("call", [_minimize, _compute_gradients],
                         ids=["minimize", "_compute_gradients"])
@pytest.mark.parametrize("layer, loss, match", CASES,
                         ids=["mixup", "centring", "batch_softmax", "state", "loss"])
def test_a_mixing_layer_or_loss_is_refused_before_any_update(call, layer, loss, match):
    model = _model(layer)
    loss_fn = loss()
    optimizer = _optimizer().declare_model(model, loss_fn)
    x, y = _batch()
    before = [v.numpy().copy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match=match):
        call(optimizer, model, loss_fn, x, y)
    # Nothing released, nothing updated.
    assert int(optimizer.iterations) == 0 and optimizer.released_gradients is None
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())


def test_the_probe_refuses_in_a_tf_function_too():
    model = _model(Centre(name="centre"))
    optimizer = _optimizer().declare_model(model, _xent())
    loss_fn = _xent()
    step = tf.function(lambda x, y: _minimize(optimizer, model, loss_fn, x, y))
    with pytest.raises(ValueError, match="Layer 'centre' mixes examples"):
        step(*_batch())
    assert int(optimizer.iterations) == 0


@pytest.mark.parametrize("call", [_minimize, _compute_gradients],
                         ids=["minimize", "_compute_gradients"])
def test_an_undeclared_loop_is_refused(call):
    model = _model()
    optimizer = _optimizer()
    before = [v.numpy().copy() for v in model.trainable_variables]
    with pytest.raises(ValueError, match=r"declare_model\(model, loss="):
        call(optimizer, model, _xent(), *_batch())
    assert int(optimizer.iterations) == 0
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())


def test_variables_outside_the_declared_model_are_refused():
    model, other = _model(), _model()
    optimizer = _optimizer().declare_model(other, _xent())
    with pytest.raises(ValueError, match="not variables of the declared model"):
        _minimize(optimizer, model, _xent(), *_batch())


def test_declaration_errors_say_what_to_pass():
    with pytest.raises(ValueError, match="loss=None"):
        _optimizer().declare_model(_model())
    with pytest.raises(ValueError, match="Keras model"):
        _optimizer().declare_model(tf.Variable(1.0), _xent())

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    with pytest.raises(ValueError, match="input_spec"):
        _optimizer().declare_model(Subclassed(), _xent())
    # With the spec it is probed, and trains.
    model = Subclassed()
    optimizer = _optimizer().declare_model(
        model, _xent(), input_spec=tf.TensorSpec([None, 4], tf.float32))
    _minimize(optimizer, model, _xent(), *_batch())
    assert int(optimizer.iterations) == 1


@pytest.mark.parametrize("compiled", [False, True])
def test_a_plain_model_trains_as_before(compiled):
    # C large, no noise: one step is plain SGD on the batch's mean loss.
    x, y = _batch()
    model, twin = _model(), _model()
    optimizer = _optimizer()
    if compiled:  # The loss defaults to the compiled one.
        model.compile(optimizer=keras.optimizers.SGD(), loss=_xent())
        optimizer.declare_model(model)
    else:
        optimizer.declare_model(model, _xent())
    _minimize(optimizer, model, _xent(), x, y)
    _compute_gradients(optimizer, model, _xent(), x, y)  # Released, not applied.
    plain = keras.optimizers.SGD(0.5)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(_xent()(y, twin(x, training=True)))
    plain.apply(tape.gradient(loss, twin.trainable_variables), twin.trainable_variables)
    for a, b in zip(model.trainable_variables, twin.trainable_variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    assert int(optimizer.iterations) == 2
