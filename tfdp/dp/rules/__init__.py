"""Per-layer clipping rules, registered by layer class (see `registry`).

Importing this package imports every module in it, and so registers every
rule: one module per layer family, plus the generic fallback. Adding a layer
family is adding a module here (and its test on
`tests/dp/rules/rule_test_case.py`).
"""

import importlib
import pkgutil

from tfdp.dp.rules.registry import ClipContext
from tfdp.dp.rules.registry import Cost
from tfdp.dp.rules.registry import LayerClip
from tfdp.dp.rules.registry import Rule
from tfdp.dp.rules.registry import TAPPED_METHODS
from tfdp.dp.rules.registry import install_taps
from tfdp.dp.rules.registry import notes
from tfdp.dp.rules.registry import offset_variables
from tfdp.dp.rules.registry import register_rule
from tfdp.dp.rules.registry import rule_for
from tfdp.dp.rules.registry import weight_decay_variables

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
