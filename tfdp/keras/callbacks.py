"""Keras callbacks for private models: epsilon in the logs, and a budget.

- `PrivacyLogger`: epsilon and delta (named with the privacy unit for
  user-level runs) in the logs, the progress bar and TensorBoard.
- `PrivacyBudget`: stops training before a noisy update would exceed a
  target epsilon.

Both read the run's ledger from the `DPOptimizer` (see
`tfdp.keras.ledger_callback`), so a resumed run reports and enforces the
epsilon of all the steps taken.
"""

from tfdp.keras.privacy_budget import PrivacyBudget
from tfdp.keras.privacy_logger import PrivacyLogger

__all__ = ["PrivacyBudget", "PrivacyLogger"]
