"""`fit` of a private model under tf.distribute: R replicas compute the one-device update.

Two logical CPU devices must be configured before TensorFlow initialises its
devices, which pytest's process has long done, so each check runs in a
child process (`_child`) that trains the same model with the same
(insecure, public) key on one device and under `MirroredStrategy`, and
writes the weights, step counts and epsilons to an .npz asserted here. With
σ > 0 equal weights also show that the noise is added once per logical step:
per replica it would add √R or R times the one-device noise.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPLICAS = 2
CHILD_TIMEOUT_S = 300

# name: (sampler, optimizer options, fit options, examples, epochs)
SCENARIOS = {
    "poisson": ("poisson", {}, {}, 128, 2),
    "shuffle": ("shuffle", {"gradient_accumulation_steps": 2, "weight_decay": 0.01}, {}, 128, 2),
    "user": ("user_poisson", {"privacy_unit": "user", "max_examples_per_user": 2},
             {"user_ids": "mod40"}, 128, 2),
}


def _child(out_path, names):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)
    import warnings

    import keras

    import tfdp
    from tests.keras.keras_test_case import digits
    from tests.keras.keras_test_case import tiny_model
    from tests.keras.keras_test_case import xent

    warnings.simplefilter("ignore")  # The insecure seed's warning.

    def build(strategy, sampler, options):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = tfdp.make_private(tiny_model())
            model.compile(
                optimizer=tfdp.DPOptimizer(
                    keras.optimizers.SGD(0.5, momentum=0.5), l2_norm_clip=1.0,
                    noise_multiplier=1.0, insecure_reproducible_seed=3, sampler=sampler,
                    **options),
                loss=xent(), metrics=["accuracy"])
        return model

    out = {}
    one = tf.distribute.OneDeviceStrategy("/cpu:0")
    mirrored = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    out["replicas"] = mirrored.num_replicas_in_sync
    for name in names:
        sampler, options, fit_options, n, epochs = SCENARIOS[name]
        x, y = digits(n)
        fit_options = dict(fit_options)
        if fit_options.get("user_ids") == "mod40":
            fit_options["user_ids"] = np.arange(n) % 40
        for tag, strategy in (("one", one), ("mirrored", mirrored)):
            model = build(strategy, sampler, options)
            history = model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, **fit_options)
            out[f"{name}_{tag}_steps"] = int(model.optimizer.iterations.numpy())
            out[f"{name}_{tag}_epsilon"] = model.describe_epsilon()
            out[f"{name}_{tag}_loss"] = np.array(history.history["loss"])
            for i, w in enumerate(model.model.trainable_variables):
                out[f"{name}_{tag}_w{i}"] = w.numpy()

    # Refusals, each one clear ValueError (the message is asserted).
    x, y = digits(64)
    errors = {}

    def refusal(key, fn):
        try:
            fn()
            errors[key] = ""
        except ValueError as e:
            errors[key] = str(e)

    model = build(mirrored, "shuffle", {})
    refusal("stream", lambda: model.fit(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(16), verbose=0))
    model = build(mirrored, "poisson", {})
    refusal("ragged_batch", lambda: model.fit(x, y, batch_size=15, verbose=0))
    with mirrored.scope():
        keras.utils.set_random_seed(0)
        model = tfdp.make_private(tiny_model())
    outside = tfdp.DPOptimizer("sgd", 1.0, 1.0, insecure_reproducible_seed=3)
    with mirrored.scope():
        model.compile(optimizer=outside, loss=xent())
    refusal("outside_scope", lambda: model.fit(x, y, batch_size=16, verbose=0))
    central = tf.distribute.experimental.CentralStorageStrategy()
    model = build(central, "poisson", {})
    refusal("central_storage", lambda: model.fit(x, y, batch_size=16, verbose=0))
    out["errors"] = json.dumps(errors)
    np.savez(out_path, **out)


def _run_child(tmp_path, names):
    path = os.path.join(str(tmp_path), "distributed_fit.npz")
    code = (f"from tests.keras import test_distributed_fit as t; "
            f"t._child({path!r}, {list(names)!r})")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TF_CONFIG", None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, f"child failed:\n{proc.stderr[-4000:]}"
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def _assert_same_update(r, name):
    # The same logical steps, the same ε, the one-device weights.
    assert int(r[f"{name}_one_steps"]) > 0
    assert int(r[f"{name}_one_steps"]) == int(r[f"{name}_mirrored_steps"])
    assert str(r[f"{name}_one_epsilon"]) == str(r[f"{name}_mirrored_epsilon"])
    # The logged loss is the whole batch's, not 1 / R of it.
    np.testing.assert_allclose(r[f"{name}_one_loss"], r[f"{name}_mirrored_loss"], rtol=1e-4)
    weights = sorted(k for k in r if k.startswith(f"{name}_one_w"))
    assert weights
    for key in weights:
        other = r[key.replace("_one_", "_mirrored_")]
        np.testing.assert_allclose(r[key], other, rtol=1e-5, atol=1e-5, err_msg=key)


class TestMirroredFit:
    @pytest.fixture(scope="class")
    def results(self, tmp_path_factory):
        return _run_child(tmp_path_factory.mktemp("mirrored"), ["poisson"])

    def test_two_replicas(self, results):
        assert int(results["replicas"]) == REPLICAS

    def test_poisson_equals_one_device_with_noise(self, results):
        _assert_same_update(results, "poisson")

    def test_unsupported_setups_are_refused_clearly(self, results):
        errors = json.loads(str(results["errors"]))
        assert "arrays" in errors["stream"] and "Received" in errors["stream"]
        assert "multiple of the number of replicas" in errors["ragged_batch"]
        assert "strategy.scope()" in errors["outside_scope"]
        assert "MirroredStrategy" in errors["central_storage"]
        assert "CentralStorageStrategy" in errors["central_storage"]


@pytest.mark.slow
def test_shuffle_weight_decay_and_users_equal_one_device(tmp_path):
    results = _run_child(tmp_path, ["shuffle", "user"])
    _assert_same_update(results, "shuffle")
    _assert_same_update(results, "user")
