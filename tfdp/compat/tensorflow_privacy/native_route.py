"""The one-time notice that the compat classes are not tfdp's native route."""

import logging

_logged = False


def log_native_route_once():
    """Logs (once per process) where tfdp's own Keras API is documented."""
    global _logged
    if _logged:
        return
    _logged = True
    logging.getLogger("tfdp").warning(
        "tfdp.compat.tensorflow_privacy runs TF-Privacy Keras code on tfdp. "
        "The native route is `tfdp.make_private(model)` with a "
        "`tfdp.DPOptimizer`: true Poisson sampling in fit, a privacy "
        "ledger and budget callbacks. See docs/MIGRATING.md."
    )
