"""Resuming a run: the checkpoint's privacy record and key, checked first; then the state."""

import dataclasses
import os

from tfdp import checkpointing
from tfdp import distribute
from tfdp import privacy
from tfdp.training import reporting


def fresh_start_hint(workdir):
    """The one fix for a refused checkpoint."""
    return (f"To start afresh, use a new --workdir or delete "
            f"{workdir.rstrip('/')}/checkpoints.")


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The latest checkpoint of a workdir, as `checkpointing.read_latest` reads it.

    Args:
        path: str. The checkpoint.
        record: dict. Its privacy ledger (`checkpointing.NON_PRIVATE_RECORD`
            for a non-private run, `{}` when it holds none).
        key: `SecretKey` or None. Its key of the noise and the batches.
    """

    path: str
    record: dict
    key: object

    @property
    def private(self):
        return self.record != checkpointing.NON_PRIVATE_RECORD


def check_resume(resume_point, mechanism, workdir):
    """Refuses a checkpoint written under another privacy configuration.

    Args:
        resume_point: `ResumePoint`.
        mechanism: this run's `tfdp.DPSGD` (with the key it asks for: a fresh
            secret one or an insecure seed's), or None for a non-private run.
        workdir: str. For the message.

    Raises:
        ValueError: one line naming the difference and the fix.
    """
    path, record = resume_point.path, resume_point.record
    fix = fresh_start_hint(workdir)
    if mechanism is None and resume_point.private:
        raise ValueError(
            f"The checkpoint {path} was written by a private run, and this run is "
            f"non-private: it would continue a model whose epsilon it cannot report. {fix}"
        )
    if mechanism is None:
        return
    if not resume_point.private or not record:
        raise ValueError(
            f"The checkpoint {path} was written by a non-private run (no privacy "
            "ledger): continuing it privately would report an epsilon for a model that "
            f"was not trained privately. {fix}"
        )
    try:
        mechanism.check_checkpoint(record, resume_point.key, path)
    except ValueError as e:
        raise ValueError(f"{e} {fix}") from None


def read_resume_point(workdir, mechanism):
    """The workdir's latest `ResumePoint`, checked against `mechanism`; None if none."""
    latest = checkpointing.read_latest(os.path.join(workdir, "checkpoints"))
    if latest is None:
        return None
    resume_point = ResumePoint(*latest)
    check_resume(resume_point, mechanism, workdir)
    return resume_point


@dataclasses.dataclass
class RunState:
    """Where training starts: the checkpoint it saves into, the step and the ledger.

    Args:
        checkpoint: `checkpointing.RunCheckpoint` this process saves into.
        start_step: int. Logical steps already taken.
        ledger: `tfdp.privacy.PrivacyLedger` or None (non-private).
    """

    checkpoint: object
    start_step: int
    ledger: object


def restore_run(workdir, strategy, model, optimizer, ema, contract, noise_state=None,
                save_dir=None):
    """The `RunState`: restored from `contract.resume_point`, or fresh.

    The privacy record comes from the resume point, which was checked against
    the contract before the train step was built; the checkpoint's weights,
    optimizer, EMA and correlated-noise state (`noise_state`, the train
    step's, for a banded strategy) are restored here, from the same
    checkpoint.

    Args:
        workdir: str. Every worker restores from its `checkpoints/`.
        strategy: `tf.distribute.Strategy` of the run.
        model: keras.Model.
        optimizer: keras.optimizers.Optimizer.
        ema: `tfdp.optim.ParameterEMA` or None.
        contract: `tfdp.training.run_contract.RunContract`. Its resume point and ledger.
        noise_state: list of variables or None. The train step's
            correlated-noise state. Defaults to None.
        save_dir: str or None. Where a non-chief worker saves: its scratch
            (`tfdp.training.workers.WorkerOutputs.checkpoint_dir`); required
            there. The chief saves into the workdir's `checkpoints/`.
            Defaults to None.

    Returns:
        `RunState`.

    Raises:
        ValueError: the checkpoint's ledger and optimizer disagree on the step,
            or a non-chief worker was given no scratch `save_dir`.
    """
    directory = os.path.join(workdir, "checkpoints")
    ckpt = checkpointing.RunCheckpoint(directory, model, optimizer, ema=ema,
                                       secret_key=contract.key, noise_state=noise_state)
    if contract.resume_point is not None:
        ckpt.restore(contract.resume_point.path)
    if not distribute.is_chief(strategy):
        # Every worker restores from the chief's checkpoints; only the chief
        # writes them and the ledger. The others join each save (as
        # MultiWorkerMirroredStrategy requires) into their own scratch.
        if save_dir is None or save_dir == directory:
            raise ValueError(
                "A non-chief worker must save into its own scratch directory, not the "
                f"chief's {directory}: pass save_dir (tfdp.training.workers.worker_run's "
                "checkpoint_dir).")
        ckpt = checkpointing.RunCheckpoint(
            save_dir, model, optimizer, ema=ema, secret_key=contract.key, noise_state=noise_state)
    start_step = int(optimizer.iterations.numpy())
    ledger = contract.ledger
    if contract.resume_point is not None and ledger is not None:
        ledger = privacy.PrivacyLedger.from_dict(contract.resume_point.record)
        if ledger.steps != start_step:
            raise ValueError(
                f"Ledger steps ({ledger.steps}) != optimizer steps ({start_step}) in "
                f"{contract.resume_point.path}; refusing to resume with an inconsistent privacy "
                "count.")
    if start_step:
        reporting.log(f"resumed from {contract.resume_point.path} at step {start_step}")
    return RunState(checkpoint=ckpt, start_step=start_step, ledger=ledger)
