"""Checkpoints that carry the privacy ledger and the run's secret key.

The ledger's JSON lives in a string variable of the same `tf.train.Checkpoint`
as the weights and optimizer, so the two can never disagree: a checkpoint is
either written whole (TF writes the data files, then atomically replaces the
`checkpoint` index) or not at all. A human-readable copy is written beside it.

The secret key (`tfdp.secret_key.SecretKey`) of the noise and the sampling is
stored in the checkpoint too, and nowhere else: a checkpoint is as private as
the training data. A resumed run reads it back with `read_latest` before it
builds its train step, and so continues the same noise and batch streams.

The noise state of a banded matrix-factorization run (the last noise
tensors, `tfdp.dp.PrivateTrainStep.noise_state`) is as secret as the key and
is stored beside it, in the checkpoint only, so a resumed run continues the
same correlated noise.

A non-private run records `{"private": false}` in place of a ledger, so that
a private run never continues it unnoticed (and the other way round).
"""

import json
import os

import numpy as np
import tensorflow as tf

from tfdp import secret_key as secret_key_lib

NON_PRIVATE_RECORD = {"private": False}
_LEDGER = "ledger/.ATTRIBUTES/VARIABLE_VALUE"
_KEY = "secret_key/.ATTRIBUTES/VARIABLE_VALUE"
_INSECURE_SEED = "insecure_seed/.ATTRIBUTES/VARIABLE_VALUE"


def _atomic_write(path, text):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_latest(directory):
    """The privacy record and secret key of the latest checkpoint, if any.

    Reads two variables of the checkpoint without building or restoring
    anything, so a run can check it and take its key before it builds the
    train step.

    Args:
        directory: str. A `RunCheckpoint` directory.

    Returns:
        None if there is no checkpoint; else a tuple `(path, record, key)`:
        the checkpoint path, its ledger dict (`{"private": False}` for a
        non-private run, `{}` when it holds none) and its `SecretKey`
        (None when it holds none).
    """
    path = tf.train.latest_checkpoint(directory) if os.path.isdir(directory) else None
    if not path:
        return None
    names = {name for name, _ in tf.train.list_variables(path)}
    text = tf.train.load_variable(path, _LEDGER).decode() if _LEDGER in names else ""
    record = json.loads(text) if text else {}
    key = None
    if _KEY in names:
        seed_text = tf.train.load_variable(path, _INSECURE_SEED).decode()
        key = secret_key_lib.SecretKey(
            tf.train.load_variable(path, _KEY),
            insecure_seed=int(seed_text) if seed_text else None,
        )
    return path, record, key


class RunCheckpoint:
    """Model, optimizer, privacy ledger and secret key, saved and restored together.

    Args:
        directory: str. Where checkpoints go.
        model: keras.Model.
        optimizer: keras.optimizers.Optimizer.
        max_to_keep: int. Checkpoints kept. Defaults to 3.
        ema: optional `tfdp.optim.ParameterEMA`, saved too. Defaults to None.
        secret_key: optional `SecretKey` of the run's noise and sampling,
            saved too. Defaults to None.
        noise_state: optional list of variables: the train step's
            correlated-noise state (`PrivateTrainStep.noise_state`), saved
            too. Defaults to None.
    """

    def __init__(self, directory, model, optimizer, max_to_keep=3, ema=None, secret_key=None,
                 noise_state=None):
        self.directory = directory
        self.ledger_json = tf.Variable("", dtype=tf.string, trainable=False)
        extra = {"ema": ema} if ema is not None else {}
        if noise_state:
            extra["noise_state"] = list(noise_state)
        if secret_key is not None:
            extra["secret_key"] = tf.Variable(
                np.asarray(secret_key.words), dtype=tf.int64, trainable=False
            )
            seed = secret_key.insecure_seed
            extra["insecure_seed"] = tf.Variable(
                "" if seed is None else str(seed), dtype=tf.string, trainable=False
            )
        self.checkpoint = tf.train.Checkpoint(
            model=model, optimizer=optimizer, ledger=self.ledger_json, **extra
        )
        self.manager = tf.train.CheckpointManager(self.checkpoint, directory, max_to_keep)

    @property
    def latest(self):
        return self.manager.latest_checkpoint

    def restore(self, path=None):
        """Restores a checkpoint; returns its ledger dict or None.

        The key is not restored here: the step was built with it already
        (see `read_latest`).

        Args:
            path: str or None. The checkpoint, e.g. the one `read_latest`
                checked. Defaults to None: the latest.
        """
        path = path or self.latest
        if not path:
            return None
        self.checkpoint.restore(path).expect_partial()
        text = self.ledger_json.numpy().decode()
        record = json.loads(text) if text else None
        return None if record == NON_PRIVATE_RECORD else record

    def save(self, step, ledger=None):
        """Saves at `step` (the number of optimizer updates applied).

        Args:
            step: int.
            ledger: `PrivacyLedger` of a private run; None for a non-private
                run, which is recorded as such.
        """
        text = ledger.to_json() if ledger is not None else json.dumps(NON_PRIVATE_RECORD)
        self.ledger_json.assign(text)
        path = self.manager.save(checkpoint_number=step)
        _atomic_write(os.path.join(self.directory, "privacy_ledger.json"), text)
        return path
