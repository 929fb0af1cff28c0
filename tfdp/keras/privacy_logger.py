"""`PrivacyLogger`: epsilon, delta and the privacy unit in a private model's logs."""

import os

import tensorflow as tf

from tfdp.keras import ledger_callback


class PrivacyLogger(ledger_callback.LedgerCallback):
    """Puts epsilon (of all noisy updates so far) and delta into the Keras logs.

    They then show in the progress bar and in `History`, and in TensorBoard
    when a `keras.callbacks.TensorBoard` comes *after* it in the callbacks
    list, or when `log_dir` is given (then `epoch_<key>` is also written to
    `log_dir/train`, next to TensorBoard's own training scalars, with the
    neighbouring relation as text).

    The relation the epsilon holds for is the sampler's
    (`PrivacyLedger.adjacency`): add-or-remove-one for Poisson batches,
    zero-out for shuffled, fixed-order or streamed ones, add-or-remove-one
    user for `privacy_unit="user"`. It is printed when training starts; for
    the zero-out routes the replace-one epsilon is logged as well, under
    `<key>_replace_one`. Under a privacy unit other than the example, the
    keys name it: `user_epsilon` and `user_delta`.

    Args:
        delta: float or None. Overrides the DPOptimizer's delta.
        dataset_size: int or None. Overrides the DPOptimizer's (or the
            inferred) dataset size N, in privacy units.
        log_dir: str or None. TensorBoard log directory. Defaults to `None`.
        update_freq: `"batch"`, `"epoch"` or an int n (every n batches):
            how often batch logs get epsilon. Epoch logs always do.
            Defaults to `"batch"`.
        key: str or None. The logs key of epsilon. Defaults to `None`:
            `"epsilon"` for example-level privacy, `"user_epsilon"` for
            user-level privacy.
    """

    def __init__(self, delta=None, dataset_size=None, log_dir=None,
                 update_freq="batch", key=None):
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
        self._key = key
        self.history = []  # (epoch, steps, epsilon) at each epoch end.
        self._writer = None

    @property
    def key(self):
        """The logs key of epsilon: the one given, else named with the privacy unit."""
        if self._key is not None:
            return self._key
        return f"{self._unit_prefix()}epsilon"

    @key.setter
    def key(self, key):
        self._key = key

    @property
    def delta_key(self):
        """The logs key of delta, named with the privacy unit (`user_delta`)."""
        return f"{self._unit_prefix()}delta"

    def _unit_prefix(self):
        model = getattr(self, "model", None)
        unit = "example" if model is None else self.dp_optimizer.privacy_unit
        return "" if unit == "example" else f"{unit}_"

    def on_train_begin(self, logs=None):
        optimizer = self.dp_optimizer
        if self.ready():
            # Fails early on a missing dataset size.
            line = optimizer.describe_epsilon(dataset_size=self.dataset_size, delta=self.delta,
                                              epsilon=self.epsilon())
            print(f"PrivacyLogger: {line}")
        if self.log_dir and self._writer is None:
            self._writer = tf.summary.create_file_writer(
                os.path.join(self.log_dir, "train")
            )

    def _put(self, logs):
        """Adds epsilon, delta and (zero-out routes) the replace-one epsilon."""
        ledger = self.ledger()
        logs[self.key] = self.epsilon()
        logs[self.delta_key] = ledger.delta
        replace_one = self.epsilon_replace_one()
        if replace_one is not None:
            logs[f"{self.key}_replace_one"] = replace_one

    def on_train_batch_end(self, batch, logs=None):
        if logs is None or self.update_freq == "epoch":
            return
        if isinstance(self.update_freq, int) and (batch + 1) % self.update_freq:
            return
        if self.ready():
            self._put(logs)

    def on_epoch_end(self, epoch, logs=None):
        eps = self.epsilon()
        self.history.append((epoch, self.accounted_steps(), eps))
        if logs is not None:
            self._put(logs)
        if self._writer is not None:
            replace_one = self.epsilon_replace_one()
            line = self.dp_optimizer.describe_epsilon(
                dataset_size=self.dataset_size, delta=self.delta, epsilon=eps)
            with self._writer.as_default():
                tf.summary.scalar(f"epoch_{self.key}", eps, step=epoch)
                tf.summary.text(f"epoch_{self.key}_adjacency", line, step=epoch)
                if replace_one is not None:
                    tf.summary.scalar(f"epoch_{self.key}_replace_one", replace_one, step=epoch)
            self._writer.flush()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
