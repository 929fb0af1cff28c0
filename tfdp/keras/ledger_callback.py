"""`LedgerCallback`: the base of the privacy callbacks, which read the run's ledger.

The ledger comes from the `DPOptimizer` (`optimizer.ledger()`): the
mechanism's sampler and the step count `iterations` (noisy updates), which
checkpoints carry, so a run resumed by `keras.callbacks.BackupAndRestore` or
from a `ModelCheckpoint` reports and enforces the epsilon of all the steps
taken, not just this `fit` call's. A streamed (tf.data) input is accounted at
least one pass per epoch that released a step.
"""

import keras

from tfdp.keras.dp_optimizer import DPOptimizer


def dp_optimizer_of(model):
    """The `DPOptimizer` a model is compiled with; a clear error for any other."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, DPOptimizer):
        raise ValueError(
            "Privacy callbacks need a private model compiled with a "
            "tfdp.DPOptimizer (see tfdp.make_private). "
            f"Received: optimizer={optimizer!r}"
        )
    return optimizer


class LedgerCallback(keras.callbacks.Callback):
    """A Keras callback that reads the private model's ledger (epsilon cached per step).

    Args:
        delta: float or None. Overrides the DPOptimizer's delta.
        dataset_size: int or None. Overrides the DPOptimizer's (or the
            inferred) dataset size N, in privacy units.
    """

    def __init__(self, delta=None, dataset_size=None):
        super().__init__()
        self.delta = delta
        self.dataset_size = dataset_size
        self._cache = (None, None)
        self._replace_one_cache = (None, None)

    @property
    def dp_optimizer(self):
        """The model's `DPOptimizer`."""
        return dp_optimizer_of(self.model)

    def ledger(self, steps=None):
        """The run's `PrivacyLedger`, with this callback's overrides."""
        return self.dp_optimizer.ledger(
            dataset_size=self.dataset_size, delta=self.delta, steps=steps
        )

    def ready(self):
        """Whether the logical batch size is known (a ledger can be made)."""
        return self.dp_optimizer.logical_batch_size is not None

    def accounted_steps(self):
        """The steps the ledger composes (see `DPOptimizer.accounted_steps`)."""
        return self.ledger().steps

    def epsilon(self):
        """Epsilon after the noisy updates taken so far (cached per step)."""
        ledger = self.ledger()
        if self._cache[0] != ledger.steps:
            self._cache = (ledger.steps, ledger.epsilon())
        return self._cache[1]

    def epsilon_replace_one(self):
        """The replace-one epsilon so far, or None (`PrivacyLedger.epsilon_replace_one`)."""
        ledger = self.ledger()
        if self._replace_one_cache[0] != ledger.steps:
            self._replace_one_cache = (ledger.steps, ledger.epsilon_replace_one())
        return self._replace_one_cache[1]
