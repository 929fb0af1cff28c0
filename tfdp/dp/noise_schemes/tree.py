"""`TreeNoise`: DP-FTRL's noise, the increment of a tree's noisy prefix sum.

With tree aggregation (`tfdp.privacy.tree_aggregation`) the model sees, after
leaf n − 1 of a tree (n leaves so far), the prefix sum of the clipped sums
plus the noise of the dyadic nodes that cover [0, n). Fed to SGD as a
gradient, step n − 1 releases the increment of that noise:

    cum(n) − cum(n − 1) = node(level k, ending at n)
                          − Σ_{l<k} node(level l, ending at n − 2^l),

with 2^k the lowest set bit of n: [0, n) and [0, n − 1) share every node
but the block of length 2^k ending at n, which replaces the k blocks of
[n − 2^k, n − 1). So a step draws 1 + k node noises, 2 on average, and
Σ of the released noises of a tree is exactly its noisy prefix sum's.

With several leaves per step (TF-Privacy's DP-FTRL with
`gradient_accumulation_steps=k`, one leaf per accumulated batch) step u
releases the sum of the increments of leaves u·k … u·k + k − 1: within one
tree, cum(u·k + k) − cum(u·k).

Each node's noise is drawn from the secret noise key by (tree, level, end):
no node noise is stored, a restarted or resumed run draws the same nodes
again, and every replica that asks draws the same tensors.
"""

import tensorflow as tf

from tfdp.dp import noise as noise_lib
from tfdp.dp.noise_schemes import base
from tfdp.privacy import tree_aggregation

# Keeps the node seeds apart from DP-SGD's step seeds of the same key.
_SALT_TREE = 0x7EE0_0001


def tree_and_leaf(step, restarts):
    """`(tree, leaf)` int64 tensors of a 0-based step, as `TreeRestarts.tree_and_leaf`."""
    step = tf.cast(step, tf.int64)
    if restarts.restart_period is None:
        return tf.constant(0, tf.int64), step
    period = tf.constant(restarts.restart_period, tf.int64)
    warmup = restarts.warmup
    if not warmup:
        return step // period, step % period
    after = tf.maximum(step - warmup, 0)
    in_warmup = step < warmup
    tree = tf.where(in_warmup, tf.constant(0, tf.int64), 1 + after // period)
    leaf = tf.where(in_warmup, step, after % period)
    return tree, leaf


def node_seed(noise_key, tree, level, end):
    """The stateless seed `[2]` of one tree node: (tree, level, end leaf)."""
    key = tf.random.experimental.stateless_fold_in(
        tf.cast(noise_key, tf.int64), tf.constant(_SALT_TREE, tf.int64))
    for word in (tree, level, end):
        key = tf.random.experimental.stateless_fold_in(key, tf.cast(word, tf.int64))
    return key


def residual_noise(like, stddev, noise_key, step, restarts, hardened_noise=False):
    """The tree noise released at `step`: `cum(n) − cum(n − 1)` (module docstring).

    Args:
        like: list of float tensors. The shapes and dtypes of the noise.
        stddev: float. σC (over the replicas' count, for a replica's share).
        noise_key: int64 `[2]`. The run's secret noise sub-key.
        step: int scalar (tensor). The 0-based logical step.
        restarts: `tfdp.privacy.tree_aggregation.TreeRestarts`.
        hardened_noise: bool. Hardened node draws, combined in float64.
            Defaults to `False`.

    Returns:
        A list of tensors like `like` (float64 with `hardened_noise`).
    """
    tree, leaf = tree_and_leaf(step, restarts)
    count = leaf + 1
    lowest = tf.bitwise.bitwise_and(count, -count)  # 2^k
    top = noise_lib.gaussian_noise(like, stddev, node_seed(noise_key, tree, lowest, count),
                                   hardened_noise)

    def body(span, noise):
        # The block of length `span` = 2^l ending at n − 2^l; its seed's level
        # word is the span, as the top node's.
        draws = noise_lib.gaussian_noise(
            like, stddev, node_seed(noise_key, tree, span, count - span), hardened_noise)
        return span * 2, [n - tf.cast(d, n.dtype) for n, d in zip(noise, draws)]

    _, noise = tf.while_loop(
        lambda span, noise: span < lowest, body, (tf.constant(1, tf.int64), top))
    return noise


def step_noise(like, stddev, noise_key, step, restarts, leaves_per_step=1,
               hardened_noise=False):
    """The tree noise of a step of `leaves_per_step` leaves: Σ of their `residual_noise`.

    Leaf `step · leaves_per_step + j`, j < `leaves_per_step`, is the j-th
    batch of the step, and the restarts count leaves. Summed leaf by leaf, a
    step across a restart leaves the finished tree's noise in it, as k
    separate steps would.

    Args:
        like: list of float tensors. The shapes and dtypes of the noise.
        stddev: float. σC of each node.
        noise_key: int64 `[2]`. The run's secret noise sub-key.
        step: int scalar (tensor). The 0-based logical step.
        restarts: `tfdp.privacy.tree_aggregation.TreeRestarts`, in leaves.
        leaves_per_step: int. k >= 1. Defaults to `1`.
        hardened_noise: bool. As `residual_noise`'s. Defaults to `False`.

    Returns:
        A list of tensors like `like` (float64 with `hardened_noise`).
    """
    k = int(leaves_per_step)
    first = tf.cast(step, tf.int64) * k
    if k == 1:
        return residual_noise(like, stddev, noise_key, first, restarts, hardened_noise)

    def body(j, total):
        noise = residual_noise(like, stddev, noise_key, first + j, restarts, hardened_noise)
        return j + 1, [t + tf.cast(n, t.dtype) for t, n in zip(total, noise)]

    zeros = [tf.zeros(x.shape, tf.float64) if hardened_noise else tf.zeros_like(x)
             for x in like]
    _, noise = tf.while_loop(lambda j, total: j < k, body, (tf.constant(0, tf.int64), zeros))
    return noise


@base.register
class TreeNoise(base.NoiseScheme):
    """Tree aggregation's noise (DP-FTRL): each step, its leaves' `step_noise`.

    No state: each node is drawn from the key by its index. Accounted by
    `tfdp.privacy.tree_aggregation.tree_dp_event` over shuffled fixed-size
    batches (`tfdp.privacy.tree_aggregation.TreeAggregationLedger`).

    Args:
        restarts: `tfdp.privacy.tree_aggregation.TreeRestarts`, in leaves.
        leaves_per_step: int. k >= 1: the tree leaves of one logical step
            (its accumulated batches). Defaults to `1`.
        hardened_noise: bool. As `NoiseScheme`'s: hardened node draws,
            combined in float64, released with one rounding. Defaults to
            `False`.
    """

    name = "tree"

    def __init__(self, restarts, leaves_per_step=1, *, hardened_noise=False):
        super().__init__(hardened_noise=hardened_noise)
        self.restarts = restarts
        self.leaves_per_step = tree_aggregation.validate_leaves_per_step(leaves_per_step)

    @classmethod
    def from_options(cls, *, coefficients=(1.0,), tree=None, leaves_per_step=1,
                     hardened_noise=False):
        """The scheme of `tree` and `leaves_per_step` (see `NoiseScheme.from_options`).

        Raises:
            ValueError: without a tree, or with a banded strategy's coefficients.
        """
        if tree is None or tuple(coefficients) != (1.0,):
            raise ValueError(
                "Tree aggregation needs its restarts (`tree=`), and no banded strategy: "
                "they are two ways to correlate the noise; choose one. Received: "
                f"tree={tree!r}, coefficients={coefficients!r}")
        return cls(tree, leaves_per_step, hardened_noise=hardened_noise)

    def noise(self, like, *, stddev, noise_key, step, state=None):
        """`step_noise` of the step (see `NoiseScheme.noise`); `state` is unused."""
        del state  # No state: every node is drawn from the key.
        return step_noise(like, stddev, noise_key, step, self.restarts, self.leaves_per_step,
                          self.hardened_noise)

    def accounting_options(self):
        """The restarts and the leaves per step, which the tree's event counts in leaves."""
        return {"restarts": self.restarts, "leaves_per_step": self.leaves_per_step}

    def __repr__(self):
        hardened = ", hardened_noise=True" if self.hardened_noise else ""
        return (f"TreeNoise(restarts={self.restarts!r}, "
                f"leaves_per_step={self.leaves_per_step!r}{hardened})")
