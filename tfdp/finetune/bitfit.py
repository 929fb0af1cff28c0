"""BiTFiT: private fine-tuning of the bias terms and the head alone.

Bu et al. (2022, "Differentially private bias-term fine-tuning of foundation
models") train only the biases of a pretrained model (and a new head): a
small fraction of the parameters, so less noise in total, and per-example
gradients that need no weight-gradient work, since a bias's per-example
gradient is the layer's output gradient summed over its positions. The
per-layer rules (`tfdp.dp.rules`) skip a frozen kernel's norm and sum.
"""

import dataclasses
import math

from tfdp.dp import rules


@dataclasses.dataclass
class BitFitSummary:
    """What trains after `bitfit`.

    Attributes:
        trainable_params: int. Parameters that train.
        total_params: int. All the model's parameters (`model.count_params()`).
        trainable: list of str. The paths of the variables that train.
        head: list of str. The names of the head layers, which train whole.
    """

    trainable_params: int
    total_params: int
    trainable: list
    head: list

    def __str__(self):
        share = self.trainable_params / max(self.total_params, 1)
        return (f"BiTFiT: {self.trainable_params:,} of {self.total_params:,} parameters "
                f"train ({share:.2%}): {len(self.trainable)} variables, the head "
                f"{', '.join(repr(h) for h in self.head)} whole, and the biases")


def _size(variable):
    return math.prod(int(n) for n in variable.shape)


def _layers(model):
    return list(model._flatten_layers(include_self=False, recursive=True))


def default_head(model, caller="bitfit"):
    """The default head: the last Dense layer in the model's layer order.

    Args:
        model: keras.Model.
        caller: str. The function named in the error. Defaults to "bitfit".

    Returns:
        A one-element list: the last layer whose clipping rule is "dense".

    Raises:
        ValueError: where the model has no such layer.
    """
    dense = [layer for layer in _layers(model)
             if layer.weights and rules.rule_for(layer).name == "dense"]
    if not dense:
        raise ValueError(
            f"{caller} found no head: the model has no Dense layer. Pass the layer(s) that "
            f"train whole as `head`. Received: model={model.name!r}, head=None"
        )
    return [dense[-1]]


def named_heads(model, head, caller="bitfit"):
    """The layers `head` names: a layer, a name, or a list of either.

    Args:
        model: keras.Model.
        head: a layer, a layer name, or a list of either.
        caller: str. The function named in errors. Defaults to "bitfit".

    Returns:
        list of layers.

    Raises:
        ValueError: for an item that is not a layer of the model, or a layer
            that owns no variables.
    """
    items = [head] if isinstance(head, str) or not isinstance(head, (list, tuple)) else head
    by_name = {layer.name: layer for layer in _layers(model)}
    found = []
    for item in items:
        layer = by_name.get(item) if isinstance(item, str) else item
        if layer is None or not any(layer is other for other in by_name.values()):
            raise ValueError(
                f"{caller}: the head {item!r} is not a layer of the model "
                f"{model.name!r}. Received: head={head!r}"
            )
        if not layer.weights:
            raise ValueError(
                f"{caller}: the head layer {layer.name!r} owns no variables to train. "
                f"Received: head={head!r}"
            )
        found.append(layer)
    return found


def bitfit(model, head=None):
    """Freezes all but the biases, the normalisation offsets and the head.

    What trains afterwards:
    - every bias and every normalisation β (GroupNormalization,
      LayerNormalization) of a trainable layer; each layer's clipping rule
      says which of its variables are offsets (`tfdp.dp.rules.offset_variables`).
      BatchNormalization stays frozen, β included: trained, it would
      normalise with batch statistics, which mixes examples;
    - the head, whole: by default the last Dense layer.
    Everything else is frozen variable by variable (`variable.trainable =
    False`), so the layers stay trainable and `model.trainable_variables`
    lists exactly what trains. A layer frozen before the call stays frozen:
    `bitfit` narrows what trains, except for the head, which it unfreezes.

    Call it after building (or loading) the model and before compiling it
    or making it private.

    Args:
        model: keras.Model. A built model.
        head: optional layer, layer name, or list of either. The layers that
            train whole. Defaults to None (the last Dense layer).

    Returns:
        `BitFitSummary`: what trains and how many parameters.

    Raises:
        ValueError: for an unbuilt model, a model without a Dense layer and
            no `head`, a `head` that is not one of its layers or owns no
            variables, or a model of which nothing would train.
    """
    if not model.built:
        raise ValueError(
            "bitfit needs a built model (its variables exist once it is built). "
            f"Received: model={model.name!r} (not built)"
        )
    heads = default_head(model) if head is None else named_heads(model, head)
    keep = {id(v) for _, v in rules.offset_variables(model)}
    for layer in heads:
        layer.trainable = True
        keep.update(id(v) for v in layer.weights)
    for variable in model.weights:
        # Non-trainable state (e.g. BatchNorm's moving statistics) stays so.
        if variable.trainable:
            variable.trainable = id(variable) in keep
    trainable = model.trainable_variables
    if not trainable:
        raise ValueError(
            "bitfit left nothing to train: the model has no trainable bias or "
            f"normalisation offset and its head trains nothing. Received: model={model.name!r}"
        )
    return BitFitSummary(
        trainable_params=sum(_size(v) for v in trainable),
        total_params=int(model.count_params()),
        trainable=[v.path for v in trainable],
        head=[layer.name for layer in heads],
    )
