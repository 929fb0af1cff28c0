"""Banded MF noise in the engine: the recursion, its covariance, DP-SGD at b=1, resume, replicas."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdp import checkpointing
from tfdp import dp
from tfdp import dpsgd_config
from tfdp import mechanism as mechanism_lib
from tfdp import samplers
from tfdp.dp import noise as noise_lib
from tfdp.dp import noisy_aggregator
from tfdp.privacy import banded_mf
from tfdp.secret_key import SecretKey

KEY = SecretKey(np.array([5, 6]))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _aggregator(coefficients, stddev=1.0):
    return noisy_aggregator.NoisyAggregator(
        noise_stddev=stddev, expected_batch_size=1.0, noise_key=KEY.derive("noise"),
        coefficients=coefficients)


def _noise_sequence(aggregator, size, steps):
    """The noise of `steps` steps on a zero sum of `size` coordinates: `[steps, size]`."""
    accumulators = [tf.Variable(tf.zeros([size]))]
    state = [tf.Variable(tf.zeros(aggregator.noise_state_shape([size])))]
    fn = tf.function(lambda t: aggregator.noisy_mean(accumulators, t, noise_state=state)[0],
                     autograph=False)
    return np.stack([fn(tf.constant(t, tf.int64)).numpy() for t in range(steps)])


def _draws(size, steps, stddev=1.0):
    """Today's independent draws z_t of DP-SGD, from the same key."""
    return np.stack([
        noise_lib.gaussian_noise([tf.zeros([size])], stddev,
                                 noise_lib.step_seed(KEY.derive("noise"), t))[0].numpy()
        for t in range(steps)])


class BandedNoiseTest(tf.test.TestCase):

    def test_noise_follows_the_recursion_through_the_ring_of_states(self):
        coefficients = banded_mf.square_root_coefficients(3)
        steps = 7  # The two slots of state wrap around three times.
        got = _noise_sequence(_aggregator(coefficients, 0.5), 10, steps)
        z = _draws(10, steps, 0.5)
        w = []
        for t in range(steps):
            history = sum(coefficients[j] * w[t - j] for j in range(1, 3) if t >= j)
            w.append((z[t] - history) / coefficients[0])
        self.assertAllClose(got, np.stack(w), rtol=1e-5, atol=1e-6)
        # The noise of step t is row t of C⁻¹Z.
        inverse = np.linalg.inv(banded_mf.strategy_matrix(coefficients, steps))
        self.assertAllClose(got, inverse @ z, rtol=1e-4, atol=1e-5)

    def test_covariance_across_steps_is_sigma_c_squared_c_inverse_c_inverse_transposed(self):
        coefficients, steps, size, stddev = banded_mf.square_root_coefficients(3), 6, 40_000, 0.7
        samples = _noise_sequence(_aggregator(coefficients, stddev), size, steps)
        empirical = samples @ samples.T / size
        inverse = np.linalg.inv(banded_mf.strategy_matrix(coefficients, steps))
        expected = stddev**2 * inverse @ inverse.T
        # Standard error of each entry of a Gaussian sample covariance.
        stderr = np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected**2) / size)
        self.assertLess(np.max(np.abs(empirical - expected) / stderr), 6.0)
        # Power: DP-SGD's independent noise (σC)²·I is rejected.
        dp_sgd = stddev**2 * np.eye(steps)
        self.assertGreater(np.max(np.abs(empirical - dp_sgd) / stderr), 20.0)

    def test_one_band_is_dp_sgd_bit_for_bit(self):
        aggregator = _aggregator((1.0,), 0.5)
        self.assertFalse(aggregator.correlated)
        self.assertIsNone(aggregator.noise_state_shape([3]))
        sums = [tf.Variable(tf.range(12.0))]
        got = aggregator.noisy_mean(sums, 4)
        expected = noise_lib.noisy_divided([tf.range(12.0)], 0.5,
                                           noise_lib.step_seed(KEY.derive("noise"), 4), 1.0)
        self.assertAllEqual(got[0], expected[0])

    def test_a_banded_strategy_needs_its_state(self):
        aggregator = _aggregator(banded_mf.square_root_coefficients(2))
        with self.assertRaisesRegex(ValueError, "noise_state"):
            aggregator.noisy_mean([tf.Variable(tf.zeros([3]))], 0)


def _model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(3)])


def _loss(y, logits):
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def _step(mechanism, model=None):
    model = model or _model()
    optimizer = keras.optimizers.SGD(0.5)
    return dp.PrivateTrainStep(model, optimizer, _loss, mechanism=mechanism)


def _batches(sampler, key, steps, n=64):
    rng = np.random.RandomState(0)
    x, y = rng.randn(n, 6).astype("float32"), rng.randint(0, 3, n)
    for t in range(steps):
        indices, weights = sampler.step_indices(key.derive("sampling"), tf.constant(t, tf.int64))
        safe = np.maximum(indices.numpy(), 0)
        yield x[safe], y[safe], weights.numpy()


def _train(step, sampler, key, steps, start=0):
    for t, (x, y, w) in enumerate(_batches(sampler, key, start + steps)):
        if t >= start:
            step.accumulate(x, y, w)
            step.apply()
    return [v.numpy() for v in step.model.trainable_variables]


class PrivateTrainStepBandsTest(tf.test.TestCase):

    def test_one_band_trains_as_dp_sgd_bit_for_bit(self):
        weights = []
        for name in ("poisson", "banded_poisson"):
            sampler = samplers.make_sampler(name, dataset_size=64, logical_batch_size=16)
            config = dpsgd_config.DPSGDConfig(1.0, 1.0)
            mechanism = mechanism_lib.DPSGD.from_config(config, sampler=sampler, secret_key=KEY)
            step = _step(mechanism)
            self.assertEqual(step.noise_state, [])
            weights.append(_train(step, sampler, KEY, 3))
        for a, b in zip(*weights):
            self.assertAllEqual(a, b)

    def test_resume_continues_the_correlated_noise_exactly(self):
        sampler = samplers.make_sampler("banded_poisson", dataset_size=64,
                                        logical_batch_size=8, bands=3)
        config = dpsgd_config.DPSGDConfig(1.0, 2.0, bands=3)
        mechanism = mechanism_lib.DPSGD.from_config(config, sampler=sampler, secret_key=KEY)
        directory = self.get_temp_dir()

        step = _step(mechanism)
        self.assertLen(step.noise_state, len(step.variables))
        _train(step, sampler, KEY, 2)
        checkpoint = checkpointing.RunCheckpoint(directory, step.model, step.optimizer,
                                                 secret_key=KEY, noise_state=step.noise_state)
        checkpoint.save(2, mechanism.ledger(2))
        uninterrupted = _train(step, sampler, KEY, 3, start=2)

        resumed = _step(mechanism)
        checkpointing.RunCheckpoint(directory, resumed.model, resumed.optimizer,
                                    secret_key=KEY, noise_state=resumed.noise_state).restore()
        self.assertEqual(int(resumed.optimizer.iterations.numpy()), 2)
        for a, b in zip(uninterrupted, _train(resumed, sampler, KEY, 3, start=2)):
            self.assertAllEqual(a, b)

        # A resume that lost the state draws other noise: the state matters.
        forgetful = _step(mechanism)
        checkpointing.RunCheckpoint(directory, forgetful.model, forgetful.optimizer,
                                    secret_key=KEY).restore()
        lost = _train(forgetful, sampler, KEY, 3, start=2)
        self.assertFalse(all(np.array_equal(a, b) for a, b in zip(uninterrupted, lost)))

    def test_noise_state_stays_out_of_the_model_and_optimizer(self):
        config = dpsgd_config.DPSGDConfig(1.0, 1.0, bands=2)
        mechanism = mechanism_lib.DPSGD.from_config(config, expected_batch_size=8.0,
                                                    secret_key=KEY)
        step = _step(mechanism)
        exported = {id(v) for v in step.model.weights} | {
            id(v) for v in step.optimizer.variables}
        self.assertTrue(step.noise_state)
        self.assertFalse(exported & {id(v) for v in step.noise_state})
        path = os.path.join(self.get_temp_dir(), "model.keras")
        step.model.save(path)
        self.assertLen(keras.models.load_model(path).weights, len(step.model.weights))


def _conv_model():
    # Conv, GroupNorm and Dense: the layer kinds each method clips its own way.
    keras.utils.set_random_seed(2)
    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3), keras.layers.GroupNormalization(2),
        keras.layers.Activation("tanh"), keras.layers.Flatten(), keras.layers.Dense(3)])


class BandedMethodsAgreeTest(tf.test.TestCase):

    def test_every_clipping_method_gives_the_same_banded_updates(self):
        # b = 4 over 6 steps, so the ring of b − 1 noise states wraps. Same
        # key: same batches and noise, so only the clipped sums may differ,
        # by float rounding. C = 0.1 clips every example.
        bands, steps, n = 4, 6, 64
        sampler = samplers.make_sampler("banded_poisson", dataset_size=n,
                                        logical_batch_size=8, bands=bands)
        config = dpsgd_config.DPSGDConfig(0.1, 1.0, bands=bands)
        mechanism = mechanism_lib.DPSGD.from_config(config, sampler=sampler, secret_key=KEY)
        rng = np.random.RandomState(0)
        x = rng.randn(n, 8, 8, 1).astype("float32")
        y = rng.randint(0, 3, n)
        results = {}
        for method in ("vectorized", "mixed", "bk", "ghost"):
            model = _conv_model()
            step = dp.PrivateTrainStep(model, keras.optimizers.SGD(0.5), _loss,
                                       mechanism=mechanism, method=method)
            for t in range(steps):
                indices, weights = sampler.step_indices(KEY.derive("sampling"),
                                                        tf.constant(t, tf.int64))
                safe = np.maximum(indices.numpy(), 0)
                step.accumulate(x[safe], y[safe], weights.numpy())
                step.apply()
            self.assertEqual(int(step.optimizer.iterations.numpy()), steps)
            results[method] = ([v.numpy() for v in model.trainable_variables],
                               [v.numpy() for v in step.noise_state])
        start = [v.numpy() for v in _conv_model().trainable_variables]
        want_weights, want_state = results["vectorized"]
        self.assertFalse(all(np.allclose(a, b) for a, b in zip(want_weights, start)))
        for method in ("mixed", "bk", "ghost"):
            got_weights, got_state = results[method]
            for a, b in zip(got_weights, want_weights):
                self.assertAllClose(a, b, rtol=1e-4, atol=1e-5, msg=method)
            for a, b in zip(got_state, want_state):
                self.assertAllClose(a, b, rtol=1e-4, atol=1e-5, msg=method)


# The replica check needs 2 logical CPU devices, set before TensorFlow runs its
# first op: it runs in a child process.
def _replica_child():
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    config = dpsgd_config.DPSGDConfig(1.0, 1.5, bands=3)
    mechanism = mechanism_lib.DPSGD.from_config(config, expected_batch_size=8.0, secret_key=KEY)
    results = []
    for strategy in (tf.distribute.get_strategy(),
                     tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])):
        with strategy.scope():
            step = _step(mechanism)
        rng = np.random.RandomState(0)
        x, y = rng.randn(8, 6).astype("float32"), rng.randint(0, 3, 8)
        for _ in range(4):
            step.accumulate(x, y, np.ones(8, "float32"))
            step.apply()
        results.append(([v.numpy() for v in step.model.trainable_variables],
                        [v.numpy() for v in step.noise_state]))
    (one_weights, one_state), (two_weights, two_state) = results
    for a, b in zip(one_weights, two_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Each replica holds w / 2; read across replicas (as a checkpoint reads it) they sum to w.
    for a, b in zip(one_state, two_state):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    print("REPLICAS_OK")


@pytest.mark.slow
def test_two_replicas_add_the_correlated_noise_once():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    code = "from tests.dp import test_banded_noise as t; t._replica_child()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert "REPLICAS_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
