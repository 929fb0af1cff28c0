"""The registry of per-layer clipping rules (cf. Opacus `register_grad_sampler`).

A rule tells the tapped clipping methods ("ghost", "mixed", "bk") how to get,
for one layer that owns trainable variables, each example's squared gradient
norm and the clipped sum Σ_i c_i·g_i, from the layer's recorded calls
(`layer_taps.TapRecord`) and the output gradients of one batched backward
pass. It also estimates the layer's share of the work memory for `dp.plan`.

Adding a layer type is one module that subclasses `Rule`, decorates it with
`@register_rule(LayerClass, ...)`, and is imported by `tfdp.dp.rules`; plus
`tests/dp/rules/test_<rule>.py`, which calls the shared naive-equivalence
helper.
"""

import dataclasses
import math

import tensorflow as tf

from tfdp.dp import layer_grads
from tfdp.dp import layer_taps

_RULES = {}  # Layer class -> rules registered for it, latest first.

BYTES = 4  # Clipping arithmetic is float32.
TAPPED_METHODS = ("ghost", "mixed", "bk")


def register_rule(*layer_classes):
    """Class decorator: registers a `Rule` subclass for `layer_classes`.

    The rule of a layer is the first registered rule whose `applies(layer)`
    holds, searching the layer's class and then its bases (MRO order), so a
    rule for a subclass takes precedence over one for its base class.

    Args:
        *layer_classes: Keras layer classes the rule handles.

    Returns:
        The decorator; it returns the class unchanged.
    """

    def decorate(rule_class):
        rule = rule_class()
        for cls in layer_classes:
            _RULES.setdefault(cls, []).insert(0, rule)
        return rule_class

    return decorate


def rule_for(layer):
    """The registered `Rule` instance that handles `layer`."""
    for cls in type(layer).__mro__:
        for rule in _RULES.get(cls, ()):
            if rule.applies(layer):
                return rule
    raise ValueError(  # The generic rule, registered for keras.layers.Layer, applies to all.
        f"No clipping rule for layer '{layer.name}'. Received: layer={layer!r}"
    )


def check_layer(layer):
    """Raises where `layer`'s rule refuses it (`Rule.check`)."""
    rule_for(layer).check(layer)


layer_taps.add_layer_check(check_layer)


def weight_decay_variables(model, trainable_only=True):
    """The variables that weight decay applies to: tfdp's one list of them.

    Each layer's rule answers for its own variables (`Rule.decays`): conv,
    dense and einsum kernels, the variables the paper decays; biases and
    norm parameters are left alone. The engine's in-loss decay and
    `tfdp.optim.weight_decay_variables` both ask here.

    Args:
        model: keras.Model. Nested models and layers are searched.
        trainable_only: bool. Leave out the variables of frozen layers.
            Defaults to `True`.

    Returns:
        list of variables, in layer order, each once (a shared layer is
        listed once).
    """
    found = []
    seen = set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if trainable_only:
            variables = layer_taps.own_trainable_variables(layer)
        else:
            variables = layer_taps.own_variables(layer)
        if not variables:
            continue
        rule = rule_for(layer)
        for v in variables:
            if id(v) not in seen and rule.decays(layer, v):
                seen.add(id(v))
                found.append(v)
    return found


def offset_variables(model):
    """The additive offsets of `model`: biases and normalisation β.

    Each layer's rule answers for its own variables (`Rule.is_offset`).
    Bias-term fine-tuning (`tfdp.finetune.bitfit`) trains these alone,
    besides the head. A frozen layer's offsets are left out, and so are a
    BatchNormalization's: its β trains only with the layer, which would then
    normalise with batch statistics.

    Args:
        model: keras.Model. Nested models and layers are searched.

    Returns:
        list of (layer, variable), in layer order, each variable once.
    """
    found = []
    seen = set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if not layer.trainable:
            continue
        variables = layer_taps.own_variables(layer)
        if not variables:
            continue
        rule = rule_for(layer)
        for v in variables:
            if id(v) not in seen and rule.is_offset(layer, v):
                seen.add(id(v))
                found.append((layer, v))
    return found


def trains(layer, variable):
    """Whether `variable` is one of `layer`'s own trainable variables.

    A rule asks before working on a variable: a kernel frozen while its bias
    trains (`tfdp.finetune.bitfit`) needs no per-example gradient, norm or
    sum.
    """
    return any(v is variable for v in layer_taps.own_trainable_variables(layer))


def offsets_only_cost(layer, t, p, d, batch_size):
    """The `Cost` of a layer whose trainable variables are all offsets.

    An offset added at every position has the per-example gradient Σ_t G_i,
    a few floats per example, computed from the output gradient alone: none
    of the frozen kernel's ghost-norm or per-example work.

    Args:
        layer: keras.layers.Layer. The layer.
        t, p, d: int. Its dimensions, as the rule reports them.
        batch_size: int. The physical batch size.
    """
    floats = sum(math.prod(int(n) for n in v.shape)
                 for v in layer_taps.own_trainable_variables(layer))
    memory = batch_size * floats * BYTES
    return Cost(t, p, d, layer_grads.INSTANTIATE, memory, memory, why="kernel frozen: bias only")


def notes(model):
    """(layer name, note) for layers that a rule accepts with a remark (`Rule.note`)."""
    found = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        note = rule_for(layer).note(layer)
        if note:
            found.append((layer.name, note))
    return found


def layerwise_why(t, p, d, method, ghost_kept=None):
    """Why `layer_grads.linear_norm_mode` chose its mode, for `dp.plan`."""
    if method == "ghost":
        return "method=ghost"
    if t == 1:
        return "T=1"
    if 2 * t * t >= p * d:
        return "2T²≥pD"
    if layer_grads.linear_norm_mode(t, p, d, method, ghost_kept) == layer_grads.INSTANTIATE:
        return "2T²<pD, but bk: pD≤input+output"
    return "2T²<pD"


def install_taps(model):
    """Patches every trainable layer of `model` once with its rule's tap.

    Returns:
        The tapped layers (`layer_taps.tapped_layers`).
    """
    layers = layer_taps.tapped_layers(model)
    for layer in layers:
        if getattr(layer, "_tfdp_original_call", None) is None:
            rule = rule_for(layer)
            original = layer.call
            layer._tfdp_original_call = original
            layer._tfdp_rule = rule
            layer.call = rule.tapped_call(layer, original)
    return layers


def is_float32(layer):
    """Whether the layer computes and stores its variables in float32."""
    return (
        getattr(layer, "compute_dtype", None) == "float32"
        and all(v.dtype == "float32" for v in getattr(layer, "_trainable_variables", []))
    )


def is_plain(layer):
    """Not quantized and without LoRA: the kernel is the variable used."""
    return (
        getattr(layer, "quantization_mode", None) is None
        and not getattr(layer, "lora_enabled", False)
    )


@dataclasses.dataclass
class ClipContext:
    """What a rule needs to know about the step besides the layer's records.

    Attributes:
        method: str. "ghost", "mixed" or "bk".
        k: int. Rows per example (augmentation multiplicity).
    """

    method: str
    k: int = 1


@dataclasses.dataclass
class Cost:
    """A rule's plan for one layer: its dimensions, norm mode and memory.

    Attributes:
        t: int. Positions per example (T), 0 where not meaningful.
        p: int. Output width.
        d: int. Input width (D), unfolded for a conv.
        mode: str. "ghost" or "instantiate".
        memory_bytes: int. Work memory of the layer's norm for the physical
            batch, freed once the norm is computed (layers take turns).
        kept_bytes: int. What "bk" keeps from the layer's norm until the
            clipped sums: its per-example gradients, or its output gradient
            for a ghost norm.
        pixel_gram: bool. A conv ghost norm whose U Uᵀ comes from the pixel
            Gram (`rules.conv.conv_input_gram`).
        why: str. Why the mode, in a few words (e.g. "2T²<pD").
    """

    t: int
    p: int
    d: int
    mode: str
    memory_bytes: int
    kept_bytes: int = 0
    pixel_gram: bool = False
    why: str = ""


class LayerClip:
    """One layer's per-example squared norms and clipped sums in one step.

    Attributes:
        variables: list. The layer's own trainable variables.
        from_backward: bool. Whether "ghost"/"mixed" may take this layer's
            clipped sum from the second backward pass on Σ_i c_i·L_i. Only
            where that pass computes exactly what the norm was computed from
            (float32 compute, no recomputation); otherwise the sum is formed
            here from the same factors as the norm.
    """

    variables = ()
    from_backward = False

    def sq_norm(self, variable):
        """[B] squared norms of the per-example gradients of `variable`."""
        raise NotImplementedError

    def dot(self, variable):
        """[B] ⟨g_i, variable⟩: the cross term of in-loss weight decay."""
        raise NotImplementedError

    def clipped_sum(self, variable, coeffs, keep=None):
        """Σ_i c_i·g_i for `variable`, dropping examples where `keep` is False."""
        raise NotImplementedError


def weighted_sum(coeffs, per_example):
    """Σ_i c_i·x_i over the leading axis; a zero coefficient drops NaN rows."""
    shape = tf.concat([[-1], tf.ones([tf.rank(per_example) - 1], tf.int32)], 0)
    return tf.reduce_sum(tf.math.multiply_no_nan(per_example, tf.reshape(coeffs, shape)), 0)


class PerExampleClip(LayerClip):
    """A `LayerClip` from instantiated per-example gradients [B, ...]."""

    def __init__(self, variables, per_example):
        self.variables = list(variables)
        self._grads = {id(v): g for v, g in zip(self.variables, per_example)}

    def sq_norm(self, variable):
        g = self._grads[id(variable)]
        return tf.reduce_sum(tf.reshape(tf.square(g), [tf.shape(g)[0], -1]), 1)

    def dot(self, variable):
        g = self._grads[id(variable)]
        w = tf.cast(tf.convert_to_tensor(variable), g.dtype)
        return tf.reduce_sum(tf.reshape(g * w[None], [tf.shape(g)[0], -1]), 1)

    def clipped_sum(self, variable, coeffs, keep=None):
        return weighted_sum(coeffs, self._grads[id(variable)])


class Rule:
    """How the tapped clipping methods handle one kind of layer.

    Subclasses set `name` (shown in plans) and override `clip` and `cost`;
    `applies` narrows the registered classes (e.g. to an unmodified `call`),
    `tapped_call` records what `clip` needs, `decays` says which variables
    take weight decay by default, `is_offset` which are biases, and `check`
    and `note` refuse or remark on a layer (also one without trainable
    variables). `clip` and `cost` cover the layer's trainable variables
    only (`trains`): a frozen variable costs nothing.
    """

    name = "rule"

    def applies(self, layer):
        """Whether this rule handles `layer` (an instance of a registered class)."""
        return True

    def check(self, layer):
        """Raises a `ValueError` naming the cause where no method can clip `layer`."""

    def note(self, layer):
        """A remark for `dp.plan` on a layer this rule accepts, or None."""
        return None

    def decays(self, layer, variable):
        """Whether in-loss weight decay applies to `variable` by default."""
        return False

    def is_offset(self, layer, variable):
        """Whether `variable` is an additive offset (a bias, a normalisation β).

        What bias-term fine-tuning trains (`offset_variables`).
        """
        return False

    def tapped_call(self, layer, original):
        """The `call` installed on `layer`: records each call when taps are on."""
        return layer_taps.record_call(layer, original)

    def clip(self, layer, records, output_grads, context):
        """The layer's `LayerClip` for one step.

        Args:
            layer: keras.layers.Layer. The layer.
            records: list of `layer_taps.TapRecord`. Its calls in this step.
            output_grads: list of tensors. ∂(Σ_i L_i)/∂(recorded output), per call.
            context: `ClipContext`.
        """
        raise NotImplementedError

    def cost(self, layer, records, method, batch_size):
        """The layer's `Cost` for `dp.plan` (records from a batch of one).

        Args:
            layer: keras.layers.Layer. The layer.
            records: list of `layer_taps.TapRecord`. Its calls on the probe.
            method: str. The resolved clipping method.
            batch_size: int. The physical batch size.
        """
        raise NotImplementedError
