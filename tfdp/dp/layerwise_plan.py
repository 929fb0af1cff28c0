"""`plan`: which per-layer rule each trainable layer gets, and its memory.

The cost of each layer comes from its rule (`tfdp.dp.rules`). The tapped
methods compute the norms layer by layer in the backward pass
(`norm_stream`), so a layer's work memory is freed before the next layer's
starts: the extra memory is the largest layer's work plus what is kept
until the clipped sums are formed.
"""

import dataclasses

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
class DPPlan:
    """The per-layer plan of a clipping method for one physical batch."""

    method: str
    batch_size: int
    layers: list

    requested: str = "auto"
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
        if self.requested == "auto":
            return f"auto chose {self.method}: {why}"
        return f"{self.method}: {why}"

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


def plan(model, input_shape, batch_size, method="auto", input_dtype="float32"):
    """Plans per-example norm computation for each trainable layer.

    Args:
        model: keras.Model. The model to train.
        input_shape: tuple. One example's input shape, without the batch.
        batch_size: int. The physical batch size.
        method: str. A clipping method; "auto" resolves as in training.
            Defaults to "auto".
        input_dtype: str. Dtype of the probe input. Defaults to "float32".

    Returns:
        A `DPPlan`; `print(plan)` shows the table.
    """
    requested = method
    method = clipping.resolve_method(model, method)
    rules.install_taps(model)
    probe = tf.zeros((1,) + tuple(input_shape), dtype=input_dtype)
    with layer_taps.recording() as recorder:
        model(probe, training=False)
    groups = {}
    for record in recorder.records:
        groups.setdefault(id(record.layer), []).append(record)
    layers = []
    for records in groups.values():
        layer = records[0].layer
        rule = layer._tfdp_rule
        params = sum(int(v.numpy().size) for v in layer_taps.own_trainable_variables(layer))
        cost = rule.cost(layer, records, method, batch_size)
        layers.append(LayerPlan(
            layer.name, rule.name, cost.t, cost.p, cost.d, cost.mode, params,
            cost.memory_bytes, cost.kept_bytes, pixel_gram=cost.pixel_gram, why=cost.why,
        ))
    return DPPlan(method, batch_size, layers, requested, rules.notes(model))
