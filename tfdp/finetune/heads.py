"""The head of a model (the layers that train whole), found once for every mode.

`bitfit`, `lora`, `last_layer` and `split_last_layer` all default to the
last Dense layer (the last layer on the "dense" clipping rule) and accept
`head=`: a layer, a layer name, or a list of either. `train_only` then
freezes all but what a mode keeps, the same way for every mode.
"""

import math

from tfdp.dp import rules


def parameter_count(variables):
    """The number of parameters of `variables`."""
    return sum(math.prod(int(n) for n in v.shape) for v in variables)


def all_layers(model):
    """Every layer of `model`, nested ones included, in the model's order."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def _candidates(model, top_level):
    return list(model.layers) if top_level else all_layers(model)


def default_head(model, caller, top_level=False):
    """The default head: the last Dense layer in the model's layer order.

    Args:
        model: keras.Model.
        caller: str. The function named in the error.
        top_level: bool. Search the model's top-level graph only (where the
            model is to be cut there). Defaults to False.

    Returns:
        A one-element list: the last layer whose clipping rule is "dense".

    Raises:
        ValueError: where the model has no such layer.
    """
    dense = [layer for layer in _candidates(model, top_level)
             if layer.weights and rules.rule_for(layer).name == "dense"]
    if not dense:
        where = " in its top-level graph" if top_level else ""
        raise ValueError(
            f"{caller} found no head: the model has no Dense layer{where}. Pass the head "
            f"layer(s) as `head`. Received: model={model.name!r}, head=None")
    return [dense[-1]]


def named_heads(model, head, caller, top_level=False):
    """The layers `head` names: a layer, a name, or a list of either.

    Args:
        model: keras.Model.
        head: a layer, a layer name, or a list of either.
        caller: str. The function named in errors.
        top_level: bool. Only the model's top-level layers qualify.
            Defaults to False.

    Returns:
        list of layers.

    Raises:
        ValueError: for no item, an item that is not a layer of the model
            (of its top-level graph with `top_level`), or a layer that owns
            no variables.
    """
    items = [head] if isinstance(head, str) or not isinstance(head, (list, tuple)) else head
    if not items:
        raise ValueError(f"{caller}: `head` names no layer. Received: head={head!r}")
    candidates = _candidates(model, top_level)
    found = []
    for item in items:
        if isinstance(item, str):
            layer = next((layer for layer in candidates if layer.name == item), None)
        else:
            layer = next((layer for layer in candidates if layer is item), None)
        if layer is None:
            where = "the top-level graph of " if top_level else ""
            raise ValueError(
                f"{caller}: the head {item!r} is not a layer of {where}the model "
                f"{model.name!r}. Received: head={head!r}")
        if not layer.weights:
            raise ValueError(
                f"{caller}: the head layer {layer.name!r} owns no variables to train. "
                f"Received: head={head!r}")
        found.append(layer)
    return found


def heads_of(model, head, caller, top_level=False):
    """`default_head` where `head` is None, else `named_heads`."""
    if head is None:
        return default_head(model, caller, top_level)
    return named_heads(model, head, caller, top_level)


def train_only(model, heads, keep=()):
    """Freezes every variable of `model` but the `heads`' and those in `keep`.

    Variable by variable (`variable.trainable = False`), so the layers stay
    trainable and `model.trainable_variables` lists exactly what trains; the
    heads are unfrozen whole. Non-trainable state (e.g. BatchNorm's moving
    statistics) stays non-trainable.

    Args:
        model: keras.Model.
        heads: list of layers. They train whole.
        keep: iterable of variables. They train too.

    Returns:
        list of variables: `model.trainable_variables` afterwards.
    """
    kept = {id(v) for v in keep}
    for layer in heads:
        layer.trainable = True
        kept.update(id(v) for v in layer.weights)
    for variable in model.weights:
        if variable.trainable:
            variable.trainable = id(variable) in kept
    return model.trainable_variables
