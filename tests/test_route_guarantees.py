"""Every route × every privacy guarantee: a guarantee one route lacks is a privacy bug.

The routes: the trainer (`tfdp.train.train`, in process), Keras `fit` on
arrays and on a stream (`tfdp.make_private` with a `tfdp.DPOptimizer`), TF
Privacy's compat `fit` (`DPKerasSGDOptimizer`) and its custom loop
(`minimize` with a loss vector and a tape). Keras `fit` under
MirroredStrategy and MultiWorkerMirroredStrategy runs the same adapter code
(`tests/keras/test_distributed_fit.py`, `tests/keras/test_multiworker_fit.py`
check it there: one key, noise once, no example twice, the same ε).

Each cell trains a tiny model for a step or two (or is refused before the
first), and asserts the guarantee; where a guarantee does not apply to a
route, `NOT_APPLICABLE` says why, and docs/PRIVACY.md's table of routes ×
guarantees says the same. The table there is checked against this file.
"""

import os
import pathlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import training
from tfdp.compat import tensorflow_privacy

ROUTES = ("trainer", "keras_fit", "keras_stream", "compat_fit", "compat_custom_loop")
GUARANTEES = ("probe", "secret_key", "budget", "labels", "non_finite", "duplicates",
              "banded_state", "release_path")

# (route, guarantee): why it does not apply. docs/PRIVACY.md names each.
NOT_APPLICABLE = {
    ("trainer", "release_path"): "no user code runs between the clipping and the optimizer",
    ("keras_stream", "banded_state"): "banded noise samples within groups: arrays only",
    ("compat_fit", "banded_state"): "TF-Privacy's optimizers take no bands",
    ("compat_custom_loop", "banded_state"): "TF-Privacy's optimizers take no bands",
    ("compat_fit", "budget"): "TF-Privacy's optimizers take no target epsilon",
    ("compat_custom_loop", "budget"): "TF-Privacy's optimizers take no target epsilon",
    ("compat_custom_loop", "duplicates"): "the loop sees loss rows, not input rows",
}

N, B, CLASSES, SHAPE = 48, 8, 4, (4, 4, 1)


class Centering(keras.layers.Layer):
    """x − mean over the batch: row i depends on every other row."""

    def call(self, x):
        return x - tf.reduce_mean(x, axis=0, keepdims=True)


def make_model(mixing=False):
    layers = [keras.Input(SHAPE), keras.layers.Flatten()]
    if mixing:
        layers.append(Centering(name="centering"))
    layers.append(keras.layers.Dense(CLASSES, name="head"))
    return keras.Sequential(layers)


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((N, *SHAPE)).astype("float32")
    y = (np.arange(N) % CLASSES).astype("int32")
    return x, y


def xent():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def weights(model):
    return [np.array(w) for w in model.get_weights()]


class Outcome:
    """What a route did: the weights before and after, and the steps and ε it claims."""

    def __init__(self, before, after, steps, epsilon):
        self.before, self.after, self.steps, self.epsilon = before, after, steps, epsilon

    @property
    def changed(self):
        return any(not np.array_equal(a, b) for a, b in zip(self.before, self.after))


def run(route, x, y, *, mixing=False, sigma=1.0, clip=1.0, target_epsilon=None, bands=1,
        seed=None, steps=2, fits=1, tmp_path=None):
    """Trains `route` on (x, y); raises what the route raises."""
    keras.utils.set_random_seed(0)
    if route == "trainer":  # It builds the model in its strategy's scope.
        return _run_trainer(mixing, x, y, sigma=sigma, clip=clip, target_epsilon=target_epsilon,
                            bands=bands, seed=seed, steps=steps, fits=fits, tmp_path=tmp_path)
    model = make_model(mixing)
    before = weights(model)
    if route == "compat_custom_loop":
        optimizer = tensorflow_privacy.DPKerasSGDOptimizer(
            l2_norm_clip=clip, noise_multiplier=sigma, learning_rate=0.5)
        optimizer.declare_model(model, xent())
        if seed is not None:
            optimizer = _seeded(optimizer, seed)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        for step in range(steps * fits):
            rows = slice(step * B % N, step * B % N + B)
            with tf.GradientTape() as tape:
                loss = loss_fn(y[rows], model(x[rows], training=True))
            optimizer.minimize(loss, model.trainable_variables, tape=tape)
        return Outcome(before, weights(model), int(optimizer.iterations.numpy()), None)
    if route == "compat_fit":
        optimizer = tensorflow_privacy.DPKerasSGDOptimizer(
            l2_norm_clip=clip, noise_multiplier=sigma, learning_rate=0.5)
        if seed is not None:
            optimizer = _seeded(optimizer, seed)
    else:
        contract = dict(l2_norm_clip=clip, noise_multiplier=sigma, bands=bands,
                        target_epsilon=target_epsilon, insecure_reproducible_seed=seed)
        if route == "keras_stream":  # N: a stream's passes are counted against it.
            contract["dataset_size"] = N
        optimizer = tfdp.DPOptimizer(keras.optimizers.SGD(0.5), **contract)
    private = tfdp.make_private(model)
    private.compile(optimizer=optimizer, loss=xent())
    for _ in range(fits):
        if route == "keras_stream":
            stream = tf.data.Dataset.from_tensor_slices((x, y)).batch(B, drop_remainder=True)
            private.fit(stream.take(steps), epochs=1, verbose=0)
        else:
            private.fit(x, y, batch_size=B, steps_per_epoch=steps, epochs=1, verbose=0)
    return Outcome(before, weights(model), int(optimizer.iterations.numpy()),
                   private.epsilon())


def _seeded(optimizer, seed):
    """A compat optimizer of the same settings with an insecure (reproducible) seed."""
    config = optimizer.get_config()
    config["insecure_reproducible_seed"] = seed
    rebuilt = type(optimizer).from_config(config)
    declared = getattr(optimizer, "declared_model", None)
    if declared is not None:
        rebuilt.declare_model(declared.model, declared.loss)
    return rebuilt


def _run_trainer(mixing, x, y, *, sigma, clip, target_epsilon, bands, seed, steps, fits,
                 tmp_path):
    from tfdp.train import train

    os.makedirs(tmp_path, exist_ok=True)
    path = os.path.join(tmp_path, "data.npz")
    np.savez(path, images=x, labels=y.astype("int64"))
    np.savez(os.path.join(tmp_path, "test.npz"), images=x[:B], labels=y[:B].astype("int64"))
    def model_fn(num_classes, input_shape):
        del num_classes, input_shape
        return make_model(mixing)

    workdir = os.path.join(tmp_path, "workdir")
    summary = None
    for fit in range(fits):
        summary = train(
            workdir,
            data_config=training.DataConfig(dataset=f"npz:{path}",
                                            test_dataset=f"npz:{tmp_path}/test.npz"),
            model_config=training.ModelConfig(model_fn=model_fn),
            privacy_config=training.PrivacyConfig(
                l2_norm_clip=clip, noise_multiplier=sigma if target_epsilon is None or sigma
                else None, target_epsilon=target_epsilon, bands=bands,
                insecure_reproducible_seed=seed),
            optimization_config=training.OptimizationConfig(
                epochs=(fit + 1) * steps * B / N, logical_batch_size=B, base_lr=0.5,
                lr_schedule="constant"),
            run_config=training.RunConfig(export_model=False, write_html_report=False,
                                          log_every_steps=1000))
    return Outcome(None, None, summary["steps"], summary["epsilon"])


def _cell(route, guarantee):
    if (route, guarantee) in NOT_APPLICABLE:
        pytest.skip(NOT_APPLICABLE[(route, guarantee)])


@pytest.fixture
def tmp(tmp_path):
    return str(tmp_path)


# About 3 minutes on one core: run with the slow tests (`-m slow`, as CI does).
@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
class TestRouteGuarantees:

    def test_probe(self, route, tmp):
        """A layer mixing the batch's rows is refused before the first release."""
        _cell(route, "probe")
        x, y = make_data()
        with pytest.raises(ValueError, match="'centering' mixes examples"):
            run(route, x, y, mixing=True, tmp_path=tmp)

    def test_secret_key(self, route, tmp):
        """Noise and sampling come from a fresh secret key, not from Keras' or TF's seed."""
        _cell(route, "secret_key")
        x, y = make_data()
        if route == "trainer":
            first = run(route, x, y, tmp_path=tmp + "/a")
            second = run(route, x, y, tmp_path=tmp + "/b")
            keys = [_trainer_key(tmp + d) for d in ("/a", "/b")]
            assert keys[0] != keys[1]
            assert first.steps == second.steps
            return
        first = run(route, x, y, tmp_path=tmp)
        second = run(route, x, y, tmp_path=tmp)
        assert first.changed and second.changed
        assert any(not np.allclose(a, b) for a, b in zip(first.after, second.after))

    def test_budget(self, route, tmp):
        """A target ε that allows no step at σ = 0.5 releases nothing and claims no more."""
        _cell(route, "budget")
        x, y = make_data()
        outcome = run(route, x, y, sigma=0.5, target_epsilon=0.1, steps=4, tmp_path=tmp)
        assert outcome.steps == 0
        if outcome.before is not None:
            assert not outcome.changed
        assert outcome.epsilon is None or outcome.epsilon <= 0.1

    @pytest.mark.parametrize("bad", [-1, CLASSES])
    def test_labels(self, route, bad, tmp):
        """A label outside [0, classes) is refused before any release, its value unsaid."""
        _cell(route, "labels")
        x, y = make_data()
        y = y.copy()
        y[N - 3] = bad  # In no early batch: refused up front, not when sampled.
        if route in ("keras_stream", "compat_custom_loop"):
            y[1] = bad  # A stream's batch is checked before its release.
        with pytest.raises((ValueError, tf.errors.InvalidArgumentError)) as caught:
            run(route, x, y, steps=1, tmp_path=tmp)
        message = str(caught.value)
        assert "label" in message.lower() or "class" in message.lower()
        # No batch of labels in the message (TensorFlow's own would print them).
        assert not re.search(r"\[\s*-?\d+(\s+-?\d+){5,}", message), message

    def test_non_finite(self, route, tmp):
        """NaN images are dropped (zero contribution) and the weights stay finite."""
        _cell(route, "non_finite")
        x, y = make_data()
        x = x.copy()
        x[::3, 0, 0, 0] = np.nan  # One pixel: the rows stay distinct (no copies).
        if route == "compat_custom_loop":
            # Its tape cannot drop one example alone: the step is not released.
            with pytest.raises(tf.errors.InvalidArgumentError, match="nothing of this step"):
                run(route, x, y, steps=2, tmp_path=tmp)
            return
        outcome = run(route, x, y, steps=2, tmp_path=tmp)
        if route == "trainer":
            # Its loop stops on NaN/Inf parameters (FloatingPointError): it ran on.
            assert outcome.steps == 2 and np.isfinite(outcome.epsilon)
            return
        assert all(np.all(np.isfinite(w)) for w in outcome.after)
        assert outcome.changed

    def test_duplicates(self, route, tmp):
        """Three copies of one example are refused before any release."""
        _cell(route, "duplicates")
        x, y = make_data()
        x = x.copy()
        x[5] = x[9] = x[0]
        with pytest.raises(ValueError, match="(?i)cop(y|ies)"):
            run(route, x, y, steps=N // B, tmp_path=tmp)

    def test_banded_state(self, route, tmp):
        """Banded noise continues across fit calls (or a resume): 2 + 2 steps equal 4."""
        _cell(route, "banded_state")
        x, y = make_data()
        once = run(route, x, y, bands=2, seed=7, steps=4, tmp_path=tmp + "/once")
        twice = run(route, x, y, bands=2, seed=7, steps=2, fits=2, tmp_path=tmp + "/twice")
        assert once.steps == twice.steps == 4
        if route == "trainer":
            assert once.epsilon == pytest.approx(twice.epsilon)
            return
        for a, b in zip(once.after, twice.after):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def test_release_path(self, route, tmp):
        """Plain gradients handed to the wrapped optimizer are refused."""
        _cell(route, "release_path")
        keras.utils.set_random_seed(0)
        model = make_model()
        model.build((None, *SHAPE))
        before = weights(model)
        if route.startswith("compat"):
            optimizer = tensorflow_privacy.DPKerasSGDOptimizer(
                l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.5)
        else:
            optimizer = tfdp.DPOptimizer(keras.optimizers.SGD(0.5), l2_norm_clip=1.0,
                                         noise_multiplier=1.0)
        optimizer.build(model.trainable_variables)
        plain = [tf.ones_like(v) for v in model.trainable_variables]
        with pytest.raises(tfdp.keras.PlainGradientsError):
            optimizer.inner_optimizer.apply_gradients(zip(plain, model.trainable_variables))
        with pytest.raises(tfdp.keras.PlainGradientsError):
            optimizer.apply_gradients(zip(plain, model.trainable_variables))
        assert all(np.array_equal(a, b) for a, b in zip(before, weights(model)))


def _trainer_key(tmp):
    """The secret key the trainer kept in its checkpoint (the only place it is)."""
    path = tf.train.latest_checkpoint(os.path.join(tmp, "workdir", "checkpoints"))
    reader = tf.train.load_checkpoint(path)
    names = [n for n in reader.get_variable_to_shape_map() if "key" in n.lower()]
    assert names, reader.get_variable_to_shape_map()
    return tuple(np.asarray(reader.get_tensor(names[0])).ravel().tolist())


def test_docs_table_lists_every_route_and_guarantee():
    """docs/PRIVACY.md's table of routes × guarantees names every cell tested here."""
    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "PRIVACY.md").read_text()
    section = text.split("## Every route, every guarantee", 1)[1].split("\n## ", 1)[0]
    for guarantee in GUARANTEES:
        assert f"`{guarantee}`" in section, guarantee
    for route in ROUTES:
        assert f"`{route}`" in section, route
    for (route, guarantee), why in NOT_APPLICABLE.items():
        assert why in section, (route, guarantee)
