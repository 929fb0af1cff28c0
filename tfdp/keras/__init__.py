"""Keras integration: `model.fit` with DP-SGD.

- `DPOptimizer`: wraps a Keras optimizer with the DP-SGD hyperparameters
  (clipping bound, noise multiplier, virtual steps) and the ledger settings.
- `DPModel` / `make_private`: a model whose `train_step` clips per example,
  accumulates, noises once per logical step and updates.
- `callbacks`: `PrivacyLogger` (epsilon in the logs) and `PrivacyBudget`.

See `docs/KERAS.md`.
"""

from tfdp.keras import callbacks
from tfdp.keras.dp_model import DPModel
from tfdp.keras.dp_model import make_private
from tfdp.keras.dp_model import per_example_loss_fn
from tfdp.keras.dp_optimizer import DPOptimizer

__all__ = ["DPModel", "DPOptimizer", "callbacks", "make_private", "per_example_loss_fn"]
