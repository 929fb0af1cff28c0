"""Keras integration: `model.fit` with DP-SGD.

- `DPOptimizer`: wraps a Keras optimizer with a `tfdp.DPSGD` mechanism
  (clipping bound, noise multiplier, sampler, δ, secret key) and virtual
  steps; its noisy aggregator is the trainer's.
- `DPModel` / `make_private`: a model whose `fit` draws the logical steps
  (Poisson batches of arrays by default) and whose `train_step` clips per
  example, accumulates, noises once per logical step and updates.
- `callbacks`: `PrivacyLogger` (epsilon in the logs) and `PrivacyBudget`.

A `fit` runs one way through the modules here: `fit_inputs` (checks),
`fit_route` (the route, sampler and mechanism, via `mechanism_builder`),
`array_batches` (the physical batches), `train_function` (Keras' loop, epochs
and strategies), `private_update` (clip, accumulate, noise, apply), and
`fit_ledger` / `privacy_account` (what was released, accounted).

See `docs/KERAS.md`.
"""

from tfdp.keras import callbacks
from tfdp.keras.dp_model import DPModel
from tfdp.keras.dp_model import make_private
from tfdp.keras.per_example_loss import per_example_loss_fn
from tfdp.keras.dp_optimizer import DPOptimizer
from tfdp.keras.dp_optimizer import PlainGradientsError

__all__ = [
    "DPModel", "DPOptimizer", "PlainGradientsError", "callbacks", "make_private",
    "per_example_loss_fn",
]
