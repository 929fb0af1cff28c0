"""TF-Privacy's Keras API on tfdp: change the import, keep the code.

```python
# import tensorflow_privacy
from tfdp.compat import tensorflow_privacy
```

The names, arguments and meanings are TF-Privacy 0.9's; the clipping, noise
and accounting are tfdp's:

- `DPKerasSGDOptimizer`, `DPKerasAdamOptimizer`, `DPKerasAdagradOptimizer`
  (and the `VectorizedDPKeras*` names, the same classes): compile them into
  a plain Keras model with a per-example loss (`reduction=None`).
- `DPModel`, `DPSequential`: models that clip and noise themselves; compile
  them with a plain optimizer.
- `compute_dp_sgd_privacy_statement`, `compute_dp_sgd_privacy`: the same
  RDP figures as TF-Privacy. The statement is a `str` with the two epsilons
  also as attributes (`.epsilon_once_per_epoch`, `.epsilon_poisson`).

See `docs/MIGRATING.md` for what differs and for the native route
(`tfdp.make_private`, `tfdp.DPOptimizer`).
"""

from tfdp.compat.tensorflow_privacy.dp_keras_model import DPModel
from tfdp.compat.tensorflow_privacy.dp_keras_model import DPSequential
from tfdp.compat.tensorflow_privacy.dp_keras_optimizer import DPKerasAdagradOptimizer
from tfdp.compat.tensorflow_privacy.dp_keras_optimizer import DPKerasAdamOptimizer
from tfdp.compat.tensorflow_privacy.dp_keras_optimizer import DPKerasOptimizer
from tfdp.compat.tensorflow_privacy.dp_keras_optimizer import DPKerasSGDOptimizer
from tfdp.compat.tensorflow_privacy.dp_keras_optimizer import VectorizedDPKerasAdagradOptimizer
from tfdp.compat.tensorflow_privacy.dp_keras_optimizer import VectorizedDPKerasAdamOptimizer
from tfdp.compat.tensorflow_privacy.dp_keras_optimizer import VectorizedDPKerasSGDOptimizer
from tfdp.compat.tensorflow_privacy.dp_keras_optimizer import make_keras_optimizer_class
from tfdp.compat.tensorflow_privacy.dp_keras_optimizer import (
    make_vectorized_keras_optimizer_class,
)
from tfdp.compat.tensorflow_privacy.privacy_statement import PrivacyStatement
from tfdp.compat.tensorflow_privacy.privacy_statement import compute_dp_sgd_privacy
from tfdp.compat.tensorflow_privacy.privacy_statement import (
    compute_dp_sgd_privacy_statement,
)

__all__ = [
    "DPKerasAdagradOptimizer",
    "DPKerasAdamOptimizer",
    "DPKerasOptimizer",
    "DPKerasSGDOptimizer",
    "DPModel",
    "DPSequential",
    "PrivacyStatement",
    "VectorizedDPKerasAdagradOptimizer",
    "VectorizedDPKerasAdamOptimizer",
    "VectorizedDPKerasSGDOptimizer",
    "compute_dp_sgd_privacy",
    "compute_dp_sgd_privacy_statement",
    "make_keras_optimizer_class",
    "make_vectorized_keras_optimizer_class",
]
