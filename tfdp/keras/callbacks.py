"""Keras callbacks for private models: epsilon in the logs, and a budget.

Both read the run's ledger from the `DPOptimizer` (`optimizer.ledger()`):
the mechanism's sampler and the step count `iterations` (noisy updates),
which checkpoints carry, so a run resumed by `keras.callbacks.BackupAndRestore`
or from a `ModelCheckpoint` reports and enforces the epsilon of all the steps
taken, not just this `fit` call's. A streamed (tf.data) input is accounted at
least one pass per epoch that released a step.
"""

import os

import keras
import tensorflow as tf

from tfdp.keras.dp_optimizer import DPOptimizer


def _dp_optimizer(model):
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, DPOptimizer):
        raise ValueError(
            "Privacy callbacks need a private model compiled with a "
            "tfdp.DPOptimizer (see tfdp.make_private). "
            f"Received: optimizer={optimizer!r}"
        )
    return optimizer


class _LedgerCallback(keras.callbacks.Callback):
    def __init__(self, delta=None, dataset_size=None):
        super().__init__()
        self.delta = delta
        self.dataset_size = dataset_size
        self._cache = (None, None)
        self._replace_one_cache = (None, None)

    def _ledger(self, steps=None):
        return _dp_optimizer(self.model).ledger(
            dataset_size=self.dataset_size, delta=self.delta, steps=steps
        )

    def _ready(self):
        return _dp_optimizer(self.model).logical_batch_size is not None

    def _steps(self):
        """The steps the ledger composes (see `DPOptimizer.accounted_steps`)."""
        return self._ledger().steps

    def epsilon(self):
        """Epsilon after the noisy updates taken so far (cached per step)."""
        ledger = self._ledger()
        if self._cache[0] != ledger.steps:
            self._cache = (ledger.steps, ledger.epsilon())
        return self._cache[1]

    def epsilon_replace_one(self):
        """The replace-one epsilon so far, or None (`PrivacyLedger.epsilon_replace_one`)."""
        ledger = self._ledger()
        if self._replace_one_cache[0] != ledger.steps:
            self._replace_one_cache = (ledger.steps, ledger.epsilon_replace_one())
        return self._replace_one_cache[1]


class PrivacyLogger(_LedgerCallback):
    """Puts epsilon (of all noisy updates so far) and delta into the Keras logs.

    They then show in the progress bar and in `History`, and in TensorBoard
    when a `keras.callbacks.TensorBoard` comes *after* it in the callbacks
    list, or when `log_dir` is given (then `epoch_epsilon` is also written to
    `log_dir/train`, next to TensorBoard's own training scalars, with the
    neighbouring relation as text).

    The relation the epsilon holds for is the sampler's
    (`PrivacyLedger.adjacency`): add-or-remove-one for Poisson batches,
    zero-out for shuffled, fixed-order or streamed ones. It is printed when
    training starts; for the zero-out routes the replace-one epsilon is
    logged as well, under `<key>_replace_one`.

    Args:
        delta: float or None. Overrides the DPOptimizer's delta.
        dataset_size: int or None. Overrides the DPOptimizer's (or the
            inferred) dataset size N.
        log_dir: str or None. TensorBoard log directory. Defaults to `None`.
        update_freq: `"batch"`, `"epoch"` or an int n (every n batches):
            how often batch logs get epsilon. Epoch logs always do.
            Defaults to `"batch"`.
        key: str. The logs key. Defaults to `"epsilon"`.
    """

    def __init__(self, delta=None, dataset_size=None, log_dir=None,
                 update_freq="batch", key="epsilon"):
        super().__init__(delta=delta, dataset_size=dataset_size)
        if update_freq not in ("batch", "epoch") and not (
            isinstance(update_freq, int) and update_freq >= 1
        ):
            raise ValueError(
                "update_freq must be 'batch', 'epoch' or an int >= 1. "
                f"Received: update_freq={update_freq!r}"
            )
        self.log_dir = log_dir
        self.update_freq = update_freq
        self.key = key
        self.history = []  # (epoch, steps, epsilon) at each epoch end.
        self._writer = None

    def on_train_begin(self, logs=None):
        _dp_optimizer(self.model)
        if self._ready():
            ledger = self._ledger()  # Fails early on a missing dataset size.
            print(f"PrivacyLogger: {ledger.describe_epsilon(self.epsilon())}")
        if self.log_dir and self._writer is None:
            self._writer = tf.summary.create_file_writer(
                os.path.join(self.log_dir, "train")
            )

    def _put(self, logs):
        """Adds epsilon, delta and (zero-out routes) the replace-one epsilon."""
        ledger = self._ledger()
        logs[self.key] = self.epsilon()
        logs["delta"] = ledger.delta
        replace_one = self.epsilon_replace_one()
        if replace_one is not None:
            logs[f"{self.key}_replace_one"] = replace_one

    def on_train_batch_end(self, batch, logs=None):
        if logs is None or self.update_freq == "epoch":
            return
        if isinstance(self.update_freq, int) and (batch + 1) % self.update_freq:
            return
        if self._ready():
            self._put(logs)

    def on_epoch_end(self, epoch, logs=None):
        eps = self.epsilon()
        self.history.append((epoch, self._steps(), eps))
        if logs is not None:
            self._put(logs)
        if self._writer is not None:
            ledger = self._ledger()
            replace_one = self.epsilon_replace_one()
            with self._writer.as_default():
                tf.summary.scalar(f"epoch_{self.key}", eps, step=epoch)
                tf.summary.text(f"epoch_{self.key}_adjacency",
                                ledger.describe_epsilon(eps), step=epoch)
                if replace_one is not None:
                    tf.summary.scalar(f"epoch_{self.key}_replace_one", replace_one, step=epoch)
            self._writer.flush()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class PrivacyBudget(_LedgerCallback):
    """Stops training before a noisy update would exceed `target_epsilon`.

    At the start of `fit` it computes the largest total number of noisy
    updates within the budget (`PrivacyLedger.max_steps_within`). Training
    stops (`model.stop_training`) at the end of the batch that takes the last
    allowed update, and the DPOptimizer itself refuses updates beyond it (a
    guard in the train step), so the budget holds at batch granularity even
    with `steps_per_execution > 1` or on a resumed run that already spent it.

    Args:
        target_epsilon: float. The budget.
        delta: float or None. Overrides the DPOptimizer's delta.
        dataset_size: int or None. Overrides the DPOptimizer's (or the
            inferred) dataset size N.
        verbose: int. 1 prints a line when the budget stops training.
            Defaults to `1`.
    """

    def __init__(self, target_epsilon, delta=None, dataset_size=None, verbose=1):
        super().__init__(delta=delta, dataset_size=dataset_size)
        if not target_epsilon >= 0:
            raise ValueError(
                f"target_epsilon must be >= 0. Received: target_epsilon={target_epsilon}"
            )
        self.target_epsilon = float(target_epsilon)
        self.verbose = verbose
        self.max_steps = None
        self.stopped_at_step = None

    def on_train_begin(self, logs=None):
        optimizer = _dp_optimizer(self.model)
        if not self._ready():
            raise ValueError(
                "PrivacyBudget needs the logical batch size before training: "
                "pass `expected_batch_size=` to the DPOptimizer, `batch_size=` "
                "to fit, or a dataset with a static batch dimension."
            )
        ledger = self._ledger()
        self.max_steps = ledger.max_steps_within(self.target_epsilon)
        self.stopped_at_step = None
        self._pass_steps = _dp_optimizer(self.model)._accounting_mechanism(
            self.dataset_size, self.delta).sampler.steps_per_epoch
        optimizer.set_budget(self.max_steps, self._pass_steps)
        self._check()

    def on_train_batch_end(self, batch, logs=None):
        self._check()

    def on_epoch_end(self, epoch, logs=None):
        # A streamed input accounts a whole pass per epoch that releases a
        # step: stop when the next one would not fit.
        optimizer = _dp_optimizer(self.model)
        if optimizer.counts_passes:
            passes = int(optimizer.passes.numpy())
            self._check(extra=(passes + 1) * int(self._pass_steps) > self.max_steps)

    def _check(self, extra=False):
        steps = self._steps()
        if (steps >= self.max_steps or extra) and not self.model.stop_training:
            self.model.stop_training = True
            self.stopped_at_step = steps
            if self.verbose:
                print(
                    f"\nPrivacyBudget: stopping after {steps} noisy updates; "
                    f"one more would exceed epsilon={self.target_epsilon:g}."
                )

    def on_train_end(self, logs=None):
        _dp_optimizer(self.model).set_budget(-1)
