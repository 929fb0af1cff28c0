"""Choosing hyperparameters on private validation data (`python -m tfdp.tuning`).

- `select_privately`: a private selection, accounted: the best of a secret,
  random number of trainer runs (`TrialCount`), released alone, with the
  ε of `dp_accounting.RepeatAndSelectDpEvent` (Papernot & Steinke 2022);
  `release` writes what it releases with fixed times, so that nothing in it
  tells K.
- `read_summaries`, `select_by_validation`, `selection_guarantee`,
  `report`: choosing among existing runs, NOT accounted, and said so.

docs/PRIVACY.md ("Choosing hyperparameters privately") says what each covers.
"""

from tfdp.tuning.existing_runs import SelectionGuarantee
from tfdp.tuning.existing_runs import read_summaries
from tfdp.tuning.existing_runs import report
from tfdp.tuning.existing_runs import select_by_validation
from tfdp.tuning.existing_runs import selection_guarantee
from tfdp.tuning.existing_runs import validation_accuracy
from tfdp.tuning.private_selection import check_grid
from tfdp.tuning.private_selection import parse_grid
from tfdp.tuning.private_selection import select_privately
from tfdp.tuning.selection_accounting import selection_epsilon
from tfdp.tuning.trial_count import TrialCount
from tfdp.tuning.trial_count import secret_generator

__all__ = [
    "SelectionGuarantee",
    "TrialCount",
    "check_grid",
    "parse_grid",
    "read_summaries",
    "report",
    "secret_generator",
    "select_by_validation",
    "select_privately",
    "selection_epsilon",
    "selection_guarantee",
    "validation_accuracy",
]
