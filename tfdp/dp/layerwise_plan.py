"""`plan`: which per-layer rule each trainable layer gets, and its memory.

The cost of each layer comes from its rule (`tfdp.dp.rules`). The tapped
methods compute the norms layer by layer in the backward pass
(`norm_stream`), so a layer's work memory is freed before the next layer's
starts: the extra memory is the largest layer's work plus what is kept
until the clipped sums are formed.

Given a clipping-memory budget, "auto" picks the fastest method whose
estimate fits: book-keeping (one backward pass, keeps output gradients or
per-example gradients until the sums), else mixed (the ghost layers keep
only their norms, and a second backward pass forms their sums).

The estimate counts what clipping adds, not the peak of the step. It leaves
out that the activations non-private backprop frees layer by layer are
freed by book-keeping too, while what it keeps grows, so the peak grows by
less than `kept_bytes` (ResNet-50-GN, 224 px, batch 48: 683 MiB kept, the
allocator's peak 230 MiB above non-private's); and that mixed's second pass
needs the forward activations, which stay alive through the first.
"""

import dataclasses
import math

import tensorflow as tf

from tfdp.dp import clipping
from tfdp.dp import layer_taps
from tfdp.dp import rules


@dataclasses.dataclass
class LayerPlan:
    """How one trainable layer's per-example norms are computed."""

    name: str
    kind: str  # The rule's name.
    t: int
    p: int
    d: int
    mode: str
    params: int
    memory_bytes: int
    kept_bytes: int = 0
    # A conv ghost norm whose U Uᵀ comes from the pixel Gram, without
    # unfolding the input (`rules.conv.conv_input_gram`).
    pixel_gram: bool = False
    why: str = ""  # Why the mode (the rule's `Cost.why`).

    @property
    def rule(self):
        return f"{self.mode}-pixel" if self.pixel_gram else self.mode


@dataclasses.dataclass
class ClippingPlan:
    """The per-layer plan of a clipping method for one physical batch."""

    method: str
    batch_size: int
    layers: list

    requested: str = "auto"
    # The clipping-memory budget "auto" chose under, in bytes, and the
    # estimates of the methods it passed over: [(method, bytes)].
    budget_bytes: int = None
    passed_over: list = dataclasses.field(default_factory=list)
    # (layer name, remark) for layers accepted without a per-layer rule of
    # their own, e.g. frozen BatchNormalization (`rules.notes`).
    notes: list = dataclasses.field(default_factory=list)

    def _kept(self, layer):
        if self.method == "bk":
            return layer.kept_bytes
        if self.method in ("ghost", "mixed") and layer.mode == "instantiate":
            return layer.kept_bytes  # The second backward pass forms the others' sums.
        return 0

    @property
    def kept_bytes(self):
        """What the method keeps from the norms until the clipped sums."""
        return sum(self._kept(layer) for layer in self.layers)

    @property
    def memory_bytes(self):
        """Estimated memory of clipping: the largest layer's work plus what is kept."""
        work = max((layer.memory_bytes for layer in self.layers), default=0)
        return work + self.kept_bytes

    def reason(self):
        """Why the method, in one line."""
        why = {
            "bk": "norms layer by layer in the backward pass, sums from kept per-example "
                  "gradients or output gradients: one backward pass, memory near non-private",
            "mixed": "norms layer by layer, ghost or instantiated per layer (2T² < pD); a second "
                     "backward pass forms the ghost layers' sums: least memory, more time",
            "ghost": "ghost norms for every layer; a second backward pass forms the sums",
            "vectorized": "per-example gradients of the whole model (tf.vectorized_map): the "
                          "only tapped-free method, for models whose variables are read outside "
                          "their own layer",
            "naive": "a loop over examples: the reference, slowest",
        }[self.method]
        if self.requested != "auto":
            return f"{self.method}: {why}"
        if self.budget_bytes is None:
            return f"auto chose {self.method}: {why}"
        over = "; ".join(f"{method} needs {_mb(n)}" for method, n in self.passed_over)
        fits = self.memory_bytes <= self.budget_bytes
        budget = (f"its estimated {_mb(self.memory_bytes)} "
                  f"{'fits' if fits else 'is the least but exceeds'} the clipping-memory "
                  f"budget of {_mb(self.budget_bytes)}")
        if over:
            budget += f" ({over})"
        if not fits:
            budget += "; a smaller physical batch would fit"
        return f"auto chose {self.method}, {budget}: {why}"

    def __str__(self):
        header = (f"{'layer':<40} {'kind':<10} {'T':>6} {'p':>6} {'D':>7} {'rule':<12} "
                  f"{'params':>9} {'work':>10} {'kept':>10}  why")
        lines = [
            f"DP plan: method={self.method}, physical batch={self.batch_size}",
            self.reason(),
            header,
            "-" * len(header),
        ]
        for layer in self.layers:
            lines.append(
                f"{layer.name[:40]:<40} {layer.kind:<10} {layer.t:>6} {layer.p:>6} "
                f"{layer.d:>7} {layer.rule:<12} {layer.params:>9} "
                f"{_mb(layer.memory_bytes):>10} {_mb(self._kept(layer)):>10}  {layer.why}"
            )
        for name, note in self.notes:
            lines.append(f"{name}: {note}")
        lines.append(
            "estimated clipping memory for the physical batch: "
            f"{_mb(self.memory_bytes)} (largest layer's work, freed before the next layer's, "
            f"plus {_mb(self.kept_bytes)} kept until the clipped sums)"
        )
        return "\n".join(lines)


def _mb(n):
    return f"{n / 2**20:.1f} MiB"


# What "auto" tries under a memory budget, fastest first.
BUDGET_CANDIDATES = ("bk", "mixed")


def plan(model, input_shape, batch_size, method="auto", input_dtype="float32",
         memory_budget_mb=None):
    """Plans per-example norm computation for each trainable layer.

    Args:
        model: keras.Model. The model to train.
        input_shape: tuple. One example's input shape, without the batch.
        batch_size: int. The physical batch size.
        method: str. A clipping method; "auto" resolves as in training.
            Defaults to "auto".
        input_dtype: str. Dtype of the probe input. Defaults to "float32".
        memory_budget_mb: float or None. With method "auto": the most
            clipping memory (this plan's `memory_bytes`, beyond non-private
            training) one device may spend on `batch_size` rows. "auto" then
            picks the first of `BUDGET_CANDIDATES` whose estimate fits, else
            the one needing least, and `reason()` says why. Defaults to None
            (book-keeping).

    Returns:
        A `ClippingPlan`; `print(plan)` shows the table.

    Raises:
        ValueError: for a budget that is not positive, or one given with a
            method other than "auto".
    """
    if memory_budget_mb is not None:
        if method != "auto":
            raise ValueError(
                "A clipping-memory budget chooses the method, so it needs method='auto'. "
                f"Received: method={method!r}, memory_budget_mb={memory_budget_mb!r}")
        if not memory_budget_mb > 0:
            raise ValueError(
                f"memory_budget_mb must be > 0. Received: memory_budget_mb={memory_budget_mb!r}")
    requested = method
    method = clipping.resolve_method(model, method)
    rules.install_taps(model)
    probe = tf.zeros((1,) + tuple(input_shape), dtype=input_dtype)
    with layer_taps.recording() as recorder:
        model(probe, training=False)
    groups = {}
    for record in recorder.records:
        groups.setdefault(id(record.layer), []).append(record)
    # Counted once: every candidate method plans the same layers.
    params = {
        key: sum(math.prod(int(n) for n in v.shape)
                 for v in layer_taps.own_trainable_variables(records[0].layer))
        for key, records in groups.items()
    }

    def method_plan(method):
        layers = []
        for key, records in groups.items():
            layer = records[0].layer
            rule = layer._tfdp_rule
            cost = rule.cost(layer, records, method, batch_size)
            layers.append(LayerPlan(
                layer.name, rule.name, cost.t, cost.p, cost.d, cost.mode, params[key],
                cost.memory_bytes, cost.kept_bytes, pixel_gram=cost.pixel_gram, why=cost.why,
            ))
        return ClippingPlan(method, batch_size, layers, requested, notes=rules.notes(model))

    if memory_budget_mb is None or method not in BUDGET_CANDIDATES:
        # No budget to choose under, or "auto" resolved to vectorized
        # (variables read outside their layer), which no other method bounds.
        return method_plan(method)
    budget = int(memory_budget_mb * 2**20)
    tried = []
    for candidate in BUDGET_CANDIDATES:
        chosen = method_plan(candidate)
        if chosen.memory_bytes <= budget:
            break
        tried.append(chosen)
    else:
        chosen = min(tried, key=lambda p: p.memory_bytes)
    chosen.budget_bytes = budget
    chosen.passed_over = [(p.method, p.memory_bytes) for p in tried if p is not chosen]
    return chosen
