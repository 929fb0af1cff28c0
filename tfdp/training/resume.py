"""Resuming a run: the checkpoint's privacy record and key, checked first."""

import tensorflow as tf

from tfdp import checkpointing
from tfdp.secret_key import SecretKey


def fresh_start_hint(workdir):
    """The one fix for a refused checkpoint."""
    return (f"To start afresh, use a new --workdir or delete "
            f"{workdir.rstrip('/')}/checkpoints.")


def check_resume(previous, mechanism, workdir):
    """Refuses a checkpoint written under another privacy configuration.

    Args:
        previous: `checkpointing.read_latest` output (not None).
        mechanism: this run's `tfdp.DPSGD` (with the key it asks for: a fresh
            secret one or an insecure seed's), or None for a non-private run.
        workdir: str. For the message.

    Raises:
        ValueError: one line naming the difference and the fix.
    """
    path, record, saved_key = previous
    saved_private = record != checkpointing.NON_PRIVATE_RECORD
    fix = fresh_start_hint(workdir)
    if mechanism is None and saved_private:
        raise ValueError(
            f"The checkpoint {path} was written by a private run, and this run is "
            f"non-private: it would continue a model whose epsilon it cannot report. {fix}"
        )
    if mechanism is None:
        return
    if not saved_private or not record:
        raise ValueError(
            f"The checkpoint {path} was written by a non-private run (no privacy "
            "ledger): continuing it privately would report an epsilon for a model that "
            f"was not trained privately. {fix}"
        )
    try:
        mechanism.check_checkpoint(record, saved_key, path)
    except ValueError as e:
        raise ValueError(f"{e} {fix}") from None


def agreed_key(strategy, key):
    """The chief's key, on every worker.

    A variable created in a multi-worker strategy's scope starts from the
    chief's value, so every host draws the same noise and batches.
    """
    with strategy.scope():
        agreed = tf.Variable(key.words, dtype=tf.int64, trainable=False)
    return SecretKey(agreed.numpy(), insecure_seed=key.insecure_seed)
