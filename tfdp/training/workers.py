"""What each worker of a run writes, and how a lost worker is reported.

The chief (`tfdp.distribute.is_chief`) writes the run's files into its
workdir. Every other worker of a multi-worker run writes only its copy of
each checkpoint, which MultiWorkerMirroredStrategy needs it to save, into a
scratch directory of its own that `worker_run` removes when the worker ends;
its summary, report, model and TensorBoard events would hold the same private
figures as the chief's, unreviewed and never cleaned up, so it writes none.

A worker that stops (killed, preempted, unreachable) fails the others'
collective ops; `worker_run` turns that TensorFlow error into a
`LostWorkerError`, one line saying that rerunning the same command resumes
from the last checkpoint.
"""

import contextlib
import dataclasses
import hashlib
import os
import re
import shutil
import signal
import stat
import tempfile
import threading

import tensorflow as tf

from tfdp import distribute

# Debugging and tests: a non-chief worker keeps its checkpoints in
# `$TFDP_WORKER_CHECKPOINT_DIR/<task_type><task_id>` (to compare them with
# the chief's) instead of a scratch directory removed at its end.
KEEP_CHECKPOINTS_ENV = "TFDP_WORKER_CHECKPOINT_DIR"

# EX_TEMPFAIL: the run can be retried as it is (schedulers may rerun on it).
LOST_WORKER_EXIT_CODE = 75

# The errors a collective op raises when a peer stops: the health check
# aborts the collectives (Unavailable), a timeout expires (DeadlineExceeded),
# or the collective is aborted or cancelled after another op failed.
LOST_WORKER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                      tf.errors.AbortedError, tf.errors.CancelledError)
# Other error classes (e.g. InternalError) that say the same in their text.
_LOST_WORKER_TEXT = re.compile(
    r"Collective ops is aborted|stopped sending heartbeats|unhealthy|Socket closed|"
    r"Connection reset|failed to connect", re.I)
_TASK = re.compile(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)")
# Where TF's text names the lost tasks: the health check's list, or the
# peer a gRPC call failed on.
_LOST_TASKS = re.compile(r"unhealthy[^:]*:\s*((?:/job:\w+/replica:\d+/task:\d+\s*)+)|"
                         r"from remote target (/job:\w+/replica:\d+/task:\d+)", re.I)


class LostWorkerError(RuntimeError):
    """A worker of a multi-worker run stopped; the message is one line saying so."""


@dataclasses.dataclass(frozen=True)
class WorkerOutputs:
    """Where this process of a run writes.

    Args:
        chief: bool. Whether this process writes the run's files.
        out_dir: str or None. The workdir on the chief: its logs, configs,
            summary, report and model; None on another worker, which writes
            none of them.
        checkpoint_dir: str. Where this process saves its checkpoints: the
            workdir's `checkpoints/` on the chief, else its scratch.
    """

    chief: bool
    out_dir: object
    checkpoint_dir: str


def scratch_dir(workdir, task_type, task_id):
    """The scratch directory of a non-chief worker's checkpoints for `workdir`.

    The name is fixed by the workdir and the task, so that a rerun (the
    resume) finds and removes what a worker killed outright (SIGKILL, no
    chance to clean up) left behind.

    Args:
        workdir: str. The run's workdir.
        task_type: str. E.g. "worker".
        task_id: int.

    Returns:
        `<temp dir>/tfdp_<task_type><task_id>_ckpt_<hash of the workdir>`.
    """
    digest = hashlib.sha256(os.path.abspath(workdir).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"tfdp_{task_type}{task_id}_ckpt_{digest}")


def _claim_scratch(path):
    """Creates `path` afresh (mode 0700), removing this user's leftover of a killed run.

    Raises:
        ValueError: `path` exists and is not this user's directory.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise ValueError(
                f"The worker's checkpoint scratch {path} exists and is not this user's "
                "directory: remove it, or set TMPDIR to a directory of your own.")
        shutil.rmtree(path)
    os.mkdir(path, 0o700)


def lost_worker_message(error, workdir):
    """The one line reporting `error` as a lost worker; None if it is not one.

    Args:
        error: the exception a multi-worker run raised.
        workdir: str. The run's workdir, for the checkpoints it resumes from.

    Returns:
        str or None.
    """
    if not isinstance(error, tf.errors.OpError):
        return None
    text = error.message or str(error)
    if not (isinstance(error, LOST_WORKER_ERRORS) or _LOST_WORKER_TEXT.search(text)):
        return None
    named = " ".join(" ".join(match) for match in _LOST_TASKS.findall(text))
    tasks = sorted({(job, int(i)) for job, i in _TASK.findall(named)})
    if tasks:
        who = " and ".join(f"{job} {i}" for job, i in tasks)
        what = f"{who} of this multi-worker run stopped or became unreachable"
    else:
        what = "a worker of this multi-worker run stopped or became unreachable"
    reason = _reason(text)
    checkpoints = os.path.join(workdir.rstrip("/"), "checkpoints")
    return (f"{what} ({type(error).__name__}: {reason}). Rerun the same command on every "
            f"worker to resume from the last checkpoint in {checkpoints}.")


def _reason(text, width=160):
    """The line of TensorFlow's error text that says what the collective saw.

    The text of an eager op starts with `{{function_node ...}}`; a
    tf.function's starts with "Graph execution error:" and the stack of the
    node, the cause further down.
    """
    lines = [re.sub(r"\{\{[^}]*\}\}|\[\[.*?\]\]|\[Op:[^\]]*\]( name: \S*)?", "", line).strip()
             for line in text.splitlines()]
    lines = [line for line in lines if line]
    said = [line for line in lines if _LOST_WORKER_TEXT.search(line)]
    plain = [line for line in lines if not re.match(
        r"(Graph execution error|Detected at node|File |\^|Additional GRPC)", line)]
    reason = (said or plain or lines or ["no message"])[0].rstrip(" :")
    return reason[:width].rstrip() + ("..." if len(reason) > width else "")


def _interrupt(signum, frame):
    """SIGTERM's handler in `worker_run`: ends the block as Ctrl-C does."""
    del signum, frame
    raise KeyboardInterrupt


@contextlib.contextmanager
def worker_run(strategy, workdir):
    """Yields this process's `WorkerOutputs`; cleans up and reports a lost worker at its end.

    A non-chief worker's scratch is removed when the block ends, normally or
    by an exception. SIGTERM (a preemption) raises KeyboardInterrupt in the
    block, as Ctrl-C does: MultiWorkerMirroredStrategy's coordination service
    takes SIGTERM over when it starts, and a worker would otherwise run on,
    until SIGKILL, with no chance to clean up. A lost-worker error of a run
    of several workers is raised as `LostWorkerError`.

    Args:
        strategy: `tf.distribute.Strategy` of the run.
        workdir: str. The run's workdir.

    Raises:
        LostWorkerError: a worker stopped during the block.
        ValueError: the scratch directory is taken (`_claim_scratch`).
    """
    chief = distribute.is_chief(strategy)
    checkpoints = os.path.join(workdir, "checkpoints")
    scratch = None
    if chief:
        outputs = WorkerOutputs(chief=True, out_dir=workdir, checkpoint_dir=checkpoints)
    else:
        task_type, task_id = distribute.task(strategy)
        keep = os.environ.get(KEEP_CHECKPOINTS_ENV)
        if keep:
            directory = os.path.join(keep, f"{task_type}{task_id}")
        else:
            scratch = directory = scratch_dir(workdir, task_type, task_id)
            _claim_scratch(scratch)
        outputs = WorkerOutputs(chief=False, out_dir=None, checkpoint_dir=directory)
    # Signal handlers can only be set from the main thread.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        yield outputs
    except tf.errors.OpError as e:
        message = lost_worker_message(e, workdir) if distribute.num_workers(strategy) > 1 else None
        if message is None:
            raise
        raise LostWorkerError(message) from e  # The cause: for --traceback.
    finally:
        if main_thread:  # None: a handler set outside Python, not restorable.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
