"""tfdp: differentially private training of image classifiers in TensorFlow 2 / Keras 3.

Submodules are imported lazily so that, e.g., `python -m tfdp.privacy` does not
pay TensorFlow's import time.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
      "dp": "tfdp.dp",
      "privacy": "tfdp.privacy",
      "layers": "tfdp.layers",
      "models": "tfdp.models",
      "finetune": "tfdp.finetune",
      "data": "tfdp.data",
      "optim": "tfdp.optim",
      "keras": "tfdp.keras",
      "callbacks": "tfdp.keras.callbacks",
      "samplers": "tfdp.samplers",
      "secret_key": "tfdp.secret_key",
}

# Names re-exported from a submodule, imported on first access.
_LAZY_ATTRS = {
    "DPSGD": "tfdp.mechanism",
    "DPSGDConfig": "tfdp.dpsgd_config",
    "DPOptimizer": "tfdp.keras",
    "DPModel": "tfdp.keras",
    "make_private": "tfdp.keras",
    "declare_public": "tfdp.dp.adapted_state",
    "find_adapted_state": "tfdp.dp.adapted_state",
}


# Submodules that never import TensorFlow (so they skip its quiet import).
_NO_TENSORFLOW = ("privacy", "samplers")


def __getattr__(name):
    if name in _LAZY or name in _LAZY_ATTRS:
        if name not in _NO_TENSORFLOW:
            # TensorFlow's first import (and its device search, where cuInit
            # runs) without its start-up notices, which a user cannot act on.
            from tfdp import tensorflow_startup

            tensorflow_startup.import_tensorflow()
        if name in _LAZY:
            return importlib.import_module(_LAZY[name])
        return getattr(importlib.import_module(_LAZY_ATTRS[name]), name)
    raise AttributeError(f"module 'tfdp' has no attribute {name!r}")
