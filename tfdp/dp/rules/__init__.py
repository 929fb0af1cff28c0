"""Per-layer clipping rules, registered by layer class (see `registry`).

Importing this package registers the built-in rules: dense, conv, embedding,
norm and the generic fallback.
"""

from tfdp.dp.rules import conv  # noqa: F401 (registers)
from tfdp.dp.rules import dense  # noqa: F401 (registers)
from tfdp.dp.rules import embedding  # noqa: F401 (registers)
from tfdp.dp.rules import generic  # noqa: F401 (registers)
from tfdp.dp.rules import norm  # noqa: F401 (registers)
from tfdp.dp.rules.registry import ClipContext
from tfdp.dp.rules.registry import Cost
from tfdp.dp.rules.registry import LayerClip
from tfdp.dp.rules.registry import Rule
from tfdp.dp.rules.registry import TAPPED_METHODS
from tfdp.dp.rules.registry import install_taps
from tfdp.dp.rules.registry import register_rule
from tfdp.dp.rules.registry import rule_for
