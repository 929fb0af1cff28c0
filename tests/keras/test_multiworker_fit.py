"""`fit` of a private model under MultiWorkerMirroredStrategy: one key, one sample, one noise.

The workers of one job must train with the chief's key
(`tfdp.distribute.agreed_key`): with keys of their own they take their shares
of different Poisson samples (an example twice in one step, on two workers)
and each adds `noise / R` of its own draw (the noise std σ·C/√W).

- Fast, in the default suite: the agreement rule itself (a variable creator
  stands in for the chief's broadcast), and that the Keras optimizer (its
  sampling and noise key, for a request and for a given `DPSGD`) and the
  trainer both take their key from it.
- Slow (two worker processes on 127.0.0.1 with `TF_CONFIG`, one CPU device
  each, running `tests/keras/multiworker_worker.py`; about a minute or more
  on two cores): for `tfdp.DPOptimizer` and for TF-Privacy's
  `DPKerasSGDOptimizer` (`tfdp.compat.tensorflow_privacy`), (a) with one
  insecure public key, the one-process weights, rows and ε; (b) with a fresh
  secret key per process and zero gradients, an update of std σ·C/B per step
  (noise drawn once); (c) no example twice in a logical step, and each
  worker's share of one sample; (d) the same ε printed by both workers. The
  seeded runs also validate (`fit(validation_data=...)`) with the workers'
  mean (`tfdp.keras.train_function.WorkerMeanTestFunction`), which Keras 3's
  own test function cannot compute there (tensorflow#72388).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import distribute
from tfdp import secret_key as secret_key_lib
from tfdp.training import run_contract

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "keras", "multiworker_worker.py")
WORKER_TIMEOUT_S = 500
CHIEF = secret_key_lib.SecretKey([11, -22])


# ---------------------------------------------------------------------------
# Fast: the agreement rule, and both routes call it.
# ---------------------------------------------------------------------------


def _as_if_chief_sent(words, insecure, monkeypatch):
    """Two workers, and a creator that starts every variable from the chief's value.

    A variable created in a multi-worker strategy's scope starts from the
    chief's value (a broadcast); in one process a variable creator plays it.
    """
    monkeypatch.setattr(distribute, "num_workers", lambda strategy: 2)

    def creator(next_creator, **kwargs):
        kwargs["initial_value"] = np.append(np.asarray(words, np.int64), int(insecure))
        return next_creator(**kwargs)

    return tf.variable_creator_scope(creator)


def test_agreed_key_is_the_chiefs(monkeypatch):
    mine = secret_key_lib.SecretKey.generate()
    with _as_if_chief_sent(CHIEF.words, False, monkeypatch):
        agreed = distribute.agreed_key(tf.distribute.get_strategy(), mine)
    assert agreed == CHIEF and agreed != mine
    assert agreed.is_secret


def test_agreed_key_on_one_worker_is_the_key_itself():
    mine = secret_key_lib.SecretKey.generate()
    assert distribute.agreed_key(tf.distribute.get_strategy(), mine) is mine


def test_workers_started_unalike_are_refused(monkeypatch):
    with pytest.warns(UserWarning):
        seeded = secret_key_lib.SecretKey.insecure_from_seed(3)
        other_seed = secret_key_lib.SecretKey.insecure_from_seed(4)
    strategy = tf.distribute.get_strategy()
    # Another insecure seed on the chief: this worker's would be mislabelled.
    with _as_if_chief_sent(other_seed.words, True, monkeypatch):
        with pytest.raises(ValueError, match="same insecure_reproducible_seed.*Received"):
            distribute.agreed_key(strategy, seeded)
    # A public key on the chief, a secret one here: no epsilon would hold.
    with _as_if_chief_sent(other_seed.words, True, monkeypatch):
        with pytest.raises(ValueError, match="a secret key, on the chief an insecure seed's key"):
            distribute.agreed_key(strategy, secret_key_lib.SecretKey.generate())
    # The same seed everywhere agrees.
    with _as_if_chief_sent(seeded.words, True, monkeypatch):
        assert distribute.agreed_key(strategy, seeded).insecure_seed == 3


@pytest.fixture
def chief_key(monkeypatch):
    """`tfdp.distribute.agreed_key` answering with the chief's key `CHIEF`."""
    asked = []

    def agreed_key(strategy, key):
        asked.append(key)
        return CHIEF

    monkeypatch.setattr(distribute, "agreed_key", agreed_key)
    return asked


def test_dp_optimizer_samples_and_noises_with_the_agreed_key(chief_key):
    optimizer = tfdp.DPOptimizer("sgd", l2_norm_clip=1.0, noise_multiplier=1.0)
    assert len(chief_key) == 1 and chief_key[0] != CHIEF
    np.testing.assert_array_equal(optimizer.sampling_key, CHIEF.derive("sampling"))
    optimizer.mechanism_builder.route_fit(arrays=True, dataset_size=64, physical_batch_size=16)
    assert optimizer.mechanism.secret_key == CHIEF  # The noise's key.


def test_dp_optimizer_given_a_mechanism_takes_the_agreed_key(chief_key):
    sampler = tfdp.samplers.make_sampler("poisson", dataset_size=64, logical_batch_size=16)
    mechanism = tfdp.DPSGD(1.0, 1.0, sampler=sampler, delta=1e-5)
    optimizer = tfdp.DPOptimizer("sgd", mechanism=mechanism)
    assert chief_key == [mechanism.secret_key]
    assert optimizer.mechanism.secret_key == CHIEF
    np.testing.assert_array_equal(optimizer.sampling_key, CHIEF.derive("sampling"))


def test_trainer_asks_the_same_rule(chief_key):
    assert run_contract.requested_key(tf.distribute.get_strategy(), None) == CHIEF
    assert len(chief_key) == 1


# ---------------------------------------------------------------------------
# Slow: two workers on localhost.
# ---------------------------------------------------------------------------

ROUTES = ("native", "compat")


def _free_ports(n):
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _launch(out_dir, scenarios, log_path, tf_config=None):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
               CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    os.makedirs(out_dir, exist_ok=True)
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, WORKER, out_dir, ",".join(scenarios)], cwd=REPO,
                            env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, log, log_path


def _wait(launched):
    """Waits for every process (bounded in time), kills what is left, returns the logs."""
    deadline = time.time() + WORKER_TIMEOUT_S
    try:
        for proc, _, _ in launched:
            try:
                proc.wait(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc, log, _ in launched:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
    logs = []
    for proc, _, path in launched:
        with open(path) as f:
            text = f.read()
        assert proc.returncode == 0, f"{path} (rc {proc.returncode}):\n{text[-4000:]}"
        logs.append(text)
    return logs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(who, scenario): results} of both workers ("w0", "w1") and one process ("one")."""
    root = str(tmp_path_factory.mktemp("multiworker"))
    scenarios = [f"{route}_{key}" for route in ROUTES for key in ("seeded", "secret")]
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    launched = [
        _launch(os.path.join(root, f"w{i}"), scenarios, os.path.join(root, f"w{i}.log"),
                {"cluster": cluster, "task": {"type": "worker", "index": i}})
        for i in range(2)]
    launched.append(_launch(os.path.join(root, "one"), [s for s in scenarios if "seeded" in s],
                            os.path.join(root, "one.log")))
    logs = _wait(launched)
    out = {"logs": dict(zip(("w0", "w1", "one"), logs))}
    for who in ("w0", "w1", "one"):
        for scenario in scenarios:
            path = os.path.join(root, who, f"{scenario}.npz")
            if os.path.exists(path):
                with np.load(path) as f:
                    out[(who, scenario)] = {k: f[k] for k in f.files}
    return out


def _rows(result):
    return {int(step): rows for step, rows in json.loads(str(result["rows"])).items()}


def _weights(result, which):
    return [result[k] for k in sorted(k for k in result if k.startswith(which))]


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
class TestTwoWorkers:
    def test_seeded_run_equals_one_process(self, runs, route):
        one, w0, w1 = (runs[(who, f"{route}_seeded")] for who in ("one", "w0", "w1"))
        assert int(w0["replicas"]) == int(w1["replicas"]) == 2
        assert int(one["replicas"]) == 1
        assert int(one["steps"]) > 0
        assert int(one["steps"]) == int(w0["steps"]) == int(w1["steps"])
        for a, b, c in zip(_weights(one, "after"), _weights(w0, "after"), _weights(w1, "after")):
            np.testing.assert_array_equal(b, c)  # The workers apply one update.
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        moved = max(np.abs(a - b).max() for a, b in zip(_weights(one, "after"),
                                                        _weights(one, "before")))
        assert moved > 1e-2  # Trained, so the equality says something.
        # The validation loss, averaged over the workers' shards
        # (`train_function.WorkerMeanTestFunction`), is the one-process loss.
        assert one["val_loss"].size == 1
        np.testing.assert_allclose(w0["val_loss"], one["val_loss"], rtol=1e-5)
        np.testing.assert_allclose(w1["val_loss"], one["val_loss"], rtol=1e-5)
        # Each step's rows: the one-process step's, split between the workers.
        rows, rows0, rows1 = _rows(one), _rows(w0), _rows(w1)
        assert sorted(rows) == sorted(rows0) == sorted(rows1)
        for step in rows:
            assert sorted(rows[step]) == sorted(rows0[step] + rows1[step]), step

    def test_noise_is_drawn_once(self, runs, route):
        w0, w1 = (runs[(who, f"{route}_secret")] for who in ("w0", "w1"))
        for a, b in zip(_weights(w0, "after"), _weights(w1, "after")):
            np.testing.assert_array_equal(a, b)
        # Zero gradients, learning rate 1: each step moves the weights by
        # noise / B, of std σC/B if drawn once, σC/(B√2) if each worker drew
        # its own.
        update = np.concatenate([(a - b).ravel() for a, b in zip(
            _weights(w0, "after"), _weights(w0, "before"))])
        assert update.size >= 10000
        steps, batch = int(w0["steps"]), float(w0["batch_size"])
        measured = update.std() * batch / (float(w0["clip"]) * np.sqrt(steps))
        assert abs(measured / float(w0["sigma"]) - 1) < 0.03, (measured, float(w0["sigma"]))

    def test_no_example_twice_in_a_step(self, runs, route):
        w0, w1 = (runs[(who, f"{route}_secret")] for who in ("w0", "w1"))
        rows0, rows1 = _rows(w0), _rows(w1)
        assert sorted(rows0) == sorted(rows1) == list(range(int(w0["steps"])))
        for step in rows0:
            rows = rows0[step] + rows1[step]
            assert len(rows) == len(set(rows)), (step, sorted(rows))
            # Unit i of one sample goes to worker i mod 2.
            assert len(rows0[step]) - len(rows1[step]) in (0, 1), step

    def test_same_epsilon_printed(self, runs, route):
        for key in ("seeded", "secret"):
            scenario = f"{route}_{key}"
            printed = [[line for line in runs["logs"][who].splitlines()
                        if line.startswith(f"{scenario}: epsilon=")] for who in ("w0", "w1")]
            assert len(printed[0]) == 1 and printed[0] == printed[1], printed
        seeded = [str(runs[(who, f"{route}_seeded")]["epsilon"]) for who in ("one", "w0", "w1")]
        assert seeded[0] == seeded[1] == seeded[2]
