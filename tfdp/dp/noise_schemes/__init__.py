"""Noise schemes, registered by name (see `base`): what noise a logical step releases.

Importing this package imports every module in it, and so registers every
scheme: "gaussian" (DP-SGD), "banded" (banded matrix factorization), "tree"
(DP-FTRL's tree aggregation). Adding a scheme is adding a module here with
one `@register`ed `NoiseScheme` subclass (and its test).
"""

import importlib
import pkgutil

from tfdp.dp.noise_schemes.base import NoiseScheme
from tfdp.dp.noise_schemes.base import names
from tfdp.dp.noise_schemes.base import register
from tfdp.dp.noise_schemes.base import scheme_class

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
