"""Data-parallel DP-SGD on tf.distribute: reduction, noise once, input, workers.

The MirroredStrategy checks need 4 logical CPU devices, which must be set
before TensorFlow runs its first op; pytest has long since done that in its
own process, so they run in one child process (`_mirrored_child`) that
writes its results to an .npz, asserted here. The MultiWorkerMirrored check
runs two `python -m tfdp.train` workers over 127.0.0.1.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from scipy import stats
import tensorflow as tf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_REPLICAS = 4
CHILD_TIMEOUT_S = 300
WORKER_TIMEOUT_S = 300


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TF_CONFIG", None)
    return env


def _chi2_accepts(samples, stddev, alpha=1e-6):
    """Two-sided chi-square test that `samples` ~ N(0, stddev²)."""
    statistic = float(np.sum(np.square(samples))) / stddev**2
    p_low = stats.chi2.cdf(statistic, samples.size)
    return min(p_low, 1.0 - p_low) * 2 > alpha


# ---------------------------------------------------------------------------
# The child: 4 logical CPUs, one-device vs MirroredStrategy.
# ---------------------------------------------------------------------------

# Noise-std experiment: σ·C dominates the clipped sum (norm ≤ 16·0.01).
NOISE_SIGMA, NOISE_CLIP, NOISE_LR, NOISE_B = 100.0, 0.01, 1.0, 16.0
# Equality experiment: real data (digits), Poisson sampling with padding.
EQ_LOGICAL, EQ_PHYSICAL, EQ_STEPS = 48, 8, 3


def _mirrored_child(out_path):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_REPLICAS
    )
    import functools

    import keras

    from tfdp import data as data_lib
    from tfdp import distribute
    from tfdp import dp
    from tfdp import models
    from tfdp.secret_key import SecretKey

    def loss_fn(y, logits):
        return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)

    train_src, _, info = data_lib.load_offline("digits", seed=0)
    n = len(train_src)
    spec = data_lib.train_sampler(
        train_src, sampler="poisson", physical_batch_size=EQ_PHYSICAL,
        logical_batch_size=EQ_LOGICAL,
    )
    make = functools.partial(
        data_lib.make_train_pipeline, train_src, sampler="poisson",
        logical_batch_size=EQ_LOGICAL, num_steps=EQ_STEPS, seed=3,
        sampling_key=np.array([3, 4], np.int64),
    )

    def build(strategy, *, sigma, clip, lr, momentum, expected, seed=0):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = models.small_convnet(num_classes=info.num_classes, input_shape=info.image_shape)
            optimizer = keras.optimizers.SGD(lr, momentum=momentum, nesterov=momentum > 0)
            step = dp.PrivateTrainStep(
                model, optimizer, loss_fn, l2_norm_clip=clip, noise_multiplier=sigma,
                expected_batch_size=expected, method="bk",
                secret_key=SecretKey.insecure_from_seed(seed),
            )
        return model, step

    def weights(model):
        return [v.numpy() for v in model.trainable_variables]

    def run_pipeline(strategy, sigma):
        model, step = build(strategy, sigma=sigma, clip=1.0, lr=0.5, momentum=0.9,
                            expected=spec.expected_batch_size, seed=11)
        pipeline = distribute.distribute_train_pipeline(strategy, make, EQ_PHYSICAL)
        applied, lasts_ok = 0, True
        for images, labels, w, last in pipeline:
            step.accumulate(images, labels, w)
            flags = [bool(v) for v in strategy.experimental_local_results(last)]
            lasts_ok &= len(set(flags)) == 1
            if distribute.is_last(strategy, last):
                step.apply()
                applied += 1
        s = step.pop_stats()
        return weights(model), applied, lasts_ok, s["examples"], int(step.optimizer.iterations.numpy())

    one = distribute.get_strategy("one_device")
    mirrored = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(NUM_REPLICAS)])
    out = {"replicas": mirrored.num_replicas_in_sync}
    for sigma, tag in ((0.0, "sigma0"), (1.3, "sigma1")):
        w1, a1, _, ex1, it1 = run_pipeline(one, sigma)
        wm, am, ok, exm, itm = run_pipeline(mirrored, sigma)
        out[f"{tag}_applied"] = np.array([a1, am, it1, itm])
        out[f"{tag}_examples"] = np.array([ex1, exm])
        out[f"{tag}_lasts_consistent"] = np.array(ok)
        for i, (a, b) in enumerate(zip(w1, wm)):
            out[f"{tag}_one_{i}"], out[f"{tag}_mirrored_{i}"] = a, b

    # Plain global-batch tensors are split across replicas (weight-0 padded).
    rng = np.random.default_rng(1)
    x = tf.constant(rng.uniform(size=(14,) + tuple(info.image_shape)).astype("float32"))
    y = tf.constant(rng.integers(0, info.num_classes, 14), tf.int32)
    w = tf.constant((rng.uniform(size=14) > 0.2).astype("float32"))
    for name, strategy in (("one", one), ("mirrored", mirrored)):
        model, step = build(strategy, sigma=0.0, clip=0.5, lr=0.1, momentum=0.0, expected=12.0)
        step.accumulate(x[:6], y[:6], w[:6])
        step.accumulate(x[6:], y[6:], w[6:])
        step.apply()
        for i, v in enumerate(weights(model)):
            out[f"plain_{name}_{i}"] = v

    # Noise: σ huge against the clipped sum, plain SGD: Δw = -lr·(sum + noise)/B.
    model, step = build(mirrored, sigma=NOISE_SIGMA, clip=NOISE_CLIP, lr=NOISE_LR,
                        momentum=0.0, expected=NOISE_B, seed=5)
    before = weights(model)
    step.accumulate(x[:8], y[:8], tf.ones([8]))
    step.accumulate(x[6:], y[6:], tf.ones([8]))
    step.apply()
    out["noise_delta"] = np.concatenate(
        [(a - b).ravel() for a, b in zip(weights(model), before)]
    )
    np.savez(out_path, **out)


# ---------------------------------------------------------------------------
# Tests.
# ---------------------------------------------------------------------------


@pytest.mark.slow
class MirroredStrategyTest(tf.test.TestCase):
    results = None

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        out_dir = tf.compat.v1.test.get_temp_dir()
        path = os.path.join(out_dir, "mirrored_child.npz")
        code = f"from tests import test_distribute as t; t._mirrored_child({path!r})"
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True,
            text=True, timeout=CHILD_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise AssertionError(f"child failed:\n{proc.stderr[-4000:]}")
        with np.load(path) as f:
            cls.results = dict(f)

    def _weights(self, prefix):
        keys = sorted((k for k in self.results if k.startswith(prefix)),
                      key=lambda k: int(k.rsplit("_", 1)[1]))
        return [self.results[k] for k in keys]

    def test_four_replicas(self):
        self.assertEqual(int(self.results["replicas"]), NUM_REPLICAS)

    def test_sigma_zero_update_equals_one_device(self):
        r = self.results
        # Same number of logical steps, all replicas saw `last` together.
        a1, am, it1, itm = r["sigma0_applied"]
        self.assertEqual(a1, EQ_STEPS)
        self.assertEqual(am, EQ_STEPS)
        self.assertEqual((it1, itm), (EQ_STEPS, EQ_STEPS))
        self.assertTrue(bool(r["sigma0_lasts_consistent"]))
        # Stats are summed over replicas: the same examples were seen.
        self.assertEqual(r["sigma0_examples"][0], r["sigma0_examples"][1])
        one, mirrored = self._weights("sigma0_one_"), self._weights("sigma0_mirrored_")
        self.assertNotEmpty(one)
        for a, b in zip(one, mirrored):
            self.assertAllClose(a, b, rtol=1e-5, atol=1e-6)

    def test_update_with_noise_equals_one_device(self):
        # The noise is one draw from the step's common seed, so the noisy
        # update does not depend on the number of replicas either.
        one, mirrored = self._weights("sigma1_one_"), self._weights("sigma1_mirrored_")
        for a, b in zip(one, mirrored):
            self.assertAllClose(a, b, rtol=1e-5, atol=1e-5)

    def test_plain_global_batch_is_split_across_replicas(self):
        one, mirrored = self._weights("plain_one_"), self._weights("plain_mirrored_")
        self.assertNotEmpty(one)
        for a, b in zip(one, mirrored):
            self.assertAllClose(a, b, rtol=1e-5, atol=1e-6)

    def test_total_noise_std_is_sigma_c(self):
        delta = self.results["noise_delta"]
        expected = NOISE_LR * NOISE_SIGMA * NOISE_CLIP / NOISE_B
        self.assertGreater(delta.size, 10_000)
        self.assertTrue(_chi2_accepts(delta, expected))
        # Power: a R×, √R×, 1/√R× or 1/R× (R = 4) mistake, or half/double
        # the std, is rejected.
        for factor in (0.5, 2.0, NUM_REPLICAS, 1 / NUM_REPLICAS, np.sqrt(NUM_REPLICAS),
                       1 / np.sqrt(NUM_REPLICAS), 0.9, 1.1):
            self.assertFalse(_chi2_accepts(delta, factor * expected), factor)


class MixedPrecisionTest(tf.test.TestCase):

    def test_bf16_clipping_norms_close_to_float32(self):
        import keras

        from tfdp import distribute
        from tfdp import dp
        from tfdp import models
        from tfdp.dp import private_step

        def loss_fn(y, logits):
            return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)

        rng = np.random.default_rng(0)
        x = tf.constant(rng.uniform(size=(8, 28, 28, 1)).astype("float32"))
        y = tf.constant(rng.integers(0, 10, 8), tf.int32)
        keras.utils.set_random_seed(0)
        m32 = models.small_convnet(num_classes=10, input_shape=(28, 28, 1))
        with distribute.precision_policy(True):
            m16 = models.small_convnet(num_classes=10, input_shape=(28, 28, 1))
        self.assertEqual(keras.mixed_precision.dtype_policy().name, "float32")  # Restored.
        m16.set_weights(m32.get_weights())
        self.assertEqual(m16(x).dtype, tf.bfloat16)
        self.assertTrue(all(v.dtype == "float32" for v in m16.trainable_variables))
        self.assertTrue(private_step.is_mixed_precision(m16))
        self.assertFalse(private_step.is_mixed_precision(m32))

        # The step's float32 loss and float32 accumulators; mixed precision
        # picks a method the clipping engine supports under bf16.
        steps = {}
        for name, model in (("f32", m32), ("bf16", m16)):
            steps[name] = dp.PrivateTrainStep(
                model, keras.optimizers.SGD(0.1), loss_fn, l2_norm_clip=1.0,
                noise_multiplier=0.0, expected_batch_size=8.0, method="auto",
            )
        n32 = steps["f32"]._grads_and_stats(x, y, tf.ones([8]))
        grads16, stats16 = steps["bf16"]._grads_and_stats(x, y, tf.ones([8]))
        _, norms32 = dp.clipped_grad_sum(m32, steps["f32"].loss_fn, x, y, l2_norm_clip=1.0)
        _, norms16 = dp.clipped_grad_sum(m16, steps["bf16"].loss_fn, x, y, l2_norm_clip=1.0,
                                         method=steps["bf16"].method)
        self.assertEqual(norms16.dtype, tf.float32)
        self.assertAllClose(norms16, norms32, rtol=2e-2)
        self.assertTrue(all(g.dtype == tf.float32 for g in grads16))
        self.assertAllClose(stats16["norm_sum"], n32[1]["norm_sum"], rtol=2e-2)
        # A full step runs and keeps float32 variables.
        steps["bf16"].accumulate(x, y, tf.ones([8]))
        steps["bf16"].apply()
        self.assertTrue(all(a.dtype == tf.float32 for a in steps["bf16"].accumulators))


class ChiefTest(tf.test.TestCase):

    def test_single_host_is_chief_and_keeps_its_directory(self):
        from tfdp import distribute

        strategy = tf.distribute.get_strategy()
        self.assertTrue(distribute.is_chief(strategy))

    def test_chief_rules(self):
        from tfdp import distribute

        class Resolver:
            def __init__(self, task_type, task_id, cluster):
                self.task_type, self.task_id, self._cluster = task_type, task_id, cluster

            def cluster_spec(self):
                return tf.train.ClusterSpec(self._cluster)

        class Strategy:
            def __init__(self, resolver):
                self.cluster_resolver = resolver

        workers = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
        with_chief = dict(workers, chief=["127.0.0.1:3"])
        self.assertTrue(distribute.is_chief(Strategy(Resolver("worker", 0, workers))))
        self.assertFalse(distribute.is_chief(Strategy(Resolver("worker", 1, workers))))
        self.assertFalse(distribute.is_chief(Strategy(Resolver("worker", 0, with_chief))))
        self.assertTrue(distribute.is_chief(Strategy(Resolver("chief", 0, with_chief))))
        self.assertFalse(distribute.is_chief(Strategy(Resolver("evaluator", 0, with_chief))))

    def test_chief_process_from_tf_config(self):
        """Before any strategy (`tfdp.train.main` removing a workdir): TF_CONFIG's task."""
        import json
        from unittest import mock

        from tfdp import distribute

        workers = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
        cases = [(None, True), ({"cluster": workers, "task": {"type": "worker", "index": 0}}, True),
                 ({"cluster": workers, "task": {"type": "worker", "index": 1}}, False),
                 ({"cluster": dict(workers, chief=["127.0.0.1:3"]),
                   "task": {"type": "worker", "index": 0}}, False)]
        for config, chief in cases:
            env = {"TF_CONFIG": json.dumps(config)} if config else {}
            with mock.patch.dict(os.environ, env, clear=False):
                if not config:
                    os.environ.pop("TF_CONFIG", None)
                self.assertEqual(distribute.is_chief_process(), chief, config)

    def test_unknown_strategy_and_ragged_replicas(self):
        from tfdp import distribute

        with self.assertRaisesRegex(ValueError, "strategy"):
            distribute.get_strategy("horovod")

        class FourReplicas:
            num_replicas_in_sync = 4

        with self.assertRaisesRegex(ValueError, "multiple of the number of replicas"):
            distribute.distribute_train_pipeline(FourReplicas(), None, 10)


# ---------------------------------------------------------------------------
# Two workers over loopback.
# ---------------------------------------------------------------------------


def _free_ports(n):
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _checkpoint_tensors(directory):
    """{name: array}: weights, optimizer state and ledger of the latest checkpoint."""
    path = tf.train.latest_checkpoint(directory)
    reader = tf.train.load_checkpoint(path)
    return {
        name: reader.get_tensor(name)
        for name in reader.get_variable_to_shape_map()
        if name.endswith("VARIABLE_VALUE")
    }


class MultiWorkerTest(tf.test.TestCase):

    def _launch(self, workdir, worker_ckpts, ports, index, log_dir):
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        env = _env()
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        env["TFDP_WORKER_CHECKPOINT_DIR"] = worker_ckpts
        cmd = [
            sys.executable, "-m", "tfdp.train", "--strategy=multi_worker_mirrored",
            f"--workdir={workdir}", "--seed=1",
            "--gin_param=DataConfig.dataset = 'digits'",
            "--gin_param=OptimizationConfig.epochs = 0.2",
            "--gin_param=OptimizationConfig.logical_batch_size = 128",
            "--gin_param=RunConfig.physical_batch_size = 32",
            "--gin_param=PrivacyConfig.noise_multiplier = 1.0",
            "--gin_param=PrivacyConfig.target_epsilon = None",
            "--gin_param=RunConfig.log_every_steps = 1",
            "--gin_param=RunConfig.train_eval_examples = 200",
            "--gin_param=RunConfig.export_model = False",
        ]
        out = open(os.path.join(log_dir, f"worker{index}.log"), "w")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        return proc, out

    @pytest.mark.slow
    def test_two_workers_train_identically_and_only_the_chief_checkpoints(self):
        workdir = self.create_tempdir().full_path
        worker_ckpts = self.create_tempdir().full_path
        log_dir = self.create_tempdir().full_path
        ports = _free_ports(2)
        procs = [self._launch(workdir, worker_ckpts, ports, i, log_dir) for i in range(2)]
        deadline = time.time() + WORKER_TIMEOUT_S
        try:
            for proc, _ in procs:
                try:
                    proc.wait(timeout=max(1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            for proc, out in procs:  # Bounded in time: kill what is left.
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                out.close()
        logs = []
        for i in range(2):
            with open(os.path.join(log_dir, f"worker{i}.log")) as f:
                logs.append(f.read())
        for i, (proc, _) in enumerate(procs):
            self.assertEqual(proc.returncode, 0, f"worker {i}:\n{logs[i][-4000:]}")
        finals = [re.findall(r"^final: .* steps=(\d+)$", log, re.M) for log in logs]
        self.assertEqual([len(f) for f in finals], [1, 1])
        steps = int(finals[0][0])
        self.assertGreater(steps, 0)
        self.assertEqual(int(finals[1][0]), steps)
        self.assertIn("DP plan", logs[0])
        # Exactly one checkpoint, with its ledger, in the chief's workdir.
        ckpt_dir = os.path.join(workdir, "checkpoints")
        self.assertLen(tf.io.gfile.glob(os.path.join(ckpt_dir, "*.index")), 1)
        with open(os.path.join(ckpt_dir, "privacy_ledger.json")) as f:
            self.assertEqual(json.load(f)["steps"], steps)
        # Worker 1 joined the save into its own directory (kept here by
        # TFDP_WORKER_CHECKPOINT_DIR): both workers hold identical weights,
        # bit for bit, after noisy steps.
        self.assertEqual(os.listdir(worker_ckpts), ["worker1"])
        chief, other = _checkpoint_tensors(ckpt_dir), _checkpoint_tensors(
            os.path.join(worker_ckpts, "worker1"))
        self.assertGreater(len([k for k in chief if "trainable_variables" in k]), 4)
        self.assertEqual(int(chief["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]), steps)
        self.assertEqual(sorted(chief), sorted(other))
        # Both hold the run's secret key, and it is the same key: the workers
        # agreed on the chief's, so they drew the same noise and batches.
        self.assertIn("secret_key/.ATTRIBUTES/VARIABLE_VALUE", chief)
        for name in chief:
            self.assertAllEqual(chief[name], other[name], msg=name)
        # And training moved them: not the initial weights.
        self.assertIn(f"step {steps}/", logs[0])


if __name__ == "__main__":
    tf.test.main()
