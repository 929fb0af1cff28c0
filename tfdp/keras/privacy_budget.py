"""`PrivacyBudget`: stops training before a noisy update would exceed a target epsilon."""

from tfdp.keras import ledger_callback


class PrivacyBudget(ledger_callback.LedgerCallback):
    """Stops training before a noisy update would exceed `target_epsilon`.

    At the start of `fit` it computes the largest total number of noisy
    updates within the budget (`PrivacyLedger.max_steps_within`). Training
    stops (`model.stop_training`) at the end of the batch that takes the last
    allowed update, and the DPOptimizer itself refuses updates beyond it (a
    guard in the train step), so the budget holds at batch granularity even
    with `steps_per_execution > 1` or on a resumed run that already spent it.
    The budget is for the run's privacy unit (one example, or one user's
    data under `privacy_unit="user"`).

    Args:
        target_epsilon: float. The budget.
        delta: float or None. Overrides the DPOptimizer's delta.
        dataset_size: int or None. Overrides the DPOptimizer's (or the
            inferred) dataset size N, in privacy units.
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
        self._pass_steps = None

    def on_train_begin(self, logs=None):
        optimizer = self.dp_optimizer
        if not self.ready():
            raise ValueError(
                "PrivacyBudget needs the logical batch size before training: "
                "pass `expected_batch_size=` to the DPOptimizer, `batch_size=` "
                "to fit, or a dataset with a static batch dimension."
            )
        ledger = self.ledger()
        self.max_steps = ledger.max_steps_within(self.target_epsilon)
        self.stopped_at_step = None
        self._pass_steps = optimizer.accounting_mechanism(
            self.dataset_size, self.delta).sampler.steps_per_epoch
        optimizer.set_budget(self.max_steps, self._pass_steps)
        self._check()

    def on_train_batch_end(self, batch, logs=None):
        self._check()

    def on_epoch_end(self, epoch, logs=None):
        # A streamed input accounts a whole pass per epoch that releases a
        # step: stop when the next one would not fit.
        optimizer = self.dp_optimizer
        if optimizer.counts_passes:
            passes = int(optimizer.passes.numpy())
            self._check(extra=(passes + 1) * int(self._pass_steps) > self.max_steps)

    def _check(self, extra=False):
        steps = self.accounted_steps()
        if (steps >= self.max_steps or extra) and not self.model.stop_training:
            self.model.stop_training = True
            self.stopped_at_step = steps
            if self.verbose:
                unit = self.dp_optimizer.privacy_unit
                per = "" if unit == "example" else f" ({unit}-level)"
                print(
                    f"\nPrivacyBudget: stopping after {steps} noisy updates; "
                    f"one more would exceed epsilon={self.target_epsilon:g}{per}."
                )

    def on_train_end(self, logs=None):
        self.dp_optimizer.set_budget(-1)
