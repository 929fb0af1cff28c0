"""TF-Privacy's Keras optimizers and models on tfdp: semantics and errors."""

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tests.keras.keras_test_case import digits
from tests.keras.keras_test_case import tiny_model
from tfdp.compat import tensorflow_privacy

C = 0.05  # Small, so that every microbatch is clipped.


def _loss(reduction=None):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def _one_step(model, optimizer, x, y, **compile_kwargs):
    """Weights after one `fit` step on (x, y) as one batch, and before."""
    model.compile(optimizer=optimizer, loss=_loss(), **compile_kwargs)
    before = [v.numpy() for v in model.trainable_variables]
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    return before, [v.numpy() for v in model.trainable_variables]


def _naive_microbatch_update(model, x, y, num_microbatches, lr):
    """-lr * sum_j clip(grad of microbatch j's mean loss) / num_microbatches."""
    loss_fn = _loss()
    variables = model.trainable_variables
    total = [np.zeros(v.shape, np.float32) for v in variables]
    for xs, ys in zip(np.split(x, num_microbatches), np.split(y, num_microbatches)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(ys, model(xs, training=True)))
        grads = tape.gradient(loss, variables)
        clipped, _ = tf.clip_by_global_norm(grads, C)
        total = [t + g.numpy() for t, g in zip(total, clipped)]
    return [-lr * t / num_microbatches for t in total]


def _assert_update(before, after, expected):
    for b, a, e in zip(before, after, expected):
        np.testing.assert_allclose(a - b, e, rtol=2e-4, atol=1e-6)


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(0)


@pytest.mark.parametrize("num_microbatches", [2, 4])
def test_microbatches_clip_microbatch_means(num_microbatches):
    x, y = digits(16)
    model = tensorflow_privacy.DPSequential(
        l2_norm_clip=C, noise_multiplier=0.0, num_microbatches=num_microbatches,
        layers=tiny_model().layers,
    )
    model.build((None, 8, 8, 1))
    expected = _naive_microbatch_update(model.model, x, y, num_microbatches, lr=1.0)
    before, after = _one_step(model, keras.optimizers.SGD(1.0), x, y)
    _assert_update(before, after, expected)


@pytest.mark.parametrize("num_microbatches", [None, 16, 4])
def test_optimizer_microbatches_in_a_private_model(num_microbatches):
    # The optimizer carries num_microbatches into a tfdp.make_private model;
    # None (or the batch size): one microbatch per example.
    x, y = digits(16)
    inner = tiny_model()
    expected = _naive_microbatch_update(inner, x, y, num_microbatches or 16, lr=0.5)
    optimizer = tensorflow_privacy.DPKerasSGDOptimizer(
        l2_norm_clip=C, noise_multiplier=0.0, num_microbatches=num_microbatches,
        learning_rate=0.5,
    )
    before, after = _one_step(tfdp.make_private(inner), optimizer, x, y)
    _assert_update(before, after, expected)


def test_dp_model_takes_full_batches_only():
    # fit on arrays cuts each pass into N // B steps of exactly B examples
    # (the shuffle sampler); the remainder sits out, so no short last batch
    # has to be split into microbatches.
    x, y = digits(20)
    model = tensorflow_privacy.DPSequential(C, 0.0, 4, layers=tiny_model().layers)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert model.optimizer.iterations.numpy() == 2


@pytest.mark.parametrize("reduction", [None, "sum_over_batch_size"])
def test_plain_model_is_refused_naming_make_private(reduction):
    # Keras 3 hands an optimizer only the gradients of the reduced loss: no
    # per-example (or per-microbatch) gradient to clip. The refusal comes at
    # the first train step, before any update.
    x, y = digits(16)
    model = tiny_model()
    model.compile(
        optimizer=tensorflow_privacy.DPKerasSGDOptimizer(C, 1.0, None, learning_rate=1.0),
        loss=_loss(reduction),
    )
    model.build((None, 8, 8, 1))
    before = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(RuntimeError, match=r"tfdp\.make_private\(model\)"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())
    assert model.optimizer.iterations.numpy() == 0


def _noise_std(num_microbatches, accumulation=1, sigma=2.0, batch=8):
    """Std over ~20k coordinates of (noisy - noiseless) one-update change."""
    x, y = digits(batch * accumulation)
    x = x.reshape(len(x), -1)
    inner = keras.Sequential([keras.Input((64,)), keras.layers.Dense(320)])
    start = [v.numpy() for v in inner.trainable_variables]
    deltas = []
    for noise in (0.0, sigma):
        for v, s in zip(inner.trainable_variables, start):
            v.assign(s)
        optimizer = tensorflow_privacy.DPKerasSGDOptimizer(
            C, noise, num_microbatches, accumulation, learning_rate=1.0
        )
        model = tfdp.make_private(inner)
        model.compile(optimizer=optimizer, loss=_loss())
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        deltas.append(np.concatenate(
            [(v.numpy() - s).ravel() for v, s in zip(inner.trainable_variables, start)]
        ))
    return np.std(deltas[1] - deltas[0])


@pytest.mark.parametrize(
    "num_microbatches, accumulation, divisor",
    [
        (None, 1, 8.0),  # sigma*C / batch.
        (8, 1, 8.0),  # sigma*C / num_microbatches.
        # TF-Privacy noised each accumulated step and averaged the k steps:
        # sigma*C*sqrt(k) / (k * batch).
        (None, 2, 8.0 * 2 / np.sqrt(2)),
    ],
)
def test_noise_std_matches_tf_privacy(num_microbatches, accumulation, divisor):
    sigma = 2.0
    std = _noise_std(num_microbatches, accumulation, sigma)
    # ~20k samples: the estimate is within ~1%; 2x and sqrt(2)x are rejected.
    np.testing.assert_allclose(std, sigma * C / divisor, rtol=0.05)


def test_dp_model_microbatch_noise_is_divided_by_microbatches():
    x, y = digits(8)
    x = x.reshape(len(x), -1)
    deltas = []
    start = None
    for noise in (0.0, 2.0):
        model = tensorflow_privacy.DPModel(
            C, noise, 2, model=keras.Sequential([keras.Input((64,)), keras.layers.Dense(320)])
        )
        if start is None:
            start = [v.numpy() for v in model.trainable_variables]
        for v, s in zip(model.trainable_variables, start):
            v.assign(s)
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss=_loss())
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        deltas.append(np.concatenate(
            [(v.numpy() - s).ravel() for v, s in zip(model.trainable_variables, start)]
        ))
    np.testing.assert_allclose(np.std(deltas[1] - deltas[0]), 2.0 * C / 2, rtol=0.05)


def test_optimizer_arguments_and_config():
    adam = tensorflow_privacy.DPKerasAdamOptimizer(
        l2_norm_clip=1.5, noise_multiplier=1.1, num_microbatches=5,
        learning_rate=0.01, beta_1=0.8,
    )
    assert isinstance(adam.inner_optimizer, keras.optimizers.Adam)
    assert adam.inner_optimizer.beta_1 == 0.8
    assert adam.l2_norm_clip == 1.5 and adam.num_microbatches == 5
    config = adam.get_config()
    assert config["noise_multiplier"] == 1.1 and config["beta_1"] == 0.8
    clone = tensorflow_privacy.DPKerasAdamOptimizer.from_config(config)
    assert clone.get_config() == config
    # With k accumulated batches the ledger's sigma is TF-Privacy's times sqrt(k);
    # TF-Privacy's own figure (and attribute) stays the one given.
    sgd = tensorflow_privacy.DPKerasSGDOptimizer(1.0, 1.1, None, 2, learning_rate=0.1)
    np.testing.assert_allclose(sgd.noise_multiplier, 1.1 * np.sqrt(2), rtol=1e-12)
    np.testing.assert_allclose(sgd._noise_multiplier, 1.1, rtol=1e-12)
    np.testing.assert_allclose(sgd.get_config()["noise_multiplier"], 1.1, rtol=1e-12)
    assert sgd._l2_norm_clip == 1.0
    adagrad = tensorflow_privacy.VectorizedDPKerasAdagradOptimizer(1.0, 1.0, None, 1, 0.1)
    assert isinstance(adagrad.inner_optimizer, keras.optimizers.Adagrad)
    assert tensorflow_privacy.VectorizedDPKerasSGDOptimizer is tensorflow_privacy.DPKerasSGDOptimizer


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(l2_norm_clip=0.0, noise_multiplier=1.0), "l2_norm_clip"),
        (dict(l2_norm_clip=1.0, noise_multiplier=-1.0), "noise_multiplier"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=0), "num_microbatches"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, gradient_accumulation_steps=0),
         "gradient_accumulation_steps"),
    ],
)
def test_bad_optimizer_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tensorflow_privacy.DPKerasSGDOptimizer(**kwargs)


def test_custom_train_step_is_refused():
    class Custom(keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(self.loss(y, self(x)))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {}

    x, y = digits(16)
    model = Custom(tiny_model().layers)
    model.compile(
        optimizer=tensorflow_privacy.DPKerasSGDOptimizer(1.0, 1.0, learning_rate=0.1),
        loss=_loss(),
    )
    with pytest.raises(RuntimeError, match="make_private"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def test_dp_model_refuses_a_dp_optimizer():
    model = tensorflow_privacy.DPSequential(1.0, 1.0, layers=tiny_model().layers)
    with pytest.raises(ValueError, match="plain Keras optimizer"):
        model.compile(
            optimizer=tensorflow_privacy.DPKerasSGDOptimizer(1.0, 1.0), loss=_loss()
        )


def test_dp_model_needs_inputs_and_outputs():
    with pytest.raises(ValueError, match="inputs="):
        tensorflow_privacy.DPModel(1.0, 1.0)
    with pytest.raises(ValueError, match="use_xla"):
        tensorflow_privacy.DPSequential(1.0, 1.0, True)


def test_functional_dp_model_trains_with_a_plain_optimizer():
    x, y = digits(32)
    inputs = keras.Input((8, 8, 1))
    outputs = keras.layers.Dense(10)(keras.layers.Flatten()(inputs))
    model = tensorflow_privacy.DPModel(
        l2_norm_clip=1.0, noise_multiplier=0.5, inputs=inputs, outputs=outputs
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss(), metrics=["accuracy"])
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert model.optimizer.iterations.numpy() == 2
    assert np.isfinite(history.history["loss"][-1])
    assert model.l2_norm_clip == 1.0 and model.noise_multiplier == 0.5


def test_save_and_load(tmp_path):
    x, y = digits(32)
    plain = tfdp.make_private(tiny_model())
    plain.compile(
        optimizer=tensorflow_privacy.DPKerasSGDOptimizer(
            1.0, 1.1, None, learning_rate=0.1, momentum=0.5
        ),
        loss=_loss(),
    )
    dp_sequential = tensorflow_privacy.DPSequential(1.0, 1.1, 4, layers=tiny_model().layers)
    dp_sequential.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    for model in (plain, dp_sequential):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        path = str(tmp_path / f"{model.name}.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        assert type(loaded) is type(model)
        assert type(loaded.optimizer) is type(model.optimizer)
        assert loaded.optimizer.get_config() == model.optimizer.get_config()
        assert loaded.optimizer.iterations.numpy() == 2
        for a, b in zip(loaded.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(a, b)
        loaded.fit(x, y, batch_size=16, epochs=1, verbose=0)
        assert loaded.optimizer.iterations.numpy() == 4


def _shuffle_epsilon(sigma, passes, delta):
    """One Gaussian mechanism per pass, composed with dp_accounting's own RDP accountant."""
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(sigma), passes)
    return accountant.get_epsilon(delta)


def test_dp_sequential_with_microbatches_prints_epsilon_at_half_sigma(capsys):
    # Microbatches of 4 examples: one example moves its microbatch's clipped
    # mean by up to 2C, so both relations' epsilon is that of sigma / 2.
    x, y = digits(40)
    model = tensorflow_privacy.DPSequential(1.0, 1.1, 4, layers=tiny_model().layers)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=_loss())
    model.fit(x, y, batch_size=16, epochs=2, verbose=0,
              callbacks=[tfdp.callbacks.PrivacyLogger()])
    assert "PrivacyLogger: epsilon=" in capsys.readouterr().out
    ledger = model.privacy_ledger()
    # 40 // 16 = 2 steps per pass, 2 passes: the shuffle sampler fit really used.
    assert (ledger.sampler, ledger.steps, ledger.sensitivity) == ("shuffle", 4, 2)
    expected = _shuffle_epsilon(1.1 / 2, 2, 1e-5)
    np.testing.assert_allclose(model.epsilon(), expected, rtol=1e-9)
    np.testing.assert_allclose(ledger.epsilon_replace_one(), expected, rtol=1e-9)
    text = model.describe_epsilon()
    for part in ("at delta=1e-05", "zero_out adjacency", "sensitivity 2C",
                 "4 microbatches of 4 examples", "halves the effective noise multiplier"):
        assert part in text
    assert text.startswith(f"epsilon={expected:.4f}")


@pytest.mark.parametrize("num_microbatches, sensitivity", [(4, 2), (16, 1)])
def test_optimizer_microbatches_ledger(num_microbatches, sensitivity):
    # Through a tfdp.make_private model; 16 microbatches of a 16-row batch
    # hold one example each, the per-example sensitivity C.
    x, y = digits(32)
    model = tfdp.make_private(tiny_model())
    model.compile(
        optimizer=tensorflow_privacy.DPKerasSGDOptimizer(
            1.0, 1.1, num_microbatches, learning_rate=0.1),
        loss=_loss(),
    )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    ledger = model.privacy_ledger()
    assert ledger.sensitivity == sensitivity
    np.testing.assert_allclose(
        model.epsilon(), _shuffle_epsilon(1.1 / sensitivity, 1, 1e-5), rtol=1e-9)
    np.testing.assert_allclose(
        ledger.epsilon_replace_one(), _shuffle_epsilon(1.1 / 2, 1, 1e-5), rtol=1e-9)
    assert ("halves the effective noise multiplier" in model.describe_epsilon()) == (
        sensitivity == 2)
