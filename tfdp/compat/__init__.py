"""Drop-in replacements for other DP libraries' APIs, on tfdp's engine.

- `tfdp.compat.tensorflow_privacy`: TF-Privacy 0.9's Keras optimizers,
  models and privacy statement (`from tfdp.compat import tensorflow_privacy`).

See `docs/MIGRATING.md`.
"""
