"""Checkpoints that carry the privacy ledger.

The ledger's JSON lives in a string variable of the same `tf.train.Checkpoint`
as the weights and optimizer, so the two can never disagree: a checkpoint is
either written whole (TF writes the data files, then atomically replaces the
`checkpoint` index) or not at all. A human-readable copy is written beside it.
"""

import json
import os

import tensorflow as tf


def _atomic_write(path, text):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunCheckpoint:
    """Model, optimizer and privacy ledger, saved and restored together.

    Args:
        directory: str. Where checkpoints go.
        model: keras.Model.
        optimizer: keras.optimizers.Optimizer.
        max_to_keep: int. Checkpoints kept. Defaults to 3.
        ema: optional `tfdp.optim.ParameterEMA`, saved too. Defaults to None.
    """

    def __init__(self, directory, model, optimizer, max_to_keep=3, ema=None):
        self.directory = directory
        self.ledger_json = tf.Variable("", dtype=tf.string, trainable=False)
        extra = {"ema": ema} if ema is not None else {}
        self.checkpoint = tf.train.Checkpoint(
            model=model, optimizer=optimizer, ledger=self.ledger_json, **extra
        )
        self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep)

    @property
    def latest(self):
        return self.manager.latest_checkpoint

    def restore(self):
        """Restores the latest checkpoint; returns its ledger dict or None."""
        if not self.latest:
            return None
        self.checkpoint.restore(self.latest).expect_partial()
        text = self.ledger_json.numpy().decode()
        return json.loads(text) if text else None

    def save(self, step, ledger=None):
        """Saves at `step` (the number of optimizer updates applied)."""
        if ledger is not None:
            self.ledger_json.assign(ledger.to_json())
        path = self.manager.save(checkpoint_number=step)
        if ledger is not None:
            _atomic_write(os.path.join(self.directory, "privacy_ledger.json"), ledger.to_json())
        return path
