"""TF-Privacy's Keras API on tfdp: change the import, keep the code.

```python
# import tensorflow_privacy
from tfdp.compat import tensorflow_privacy
```

The names, arguments and meanings are TF-Privacy 0.9's; the clipping, noise
and accounting are tfdp's:

- `DPKerasSGDOptimizer`, `DPKerasAdamOptimizer`, `DPKerasAdagradOptimizer`
  (and the `VectorizedDPKeras*` names, the same classes): compile them into
  a private model, `tfdp.make_private(model)` (Keras 3 hands an optimizer
  only the gradients of the reduced loss, so a plain Keras model cannot be
  trained privately by its optimizer alone and refuses them).
- `DPFTRLTreeAggregationOptimizer`: DP-FTRL (SGD on tree-aggregated
  noise, with restarts), accounted with dp_accounting's tree-aggregation
  events; compiled or in a custom loop like the others.
- `DPModel`, `DPSequential`: models that clip and noise themselves; compile
  them with a plain optimizer.
- `PlainGradientsError`: what an optimizer raises when asked to apply
  gradients it did not noise (a `RuntimeError` and, as TF-Privacy's, an
  `AssertionError`).
- `compute_dp_sgd_privacy_statement`, `compute_dp_sgd_privacy`,
  `AccountantType`, `example_epsilon`, `user_epsilon`: the same RDP or PLD
  figures as TF-Privacy. The statement is a `str` with the two epsilons
  also as attributes (`.epsilon_once_per_epoch`, `.epsilon_poisson`).
  They import no TensorFlow.

See `docs/MIGRATING.md` for what differs and for the native route
(`tfdp.make_private`, `tfdp.DPOptimizer`).
"""

import importlib

# The Keras classes import TensorFlow; the privacy statement does not, so
# names are resolved on first access.
_MODULES = {
    "AccountantType": "privacy_statement",
    "DPFTRLTreeAggregationOptimizer": "dp_ftrl",
    "DPModel": "dp_keras_model",
    "DPSequential": "dp_keras_model",
    "DPKerasAdagradOptimizer": "dp_keras_optimizer",
    "DPKerasAdamOptimizer": "dp_keras_optimizer",
    "DPKerasOptimizer": "dp_keras_optimizer",
    "DPKerasSGDOptimizer": "dp_keras_optimizer",
    "VectorizedDPKerasAdagradOptimizer": "dp_keras_optimizer",
    "VectorizedDPKerasAdamOptimizer": "dp_keras_optimizer",
    "VectorizedDPKerasSGDOptimizer": "dp_keras_optimizer",
    "make_keras_optimizer_class": "dp_keras_optimizer",
    "make_vectorized_keras_optimizer_class": "dp_keras_optimizer",
    "PlainGradientsError": "dp_keras_optimizer",
    "PrivacyStatement": "privacy_statement",
    "compute_dp_sgd_privacy": "privacy_statement",
    "compute_dp_sgd_privacy_statement": "privacy_statement",
    "example_epsilon": "privacy_statement",
    "user_epsilon": "privacy_statement",
}

# TF-Privacy's own tests call helpers of its privacy statement by their
# private names; they are served by public functions of the same meaning.
_TF_PRIVACY_HELPERS = {
    "_compute_dp_sgd_example_privacy": ("privacy_statement", "example_epsilon"),
    "_compute_dp_sgd_user_privacy": ("privacy_statement", "user_epsilon"),
    "_logexpm1": ("privacy_statement", "logexpm1"),
}


def __getattr__(name):
    if name in _TF_PRIVACY_HELPERS:
        module, public = _TF_PRIVACY_HELPERS[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), public)
    if name in _MODULES:
        module = importlib.import_module(f"{__name__}.{_MODULES[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_MODULES))


__all__ = [
    "AccountantType",
    "DPFTRLTreeAggregationOptimizer",
    "DPKerasAdagradOptimizer",
    "DPKerasAdamOptimizer",
    "DPKerasOptimizer",
    "DPKerasSGDOptimizer",
    "DPModel",
    "DPSequential",
    "PlainGradientsError",
    "PrivacyStatement",
    "VectorizedDPKerasAdagradOptimizer",
    "VectorizedDPKerasAdamOptimizer",
    "VectorizedDPKerasSGDOptimizer",
    "compute_dp_sgd_privacy",
    "compute_dp_sgd_privacy_statement",
    "example_epsilon",
    "make_keras_optimizer_class",
    "make_vectorized_keras_optimizer_class",
    "user_epsilon",
]
