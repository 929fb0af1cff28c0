"""`ReleaseGuard`: what every private `fit` keeps around its releases, whatever the callbacks.

- The contract's budget: where the mechanism has a target ε, no step beyond
  `tfdp.DPSGD.budget_steps` of what the route accounts (Poisson steps,
  shuffled passes, a stream's whole passes; `tfdp.keras.fit_ledger`) is
  released: the account refuses it in the train step, and `fit` stops at
  the budget, saying once (a warning) that the budget cut its planned steps.
- Finite parameters: after each release, `fit` stops with the engine's
  `FloatingPointError` (`tfdp.dp.release_checks.check_parameters_are_finite`)
  before any later callback writes anything.
- Dropped examples: the privacy units the clipping dropped for a NaN/Inf
  gradient are counted (`PrivacyAccount.nonfinite_examples`) and reported at
  the end of `fit`, a figure not covered by ε.
"""

import warnings

import keras

from tfdp.dp import release_checks
from tfdp.keras import fit_ledger

_KEPT = ("fit stopped before any later callback ran (no checkpoint or log of this "
         "state was written by it); restore the last good weights from your own "
         "checkpoint, if any")


class ReleaseGuard(keras.callbacks.Callback):
    """The callback `DPModel.fit` puts before the user's (see the module docstring).

    Make it with `for_fit`.

    Args:
        max_steps: int or None. The accounted steps the contract's target ε
            allows in all (None: no target).
        pass_steps: int. Logical steps per pass of a stream (N // B), else 0.
        target_epsilon: float or None. The contract's target ε, for messages.
    """

    def __init__(self, max_steps=None, pass_steps=0, target_epsilon=None):
        super().__init__()
        self.max_steps = max_steps
        self.pass_steps = int(pass_steps or 0)
        self.target_epsilon = target_epsilon
        self.stopped_at_step = None
        self.nonfinite_examples = 0
        self._checked = None
        self._nonfinite_at_start = 0

    @classmethod
    def for_fit(cls, optimizer, planned_steps, epochs):
        """The guard of one `fit` call, after its route (eager).

        Args:
            optimizer: `tfdp.DPOptimizer`, routed (`route_fit`).
            planned_steps: int or None. Logical steps per epoch (arrays), or
                None for a stream (whose epochs are whole passes).
            epochs: int. The epochs this call runs.

        Returns:
            A `ReleaseGuard`. Where the target ε cuts the planned steps it
            warns once, naming both counts.

        Raises:
            ValueError: for a target ε on a stream of unknown N.
        """
        target = fit_ledger.target_epsilon(optimizer)
        if target is None:
            return cls()
        pass_steps = 0
        if optimizer.counts_passes:
            pass_steps = int(fit_ledger.accounting_mechanism(
                optimizer.mechanism_builder).sampler.steps_per_epoch)
            planned_steps = pass_steps
        done = optimizer.accounted_steps(pass_steps or None)
        planned = done + int(planned_steps) * max(int(epochs), 0)
        max_steps = fit_ledger.budget_steps(optimizer, planned)
        if max_steps < planned:
            now = "" if done == 0 else f" ({done} taken before this fit)"
            # The ε printed with its δ and the relation it holds for.
            budget = fit_ledger.ledger(optimizer, steps=0)
            warnings.warn(
                f"The privacy budget target_epsilon={target:g} allows {max_steps} "
                f"accounted steps in all, and this fit plans {planned}{now}: it "
                f"releases {max(max_steps - done, 0)} and stops at the budget, so "
                f"epsilon stays <= {target:g} at delta={budget.delta:g} "
                f"({budget.adjacency} adjacency). To train longer, raise the noise "
                "multiplier or the target.",
                UserWarning, stacklevel=3)
        return cls(max_steps, pass_steps, target)

    def spent(self, optimizer):
        """Whether `optimizer`'s accounted steps already reach the budget (eager).

        Then `fit` runs no step: Keras would run one batch even when told to
        stop before it.
        """
        if self.max_steps is None:
            return False
        if self.pass_steps:  # A stream: the next pass is accounted whole.
            return (int(optimizer.passes.numpy()) + 1) * self.pass_steps > self.max_steps
        return optimizer.accounted_steps() >= self.max_steps

    def _accounted(self):
        return self.model.dp_optimizer.accounted_steps(self.pass_steps or None)

    def on_train_begin(self, logs=None):
        optimizer = self.model.dp_optimizer
        # The account refuses, inside the train step, any release beyond it.
        optimizer.account.set_budget(-1 if self.max_steps is None else self.max_steps,
                                     self.pass_steps, source="contract")
        self._checked = int(optimizer.iterations.numpy())
        self._nonfinite_at_start = optimizer.account.nonfinite_examples
        self.stopped_at_step = None
        self._stop_if_spent()

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.dp_optimizer
        step = int(optimizer.iterations.numpy())
        if step != self._checked:  # A release: check it before anything is written.
            self._checked = step
            release_checks.check_parameters_are_finite(
                self.model.model.trainable_variables, step, _KEPT)
        self._stop_if_spent()

    def on_epoch_end(self, epoch, logs=None):
        # A stream accounts a whole pass per epoch that releases: stop when
        # the next pass would not fit.
        if self.pass_steps and self.spent(self.model.dp_optimizer):
            self._stop(self._accounted())

    def on_train_end(self, logs=None):
        optimizer = self.model.dp_optimizer
        optimizer.account.set_budget(-1, source="contract")
        self.nonfinite_examples = optimizer.account.nonfinite_examples - self._nonfinite_at_start
        if self.nonfinite_examples:
            warnings.warn(
                f"{self.nonfinite_examples} examples (privacy units) had a NaN/Inf "
                "gradient in this fit and were dropped by the clipping: they contributed "
                "nothing, so epsilon still holds, but this count is not covered by "
                "epsilon. Check the inputs for NaN/Inf, or lower the learning rate.",
                UserWarning, stacklevel=2)

    def _stop_if_spent(self):
        # A stream's steps within a pass already accounted are free: it
        # stops at an epoch's end (`on_epoch_end`).
        if not self.pass_steps and self.spent(self.model.dp_optimizer):
            self._stop(self._accounted())

    def _stop(self, steps):
        if not self.model.stop_training:
            self.model.stop_training = True
            self.stopped_at_step = steps


def empty_history(model):
    """The `History` of a `fit` that ran no step (its budget was already spent)."""
    history = keras.callbacks.History()
    history.set_model(model)
    history.on_train_begin()
    return history
