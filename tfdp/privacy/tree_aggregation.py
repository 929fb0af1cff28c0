"""DP-FTRL's tree aggregation (Kairouz et al. 2021): its restarts and its ε.

DP-FTRL releases, at each step, a noisy prefix sum of the clipped gradient
sums: the true prefix sum plus the sum of the binary tree's node noises that
cover it (Dwork et al. 2010). Each node noise is N(0, (σC)²); one example's
leaf is covered by at most ⌈log2(T + 1)⌉ released nodes of a tree of T
steps. A restart starts a new tree (and a new prefix sum). TF-Privacy's
`PeriodicRoundRestartIndicator` restarts after step `restart_warmup`, then
every `restart_period` steps (after steps `restart_period`, 2·`restart_period`,
... without a warmup).

The accounting is dp_accounting's, under zero-out adjacency (its
`REPLACE_SPECIAL`: one example's slot left empty): the batches are the
shuffle sampler's, each example in at most one step of a pass.

- Every tree within one pass: pass by pass, one
  `SingleEpochTreeAggregationDpEvent(σ, [the pass's tree sizes])` (one
  example is in at most one of them), composed over the passes.
- A tree across m > 1 passes holds one example up to m times: each released
  node then moves by at most m·C, and the example's leaves cover at most
  m·d nodes of a tree of depth d, so the node vector moves by at most
  C·√(m²·d). That tree is accounted as a Gaussian mechanism of noise
  multiplier σ / (m·√d); the trees are composed.

With k leaves per step (TF-Privacy's `gradient_accumulation_steps=k`: a
leaf per accumulated batch of B / k examples, an update per k leaves) the
tree is over the leaves: the updates release the noisy prefix sums at every
k-th leaf, a part of what the leaves' tree releases, so the leaves' tree
is accounted, with its restarts in leaves and k · (N // B) leaves a pass.

Imports no TensorFlow.
"""

import math

import dp_accounting
from dp_accounting import rdp as dp_rdp

from tfdp import validation
from tfdp.privacy import accounting

RELATION = dp_accounting.NeighboringRelation.REPLACE_SPECIAL
ADJACENCY = "zero_out"
ADJACENCY_DESCRIPTION = "zero-out: one example's slot left empty, the others in place"


def tree_depth(size):
    """⌈log2(size + 1)⌉: the most released nodes of a tree of `size` steps over one leaf."""
    return math.ceil(math.log2(int(size) + 1))



def validate_leaves_per_step(leaves_per_step):
    """`leaves_per_step` (tree leaves of one logical step), or a clear error unless an int >= 1."""
    if (isinstance(leaves_per_step, bool) or not isinstance(leaves_per_step, int)
            or leaves_per_step < 1):
        raise ValueError(
            "leaves_per_step must be an int >= 1. "
            f"Received: leaves_per_step={leaves_per_step!r}")
    return leaves_per_step

class TreeRestarts:
    """When DP-FTRL restarts its tree, as TF-Privacy's `restart_period` / `restart_warmup`.

    Args:
        restart_period: int or None. Steps per tree after the first restart.
            Defaults to `None`: one tree for the whole run.
        restart_warmup: int or None. Steps of the first tree, in
            [1, restart_period − 1]. Defaults to `None`: `restart_period`.
    """

    def __init__(self, restart_period=None, restart_warmup=None):
        if restart_warmup is not None and restart_period is None:
            raise ValueError(
                "restart_warmup needs a restart_period (it is the first tree's length, "
                "the later ones' being the period). Received: restart_period=None, "
                f"restart_warmup={restart_warmup!r}")
        if restart_period is not None and (
                isinstance(restart_period, bool) or not isinstance(restart_period, int)
                or restart_period < 1):
            raise ValueError(
                "restart_period must be None or an int >= 1. "
                f"Received: restart_period={restart_period!r}")
        if restart_warmup is not None and (
                isinstance(restart_warmup, bool) or not isinstance(restart_warmup, int)
                or not 1 <= restart_warmup <= restart_period - 1):
            raise ValueError(
                "restart_warmup must be None or an int in [1, restart_period - 1]. "
                f"Received: restart_warmup={restart_warmup!r}, restart_period={restart_period}")
        self.restart_period = restart_period
        self.restart_warmup = restart_warmup

    @property
    def warmup(self):
        """Steps of the first tree before the periodic ones (0: none)."""
        return self.restart_warmup or 0

    def tree_and_leaf(self, step):
        """`(tree, leaf)` of the 0-based logical step: which tree, which leaf in it."""
        step = int(step)
        if self.restart_period is None:
            return 0, step
        if step < self.warmup:
            return 0, step
        tree, leaf = divmod(step - self.warmup, self.restart_period)
        return tree + (1 if self.warmup else 0), leaf

    def trees(self, steps):
        """`[(first step, size)]` of the trees the first `steps` steps touch."""
        steps = int(steps)
        if steps <= 0:
            return []
        if self.restart_period is None:
            return [(0, steps)]
        out = []
        start = 0
        size = self.warmup or self.restart_period
        while start < steps:
            out.append((start, min(size, steps - start)))
            start += size
            size = self.restart_period
        return out

    def __eq__(self, other):
        return (isinstance(other, TreeRestarts) and
                (self.restart_period, self.restart_warmup)
                == (other.restart_period, other.restart_warmup))

    def __hash__(self):
        return hash((self.restart_period, self.restart_warmup))

    def __repr__(self):
        return (f"TreeRestarts(restart_period={self.restart_period}, "
                f"restart_warmup={self.restart_warmup})")


def tree_dp_event(noise_multiplier, steps, steps_per_epoch, restarts):
    """The `DpEvent` of `steps` DP-FTRL steps over shuffled fixed-size batches.

    Args:
        noise_multiplier: float. σ of each node over the sensitivity.
        steps: int. Logical steps released.
        steps_per_epoch: int. N // B: steps of one pass (an example is in at
            most one step of a pass).
        restarts: `TreeRestarts`.

    Returns:
        A `dp_accounting.DpEvent`, to compose under `REPLACE_SPECIAL`.
    """
    sigma = validation.validate_noise_multiplier(noise_multiplier)
    per_epoch = int(steps_per_epoch)
    if per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1. Received: {steps_per_epoch!r}")
    trees = restarts.trees(steps)
    passes = [((start // per_epoch), (start + size - 1) // per_epoch) for start, size in trees]
    if all(first == last for first, last in passes):
        by_pass = {}
        for (start, size), (epoch, _) in zip(trees, passes):
            by_pass.setdefault(epoch, []).append(size)
        counts = {}
        for sizes in by_pass.values():
            counts[tuple(sizes)] = counts.get(tuple(sizes), 0) + 1
        return dp_accounting.ComposedDpEvent([
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.SingleEpochTreeAggregationDpEvent(sigma, list(sizes)), count)
            for sizes, count in counts.items()])
    events = []
    for (start, size), (first, last) in zip(trees, passes):
        m = last - first + 1
        if m == 1:
            events.append(dp_accounting.SingleEpochTreeAggregationDpEvent(sigma, size))
        else:
            events.append(dp_accounting.GaussianDpEvent(sigma / (m * math.sqrt(tree_depth(size)))))
    return dp_accounting.ComposedDpEvent(events)


def tree_epsilon(noise_multiplier, steps, delta, steps_per_epoch, restarts):
    """ε of `tree_dp_event` at δ, with dp_accounting's RDP accountant (zero-out)."""
    if int(steps) == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    accountant = dp_rdp.RdpAccountant(orders=accounting.RDP_ORDERS, neighboring_relation=RELATION)
    accountant.compose(tree_dp_event(noise_multiplier, steps, steps_per_epoch, restarts))
    return float(accountant.get_epsilon(delta))


class TreeAggregationLedger:
    """The privacy ledger of a DP-FTRL run: `PrivacyLedger`'s reading API.

    Args:
        noise_multiplier: float. σ of each tree node (TF-Privacy's).
        delta: float. δ.
        steps: int. Logical steps released.
        dataset_size: int. N.
        batch_size: int. B, the fixed batch size.
        restarts: `TreeRestarts`.
        sensitivity: float. 1, or 2 for microbatches of several examples
            (σ / 2 is accounted). Defaults to `1`.
        l2_norm_clip: float or None. C, recorded. Defaults to `None`.
        leaves_per_step: int. k: tree leaves (accumulated batches of B / k
            examples) per step; `steps` and `batch_size` are the updates'
            and the restarts count leaves. Defaults to `1`.
    """

    sampler = "shuffle"
    accountant = "rdp"
    adjacency = ADJACENCY
    adjacency_description = ADJACENCY_DESCRIPTION
    privacy_unit = "example"
    bands = 1

    def __init__(self, noise_multiplier, *, delta, steps, dataset_size, batch_size, restarts,
                 sensitivity=1, l2_norm_clip=None, leaves_per_step=1):
        self.noise_multiplier = validation.validate_noise_multiplier(noise_multiplier)
        self.delta = validation.validate_delta(delta)
        self.steps = validation.validate_steps(steps)
        self.dataset_size = int(dataset_size)
        self.batch_size = int(batch_size)
        if not 1 <= self.batch_size <= self.dataset_size:
            raise ValueError(
                "The batch size must be in [1, dataset_size]. Received: "
                f"batch_size={batch_size}, dataset_size={dataset_size}")
        self.restarts = restarts
        self.sensitivity = sensitivity
        self.l2_norm_clip = l2_norm_clip
        self.leaves_per_step = validate_leaves_per_step(leaves_per_step)

    @property
    def steps_per_epoch(self):
        return self.dataset_size // self.batch_size

    @property
    def sampling_rate(self):
        return self.batch_size / self.dataset_size

    @property
    def effective_noise_multiplier(self):
        return self.noise_multiplier / self.sensitivity

    def dp_event(self, steps=None):
        """The run's `DpEvent` (zero-out), at the effective noise multiplier."""
        steps = self.steps if steps is None else steps
        k = self.leaves_per_step
        return tree_dp_event(self.effective_noise_multiplier, steps * k,
                             self.steps_per_epoch * k, self.restarts)

    def epsilon_after(self, steps, noise_multiplier=None):
        sigma = self.effective_noise_multiplier if noise_multiplier is None else noise_multiplier
        k = self.leaves_per_step
        return tree_epsilon(sigma, validation.validate_steps(steps) * k, self.delta,
                            self.steps_per_epoch * k, self.restarts)

    def epsilon(self):
        return self.epsilon_after(self.steps)

    def epsilon_replace_one(self, steps=None):
        """ε under replace-one adjacency: a leaf moves by up to 2C, so σ / 2."""
        steps = self.steps if steps is None else steps
        return self.epsilon_after(steps, self.noise_multiplier / max(2, self.sensitivity))

    def max_steps_within(self, target_epsilon):
        """The most steps with ε <= target (ε grows with the steps)."""
        low, high = 0, 1
        while self.epsilon_after(high) <= target_epsilon:
            low, high = high, high * 2
            if high > 2**40:
                return low
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.epsilon_after(mid) <= target_epsilon else (low, mid)
        return low

    def describe_epsilon(self, epsilon=None, steps=None, brief=False):
        """One line, as `PrivacyLedger.describe_epsilon`, naming the tree."""
        steps = self.steps if steps is None else steps
        if epsilon is None:
            epsilon = self.epsilon_after(steps)
        text = (f"epsilon={accounting.format_epsilon(epsilon)} at delta={self.delta:g} "
                f"({self.adjacency} adjacency"
                + ("" if brief else f": {self.adjacency_description}"))
        if not brief:
            period = self.restarts.restart_period
            unit = "steps" if self.leaves_per_step == 1 else "batches"
            text += ("; DP-FTRL tree aggregation, " +
                     ("one tree" if period is None else f"restarts every {period} {unit}"))
            if self.leaves_per_step > 1:
                text += f", a leaf per batch, {self.leaves_per_step} batches a step"
        if self.sensitivity != 1:
            text += (f"; sensitivity {self.sensitivity:g}C, so noise multiplier "
                     f"{self.noise_multiplier:g} counts as {self.effective_noise_multiplier:g}")
        replace_one = self.epsilon_replace_one(steps)
        return text + f"; replace-one epsilon={accounting.format_epsilon(replace_one)})"

    def __repr__(self):
        return (f"TreeAggregationLedger(noise_multiplier={self.noise_multiplier}, "
                f"delta={self.delta}, steps={self.steps}, dataset_size={self.dataset_size}, "
                f"batch_size={self.batch_size}, restarts={self.restarts!r}, "
                f"sensitivity={self.sensitivity}, leaves_per_step={self.leaves_per_step})")
