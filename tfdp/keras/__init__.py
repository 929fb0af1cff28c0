"""Keras integration: `model.fit` with DP-SGD.

- `DPOptimizer`: wraps a Keras optimizer with a `tfdp.DPSGD` mechanism
  (clipping bound, noise multiplier, sampler, δ, secret key) and virtual
  steps; its noisy aggregator is the trainer's.
- `DPModel` / `make_private`: a model whose `fit` draws the logical steps
  (Poisson batches of arrays by default) and whose `train_step` clips per
  example, accumulates, noises once per logical step and updates.
- `array_batches`: the physical batches `fit` draws from arrays.
- `callbacks`: `PrivacyLogger` (epsilon in the logs) and `PrivacyBudget`.

See `docs/KERAS.md`.
"""

from tfdp.keras import callbacks
from tfdp.keras.dp_model import DPModel
from tfdp.keras.dp_model import make_private
from tfdp.keras.dp_model import per_example_loss_fn
from tfdp.keras.dp_optimizer import DPOptimizer

__all__ = ["DPModel", "DPOptimizer", "callbacks", "make_private", "per_example_loss_fn"]
