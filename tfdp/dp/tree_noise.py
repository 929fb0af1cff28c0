"""DP-FTRL's tree noise: kept for its importers; it lives in `tfdp.dp.noise_schemes.tree`.

The scheme's module holds the arithmetic (`tree_and_leaf`, `node_seed`,
`residual_noise`, `step_noise`) beside the `TreeNoise` scheme that releases it.
"""

from tfdp.dp.noise_schemes.tree import node_seed
from tfdp.dp.noise_schemes.tree import residual_noise
from tfdp.dp.noise_schemes.tree import step_noise
from tfdp.dp.noise_schemes.tree import tree_and_leaf

__all__ = ["node_seed", "residual_noise", "step_noise", "tree_and_leaf"]
