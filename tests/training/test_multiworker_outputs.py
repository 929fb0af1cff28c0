"""What the workers of a multi-worker trainer run write, and how a lost one is reported.

The unit tests drive `tfdp.training.workers` with a cluster resolver of two
workers. The process tests run two `python -m tfdp.train` workers over
127.0.0.1 (MultiWorkerMirroredStrategy), each with a fresh TMPDIR of its own,
and look at what is left once they end: after a whole run, and after the
non-chief worker is killed mid-run and the same commands are rerun.
"""

import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
import tensorflow as tf

from tfdp import distribute
from tfdp.training import workers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_TIMEOUT_S = 240

# The two texts TensorFlow 2.21 gave the chief when the other worker was
# killed: an eager collective aborted by the health check, and a
# tf.function's collective that lost its gRPC peer.
HEALTH_CHECK_TEXT = (
    "{{function_node __wrapped__CollectiveReduceV2_Nordering_token_1_device_/job:worker/"
    "replica:0/task:0/device:CPU:0}} Collective ops is aborted by: Error reported from "
    "/job:worker/task:1: The following tasks are unhealthy (stopped sending heartbeats):\n"
    "/job:worker/replica:0/task:1\nThe tasks have crashed. Check the task logs for an earlier "
    "error, or scheduler events (e.g. preemption, eviction) to debug further.\nThe error "
    "could be from a previous operation. Restart your program to reset. "
    "[Op:CollectiveReduceV2] name: ")
GRAPH_TEXT = (
    "Graph execution error:\n\nDetected at node CollectiveReduceV2 defined at (most recent "
    "call last):\n  File \"<frozen runpy>\", line 198, in _run_module_as_main\n\nCollective "
    "ops is aborted by: recvmsg:Connection reset by peer\nAdditional GRPC error information "
    "from remote target /job:worker/replica:0/task:1 while calling "
    "/tensorflow.WorkerService/RecvBuf:\n:UNKNOWN:Error received from peer\n\t "
    "[[{{node CollectiveReduceV2}}]] [Op:__inference_apply_123]")


def _strategy(task_id, num_workers=2):
    """A stand-in of a MultiWorkerMirroredStrategy: what `tfdp.distribute` reads of one."""
    cluster = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{1000 + i}"
                                               for i in range(num_workers)]})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster, task_type="worker", task_id=task_id)
    return types.SimpleNamespace(cluster_resolver=resolver)


@pytest.fixture
def two_workers(monkeypatch, tmp_path):
    """Two workers, this process's scratch under a fresh temp dir; returns that dir."""
    monkeypatch.setattr(distribute, "num_workers", lambda strategy: 2)
    monkeypatch.delenv(workers.KEEP_CHECKPOINTS_ENV, raising=False)
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(temp))
    return temp


# ---------------------------------------------------------------------------
# The lost-worker message.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", [HEALTH_CHECK_TEXT, GRAPH_TEXT])
def test_a_lost_worker_is_named_in_one_line_with_the_resume(text):
    message = workers.lost_worker_message(tf.errors.UnavailableError(None, None, text),
                                          "/runs/r18/")
    assert "\n" not in message
    assert message.startswith("worker 1 of this multi-worker run stopped")
    assert "UnavailableError: Collective ops is aborted by: " in message
    assert message.endswith("Rerun the same command on every worker to resume from the last "
                            "checkpoint in /runs/r18/checkpoints.")
    assert "{{" not in message and "Graph execution error" not in message


def test_a_deadline_without_a_task_says_a_worker_was_lost():
    message = workers.lost_worker_message(
        tf.errors.DeadlineExceededError(None, None, "Deadline Exceeded"), "w")
    assert message.startswith("a worker of this multi-worker run stopped or became unreachable "
                              "(DeadlineExceededError: Deadline Exceeded).")


def test_other_errors_are_not_a_lost_worker():
    assert workers.lost_worker_message(
        tf.errors.InvalidArgumentError(None, None, "Incompatible shapes"), "w") is None
    assert workers.lost_worker_message(ValueError("Collective ops is aborted"), "w") is None


# ---------------------------------------------------------------------------
# worker_run: where each worker writes, cleanup, the lost-worker error.
# ---------------------------------------------------------------------------


def test_the_chief_writes_into_the_workdir_and_has_no_scratch(two_workers, tmp_path):
    workdir = str(tmp_path / "run")
    with workers.worker_run(_strategy(0), workdir) as worker:
        assert worker == workers.WorkerOutputs(
            chief=True, out_dir=workdir, checkpoint_dir=os.path.join(workdir, "checkpoints"))
    assert os.listdir(two_workers) == []


def test_a_non_chief_writes_no_outputs_and_its_scratch_goes_at_its_end(two_workers, tmp_path):
    workdir = str(tmp_path / "run")
    with workers.worker_run(_strategy(1), workdir) as worker:
        assert not worker.chief and worker.out_dir is None
        assert os.path.dirname(worker.checkpoint_dir) == str(two_workers)
        assert os.path.basename(worker.checkpoint_dir).startswith("tfdp_worker1_ckpt_")
        assert oct(os.stat(worker.checkpoint_dir).st_mode & 0o777) == "0o700"
        open(os.path.join(worker.checkpoint_dir, "ckpt-1.index"), "w").close()
    assert os.listdir(two_workers) == []
    assert not os.path.exists(workdir)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), ValueError("bad"),
                                   tf.errors.UnavailableError(None, None, GRAPH_TEXT)])
def test_a_non_chief_scratch_goes_when_the_run_fails(two_workers, tmp_path, error):
    with pytest.raises((KeyboardInterrupt, ValueError, workers.LostWorkerError)):
        with workers.worker_run(_strategy(1), str(tmp_path / "run")) as worker:
            assert os.path.isdir(worker.checkpoint_dir)
            raise error
    assert os.listdir(two_workers) == []


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers are set from the main thread only")
def test_sigterm_interrupts_the_run_and_removes_the_scratch(two_workers, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with workers.worker_run(_strategy(1), str(tmp_path / "run")):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # The handler runs at once, in this thread.
    assert os.listdir(two_workers) == []
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_rerun_removes_what_a_killed_worker_left(two_workers, tmp_path):
    workdir = str(tmp_path / "run")
    leftover = workers.scratch_dir(workdir, "worker", 1)
    os.makedirs(os.path.join(leftover, "ckpt-4_temp"))
    with workers.worker_run(_strategy(1), workdir) as worker:
        assert worker.checkpoint_dir == leftover
        assert os.listdir(leftover) == []
    assert os.listdir(two_workers) == []


def test_a_collective_failure_becomes_a_lost_worker_error(two_workers, tmp_path):
    with pytest.raises(workers.LostWorkerError, match=r"^worker 1 of this multi-worker run "
                       r"stopped .* Rerun the same command on every worker"):
        with workers.worker_run(_strategy(0), str(tmp_path / "run")):
            raise tf.errors.UnavailableError(None, None, HEALTH_CHECK_TEXT)


def test_on_one_worker_the_error_is_left_alone(monkeypatch, tmp_path):
    monkeypatch.setattr(distribute, "num_workers", lambda strategy: 1)
    with pytest.raises(tf.errors.UnavailableError):
        with workers.worker_run(_strategy(0, num_workers=1), str(tmp_path / "run")):
            raise tf.errors.UnavailableError(None, None, "GCS unavailable")


# ---------------------------------------------------------------------------
# Two trainer processes.
# ---------------------------------------------------------------------------


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class _Cluster:
    """Two `python -m tfdp.train` workers on 127.0.0.1, each with its own fresh TMPDIR."""

    def __init__(self, root, epochs):
        self.root = root
        self.workdir = os.path.join(root, "workdir")
        self.temps = [os.path.join(root, f"tmp{i}") for i in range(2)]
        for temp in self.temps:
            os.makedirs(temp)
        self.epochs = epochs
        self.runs = 0

    def start(self):
        """Starts both workers (fresh ports); returns their processes and log paths."""
        ports = _free_ports(2)
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        self.runs += 1
        procs = []
        for i in range(2):
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
                       TMPDIR=self.temps[i], PYTHONPATH=REPO + os.pathsep
                       + os.environ.get("PYTHONPATH", ""),
                       TF_CONFIG=json.dumps({"cluster": cluster,
                                             "task": {"type": "worker", "index": i}}))
            env.pop(workers.KEEP_CHECKPOINTS_ENV, None)
            log = os.path.join(self.root, f"run{self.runs}_worker{i}.log")
            cmd = [sys.executable, "-m", "tfdp.train", "--strategy=multi_worker_mirrored",
                   f"--workdir={self.workdir}", "--seed=1",
                   "--gin_param=DataConfig.dataset = 'digits'",
                   f"--gin_param=OptimizationConfig.epochs = {self.epochs}",
                   "--gin_param=OptimizationConfig.logical_batch_size = 128",
                   "--gin_param=RunConfig.physical_batch_size = 32",
                   "--gin_param=PrivacyConfig.noise_multiplier = 1.0",
                   "--gin_param=PrivacyConfig.target_epsilon = None",
                   "--gin_param=RunConfig.log_every_steps = 1",
                   "--gin_param=RunConfig.checkpoint_every_steps = 2",
                   "--gin_param=RunConfig.train_eval_examples = 100"]
            with open(log, "w") as out:
                procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out,
                                               stderr=subprocess.STDOUT,
                                               start_new_session=True), log))
        return procs

    @staticmethod
    def wait(procs):
        """Waits (bounded) for both; kills what is left; returns (return codes, logs)."""
        deadline = time.time() + RUN_TIMEOUT_S
        for proc, _ in procs:
            try:
                proc.wait(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        for proc, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        logs = []
        for _, log in procs:
            with open(log) as f:
                logs.append(f.read())
        return [proc.returncode for proc, _ in procs], logs


def _assert_only_the_chief_wrote(cluster, chief_pids):
    for i, temp in enumerate(cluster.temps):
        assert os.listdir(temp) == [], f"worker {i} left {os.listdir(temp)} in its TMPDIR"
    names = set(os.listdir(cluster.workdir))
    assert {"summary.json", "report.html", "model.keras", "saved_model", "config.gin",
            "operative_config.gin", "clipping_plan.txt", "tensorboard",
            "checkpoints"} <= names
    # TensorBoard names each events file after its writer's process: the chief's alone.
    events = glob.glob(os.path.join(cluster.workdir, "tensorboard", "events.out.tfevents.*"))
    pids = {int(re.search(r"\.(\d+)\.\d+\.v2$", path).group(1)) for path in events}
    assert pids and pids <= set(chief_pids), (pids, chief_pids)


@pytest.mark.slow  # 15-30 s of two processes; the fast tests above check the rules.
def test_two_workers_leave_only_the_chiefs_outputs(tmp_path):
    cluster = _Cluster(str(tmp_path), epochs=0.2)
    procs = cluster.start()
    codes, logs = cluster.wait(procs)
    assert codes == [0, 0], logs
    assert "final: " in logs[1]
    assert "tfdp_worker" not in logs[1] and cluster.temps[1] not in logs[1]
    _assert_only_the_chief_wrote(cluster, [procs[0][0].pid])


@pytest.mark.slow  # Two runs, one killed: about 70 s on 2 loaded cores.
def test_a_killed_worker_is_reported_in_one_line_and_the_rerun_resumes(tmp_path):
    cluster = _Cluster(str(tmp_path), epochs=3)
    procs = cluster.start()
    (chief, chief_log), (other, other_log) = procs
    deadline = time.time() + RUN_TIMEOUT_S
    while time.time() < deadline and other.poll() is None:
        with open(other_log) as f:
            if re.search(r"^  step 4/", f.read(), re.M):
                break
        time.sleep(0.2)
    os.killpg(other.pid, signal.SIGKILL)
    codes, logs = cluster.wait(procs)
    assert codes[0] == workers.LOST_WORKER_EXIT_CODE, logs[0][-3000:]
    assert "Traceback" not in logs[0]
    last = logs[0].strip().splitlines()[-1]
    assert re.fullmatch(r"error: worker 1 of this multi-worker run stopped or became "
                        r"unreachable \(\w+Error: .*\)\. Rerun the same command on every "
                        r"worker to resume from the last checkpoint in "
                        + re.escape(os.path.join(cluster.workdir, "checkpoints")) + r"\.",
                        last), last
    # SIGKILL left worker 1 no chance to remove its scratch; the rerun does.
    assert [name.startswith("tfdp_worker1_ckpt_") for name in os.listdir(cluster.temps[1])
            ] == [True]

    procs = cluster.start()
    codes, logs = cluster.wait(procs)
    assert codes == [0, 0], logs
    for log in logs:
        assert re.search(r"^resumed from .*ckpt-\d+ at step [1-9]\d*$", log, re.M), log
    with open(os.path.join(cluster.workdir, "summary.json")) as f:
        steps = json.load(f)["steps"]
    assert f"steps={steps}" in logs[0] and f"steps={steps}" in logs[1]
    _assert_only_the_chief_wrote(cluster, [chief.pid, procs[0][0].pid])
