"""SIGKILL a real training process at several points; the resumed run must
count exactly the steps and ε of an uninterrupted one."""

import pytest
import json
import os
import re
import signal
import subprocess
import sys
import time

import tensorflow as tf

from tests.test_train import FINAL

ARGS = [
    "--gin_param=DataConfig.dataset = 'digits'",
    "--gin_param=OptimizationConfig.epochs = 3",
    "--gin_param=OptimizationConfig.logical_batch_size = 128",
    "--gin_param=RunConfig.physical_batch_size = 64",
    "--gin_param=RunConfig.log_every_steps = 1",
    "--gin_param=RunConfig.checkpoint_every_steps = 3",
    "--gin_param=RunConfig.export_model = False",
    # The reference run in another workdir must draw the same noise and batches.
    "--gin_param=PrivacyConfig.insecure_reproducible_seed = 0",
]
STEP_LINE = re.compile(r"^  step (\d+)/")


def _command(workdir):
    return [sys.executable, "-u", "-m", "tfdp.train", *ARGS, f"--workdir={workdir}"]


def _env():
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")


def _run_and_kill_after_step(workdir, kill_step, timeout=300):
    """Runs training; SIGKILLs it once it prints `step kill_step`. True if killed."""
    proc = subprocess.Popen(_command(workdir), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=_env())
    deadline = time.time() + timeout
    try:
        for line in proc.stdout:
            match = STEP_LINE.match(line)
            if match and int(match.group(1)) >= kill_step:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return True
            if time.time() > deadline:
                break
        proc.wait(timeout=60)
        return False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _run_to_end(workdir):
    result = subprocess.run(_command(workdir), capture_output=True, text=True, env=_env(),
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


class ResumeAfterKillTest(tf.test.TestCase):

    @pytest.mark.slow
    def test_killed_and_resumed_run_matches_uninterrupted_run(self):
        reference_dir = self.create_tempdir().full_path
        reference = FINAL.search(_run_to_end(reference_dir))

        workdir = self.create_tempdir().full_path
        killed = [_run_and_kill_after_step(workdir, k) for k in (2, 7, 16)]
        self.assertTrue(all(killed))
        resumed_out = _run_to_end(workdir)
        self.assertIn("resumed from", resumed_out)
        resumed = FINAL.search(resumed_out)

        self.assertEqual(resumed["steps"], reference["steps"])
        self.assertEqual(resumed["eps"], reference["eps"])
        with open(os.path.join(workdir, "checkpoints", "privacy_ledger.json")) as f:
            ledger = json.load(f)
        self.assertEqual(ledger["steps"], int(reference["steps"]))
        # Batches and noise are pure functions of (key, step), so the resumed
        # run retraces the uninterrupted one.
        self.assertAllClose(float(resumed["acc"]), float(reference["acc"]), atol=0.02)


if __name__ == "__main__":
    tf.test.main()
