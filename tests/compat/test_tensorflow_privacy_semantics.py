"""TF-Privacy's own tests' behaviour on tfdp.compat: outputs, regularizers, custom loops."""

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tests.compat import custom_loop_models as models
from tfdp.compat import tensorflow_privacy


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(0)


def _two_class_data():
    x = np.array([[2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0]], np.float32)
    y = np.array([[0], [1], [1], [0]])
    return x, y


def _two_layer_model(outputs, num_microbatches=None):
    return tensorflow_privacy.DPSequential(
        l2_norm_clip=1.0e9, noise_multiplier=0.0, num_microbatches=num_microbatches,
        layers=[keras.Input((2,)),
                keras.layers.Dense(4, use_bias=False, kernel_initializer="zeros"),
                keras.layers.Dense(outputs)],
    )


@pytest.mark.parametrize("num_microbatches", [None, 2])
def test_one_logit_under_sparse_crossentropy_is_refused(num_microbatches):
    # One logit is one class: label 1 is out of range. TF-Privacy's test only
    # passes because its default use_xla=True compiles the step with XLA,
    # which skips the range check and trains on a NaN loss. tfdp refuses the
    # labels before any step (`tfdp.validation.validate_labels`), naming no
    # label.
    x, y = _two_class_data()
    model = _two_layer_model(1, num_microbatches)
    model.compile(optimizer=keras.optimizers.SGD(1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=r"class indices, whole numbers in \[0, num_classes=1\)"):
        model.fit(x, y, epochs=1, batch_size=4, shuffle=False, verbose=0)


@pytest.mark.parametrize("num_microbatches", [None, 1, 2])
def test_multi_dimensional_output_trains(num_microbatches):
    x, y = _two_class_data()
    model = _two_layer_model(2, num_microbatches)
    model.compile(optimizer=keras.optimizers.SGD(1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, epochs=1, batch_size=4, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"][-1])
    assert all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables)


# ----------------------------------------------------------------------
# Custom training loops: minimize / _compute_gradients with a loss vector.
# TF-Privacy's tests use bare variables; here they are the weights of a
# model the loop declares (`declare_model`), as tfdp's custom loop requires.
# ----------------------------------------------------------------------


def _two_variables():
    """`(var0, var1, loss, model)`: per row 0.5·‖data0 − var0‖² + 0.5·‖data1 − var1‖²."""
    model, (var0, var1) = models.offsets_model([1.0, 2.0], [3.0])
    data = tf.constant([[3.0, 4.0, 8.0], [5.0, 6.0, 2.0], [7.0, 8.0, 3.0], [-1.0, 0.0, 1.0]])
    return var0, var1, lambda: models.half_squared_norm(None, model(data)), model


@pytest.mark.parametrize("cls, num_microbatches", [
    (tensorflow_privacy.DPKerasSGDOptimizer, 1),
    (tensorflow_privacy.DPKerasSGDOptimizer, None),
    (tensorflow_privacy.DPKerasAdamOptimizer, 2),
    (tensorflow_privacy.VectorizedDPKerasAdagradOptimizer, 4),
])
def test_compute_gradients_of_a_callable_or_taped_loss(cls, num_microbatches):
    var0, var1, loss, model = _two_variables()
    optimizer = cls(l2_norm_clip=100.0, noise_multiplier=0.0,
                    num_microbatches=num_microbatches, learning_rate=2.0)
    optimizer.declare_model(model, models.half_squared_norm)
    grads = optimizer._compute_gradients(loss, [var0, var1])
    np.testing.assert_allclose(grads[0][0], [-2.5, -2.5], rtol=1e-6)
    np.testing.assert_allclose(grads[1][0], [-0.5], rtol=1e-6)
    with tf.GradientTape() as tape:
        vector = loss()
    grads = optimizer._compute_gradients(vector, [var0, var1], tape=tape)
    np.testing.assert_allclose(grads[0][0], [-2.5, -2.5], rtol=1e-6)
    assert int(optimizer.iterations) == 2  # Each release is counted.
    with pytest.raises(ValueError, match="`tape` is required"):
        optimizer._compute_gradients(vector, [var0, var1])


@pytest.mark.parametrize("num_microbatches", [1, 2, 4])
def test_microbatch_gradients_are_clipped_then_averaged(num_microbatches):
    model, (var0, var1) = models.offsets_model([1.0, 2.0], [3.0])
    data0 = np.array([[3.0, 6.0], [5.0, 6.0], [4.0, 8.0], [-1.0, 0.0]], np.float32)
    data1 = np.array([[8.0], [2.0], [3.0], [1.0]], np.float32)
    clip = 2.5
    optimizer = tensorflow_privacy.DPKerasSGDOptimizer(
        l2_norm_clip=clip, noise_multiplier=0.0, num_microbatches=num_microbatches,
        learning_rate=2.0).declare_model(model, models.half_squared_norm)
    data = np.concatenate([data0, data1], axis=1)
    grads = optimizer._compute_gradients(
        lambda: models.half_squared_norm(None, model(data)), [var0, var1])
    per_example = np.concatenate([var0.numpy() - data0, var1.numpy() - data1], axis=1)
    means = per_example.reshape(num_microbatches, -1, 3).mean(axis=1)
    norms = np.linalg.norm(means, axis=1, keepdims=True)
    expected = (means * np.minimum(1.0, clip / norms)).mean(axis=0)
    np.testing.assert_allclose(np.concatenate([g.numpy() for g, _ in grads]), expected,
                               rtol=1e-5)


def test_minimize_accumulates_and_applies_through_the_wrapped_optimizer():
    # TF-Privacy's loss var0·xᵀ + var1 of each row: a Dense layer's output.
    model, (var0, var1) = models.linear_model([[1.0, 2.0]], [3.0])
    x1 = tf.constant([[2.0, 0.0], [0.0, 1.0]])
    x2 = tf.constant([[4.0, 2.0], [2.0, 1.0]])
    optimizer = tensorflow_privacy.DPKerasSGDOptimizer(
        l2_norm_clip=100.0, noise_multiplier=0.0, gradient_accumulation_steps=2,
        learning_rate=1.0).declare_model(model, models.prediction)
    expected = [([[1.0, 2.0]], [3.0], 0), ([[-1.0, 1.0]], [2.0], 1),
                ([[-1.0, 1.0]], [2.0], 1), ([[-4.0, -0.5]], [1.0], 2)]
    for x, (w0, w1, steps) in zip([x1, x2, x2, x2], expected):
        optimizer.minimize(lambda: models.prediction(None, model(x)), [var0, var1])
        np.testing.assert_allclose(var0.numpy().T, w0, rtol=1e-6)
        np.testing.assert_allclose(var1.numpy(), w1, rtol=1e-6)
        assert int(optimizer.iterations) == steps
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        optimizer._compute_gradients(lambda: var1 * 1.0, [var1])


def test_noise_is_fresh_for_each_release_and_accounted():
    model, (var,) = models.offsets_model(np.zeros([2000]))
    data = tf.zeros([16, 2000])
    optimizer = tensorflow_privacy.DPKerasSGDOptimizer(
        l2_norm_clip=4.0, noise_multiplier=1.0, num_microbatches=4, learning_rate=2.0)
    optimizer.declare_model(model, models.half_squared_norm)
    loss = lambda: models.half_squared_norm(None, model(data))  # noqa: E731
    first = optimizer._compute_gradients(loss, [var])[0][0].numpy()
    second = optimizer._compute_gradients(loss, [var])[0][0].numpy()
    # std sigma * C / microbatches, and no two releases share noise.
    assert np.std(first) == pytest.approx(1.0, rel=0.1)
    assert abs(np.corrcoef(first, second)[0, 1]) < 0.1
    with pytest.raises(ValueError, match="dataset size N"):
        optimizer.ledger()
    # 16 examples a step, N = 160: 2 steps are one pass, at sensitivity 2C.
    ledger = optimizer.ledger(dataset_size=160)
    assert ledger.steps == 2
    one_gaussian = dp_accounting.rdp.RdpAccountant().compose(
        dp_accounting.GaussianDpEvent(0.5)).get_epsilon(ledger.delta)
    assert ledger.epsilon() == pytest.approx(one_gaussian, rel=1e-6)


def test_custom_loop_trains_a_model_in_a_tf_function():
    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)).astype(np.float32)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = tensorflow_privacy.DPKerasSGDOptimizer(
        l2_norm_clip=100.0, noise_multiplier=0.0, learning_rate=0.1)
    loss_fn = keras.losses.MeanSquaredError(reduction=None)
    optimizer.declare_model(model, loss_fn)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        optimizer.minimize(loss, model.trainable_variables, tape=tape)

    first = float(tf.reduce_mean(loss_fn(y, model(x))))
    for _ in range(20):
        for start in range(0, 32, 8):
            train_step(x[start:start + 8], y[start:start + 8])
    assert float(tf.reduce_mean(loss_fn(y, model(x)))) < 0.2 * first
    assert int(optimizer.iterations) == 80
    with pytest.raises(ValueError, match="batch size of the first"):
        train_step(x[:4], y[:4])
    with pytest.raises(RuntimeError, match="make_private"):
        optimizer.apply_gradients(zip([tf.zeros([4, 1]), tf.zeros([1])],
                                      model.trainable_variables))
    with pytest.raises(NotImplementedError, match="minimize"):
        optimizer.get_gradients(None, model.trainable_variables)


@pytest.mark.parametrize("cls", [tensorflow_privacy.DPKerasSGDOptimizer,
                                 tensorflow_privacy.VectorizedDPKerasAdamOptimizer])
def test_apply_without_dp_gradients_raises_an_assertion_and_runtime_error(cls):
    # TF-Privacy's tests expect an AssertionError; tfdp's refusal is a RuntimeError.
    var = tf.Variable([0.0])
    optimizer = cls(l2_norm_clip=100.0, noise_multiplier=0.0, num_microbatches=1,
                    learning_rate=2.0)
    for call in (lambda: optimizer.apply_gradients(var),
                 lambda: optimizer.apply_gradients([(tf.ones([1]), var)]),
                 lambda: optimizer.apply([tf.ones([1])], [var])):
        with pytest.raises(AssertionError, match="make_private"):
            call()
        with pytest.raises(RuntimeError, match="make_private"):
            call()
    assert issubclass(tensorflow_privacy.PlainGradientsError, (RuntimeError, AssertionError))
    assert float(var[0]) == 0.0 and int(optimizer.iterations) == 0


def test_apply_gradients_applies_the_released_gradients_once():
    var0, var1, loss, model = _two_variables()
    optimizer = tensorflow_privacy.DPKerasSGDOptimizer(
        l2_norm_clip=100.0, noise_multiplier=1.0, num_microbatches=2, learning_rate=2.0)
    optimizer.declare_model(model, models.half_squared_norm)
    grads_and_vars = optimizer._compute_gradients(loss, [var0, var1])
    assert int(optimizer.iterations) == 1
    # Gradients derived from the released ones are not the released ones.
    with pytest.raises(tensorflow_privacy.PlainGradientsError):
        optimizer.apply_gradients([(2.0 * g, v) for g, v in grads_and_vars])
    grads_and_vars = optimizer._compute_gradients(loss, [var0, var1])
    noisy = [g.numpy() for g, _ in grads_and_vars]
    before = [var0.numpy(), var1.numpy()]
    optimizer.apply_gradients(grads_and_vars)
    for b, g, v in zip(before, noisy, (var0, var1)):
        np.testing.assert_allclose(v.numpy(), b - 2.0 * g, rtol=1e-6)
    # Two releases, each counted once (and each seeding its own noise).
    assert int(optimizer.iterations) == 2
    assert optimizer.ledger(dataset_size=40).steps == 2
    with pytest.raises(tensorflow_privacy.PlainGradientsError):
        optimizer.apply_gradients(grads_and_vars)  # Once only.
    np.testing.assert_allclose(var0.numpy(), before[0] - 2.0 * noisy[0], rtol=1e-6)


def test_released_gradients_apply_in_a_tf_function_with_adams_step_count():
    # Each of 2 rows: ‖0 − var‖² = ‖var‖², whose gradient is 2·var.
    model, (var,) = models.offsets_model([1.0, 2.0])
    optimizer = tensorflow_privacy.DPKerasAdamOptimizer(
        l2_norm_clip=100.0, noise_multiplier=0.0, learning_rate=0.1)
    optimizer.declare_model(model, models.squared_norm)
    plain = keras.optimizers.Adam(learning_rate=0.1)
    twin = tf.Variable([1.0, 2.0])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = models.squared_norm(None, model(tf.zeros([2, 2])))
        optimizer.apply_gradients(optimizer._compute_gradients(loss, [var], tape=tape))

    for _ in range(3):
        step()
        plain.apply_gradients([(2.0 * twin, twin)])
    # Adam sees steps 1, 2, 3, as without DP: the release is counted once.
    np.testing.assert_allclose(var.numpy(), twin.numpy(), rtol=1e-5)
    assert int(optimizer.iterations) == 3


@pytest.mark.parametrize("to_zero", [False, True])
def test_unconnected_gradients(to_zero):
    class Scale(keras.layers.Layer):
        """x · used; `unused` (a variable of the model the loss does not reach) is not read."""

        def build(self, input_shape):
            self.used = self.add_weight(shape=(1,), initializer="ones", name="used")
            # Not trainable: tfdp's clipping engine, which the probe runs,
            # takes only trainable variables that the loss reaches.
            self.unused = self.add_weight(
                shape=(1,), initializer=keras.initializers.Constant(2.0), name="unused",
                trainable=False)

        def call(self, x):
            return x * self.used

    model = keras.Sequential([keras.Input((1,)), Scale()])
    used, unused = model.layers[0].used, model.layers[0].unused
    optimizer = tensorflow_privacy.VectorizedDPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=0.0, unconnected_gradients_to_zero=to_zero,
        learning_rate=1.0).declare_model(model, models.prediction)
    # The rows used·1 and used·2, as TF-Privacy's test.
    loss = lambda: models.prediction(None, model(tf.constant([[1.0], [2.0]])))  # noqa: E731
    if not to_zero:
        with pytest.raises(ValueError, match="unconnected_gradients_to_zero=True"):
            optimizer.minimize(loss, [used, unused])
        return
    optimizer.minimize(loss, [used, unused])
    assert float(unused[0]) == 2.0 and float(used[0]) < 1.0
    assert optimizer.get_config()["unconnected_gradients_to_zero"] is True


# ----------------------------------------------------------------------
# Layer weight regularizers on compat models.
# ----------------------------------------------------------------------


@pytest.mark.parametrize("sequential", [False, True])
def test_weight_regularizer_gradient_is_added_after_the_noise(sequential):
    # The data loss is zeroed, so one SGD(1.0) step of L2(0.025) on weights
    # of one moves them to 1 - 2 * 0.025, as in TF-Privacy.
    dense = keras.layers.Dense(1, kernel_initializer="ones", use_bias=False,
                               kernel_regularizer=keras.regularizers.L2(0.025))
    zero = keras.layers.Lambda(lambda t: t * 0.0)
    kwargs = dict(l2_norm_clip=1e9, noise_multiplier=0.0)
    if sequential:
        model = tensorflow_privacy.DPSequential(layers=[keras.Input((10,)), dense, zero],
                                                **kwargs)
    else:
        inputs = keras.Input((10,))
        model = tensorflow_privacy.DPModel(inputs=inputs, outputs=zero(dense(inputs)), **kwargs)
    model.compile(loss=keras.losses.MeanSquaredError(), optimizer=keras.optimizers.SGD(1.0))
    x = np.arange(20, dtype=np.float32).reshape(2, 10)
    model.fit(x, np.zeros((2, 1), np.float32), batch_size=2, epochs=1, verbose=0)
    np.testing.assert_allclose(model.trainable_variables[0].numpy(),
                               np.full((10, 1), 1.0 - 2.0 * 0.025), rtol=1e-6)


def test_activity_regularizer_and_the_native_route_are_refused():
    def model(**regularizer):
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, **regularizer)])

    x, y = np.eye(4, dtype=np.float32), np.zeros((4,), np.int32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compat = tensorflow_privacy.DPSequential(
        l2_norm_clip=1.0, noise_multiplier=0.0,
        layers=model(activity_regularizer=keras.regularizers.L2(0.1)).layers)
    compat.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss)
    with pytest.raises(NotImplementedError, match="activity_regularizer"):
        compat.fit(x, y, batch_size=4, verbose=0)
    native = tfdp.make_private(model(kernel_regularizer=keras.regularizers.L2(0.1)))
    native.compile(optimizer=tfdp.DPOptimizer("sgd", 1.0, 0.0), loss=loss)
    with pytest.raises(NotImplementedError, match="kernel_regularizer"):
        native.fit(x, y, batch_size=4, verbose=0)
