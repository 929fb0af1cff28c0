"""State a model holds before its first private step: adapted statistics, loaded buffers.

DP-SGD's ε covers what the noisy updates release. A model can also carry
values that no update wrote: `keras.layers.Normalization().adapt(x)` stores
the exact mean and variance of `x`; a `StringLookup`, `IntegerLookup` or
`TextVectorization` adapted on the data stores its vocabulary (which tokens
occur, hence whose); a `Discretization` adapted on it stores its quantiles;
the moving statistics of a frozen `BatchNormalization` are whatever data
they were last computed on. When that data is the private data, the
released model publishes them exactly, and ε does not cover them.

`find_adapted_state(model)` lists such state, so that every route can say
so before training:
- the layers above when adapted (a `Normalization` built without `mean=`,
  a lookup or `TextVectorization` without `vocabulary=`, a
  `Discretization` without `bin_boundaries=`, after `adapt` or any other
  way of setting their state);
- any other non-trainable state variable (created with `trainable=False`,
  such as BatchNorm's moving statistics) whose layer keeps its initializer
  as `<variable name>_initializer`, as Keras' layers do, where that
  initializer is deterministic (zeros, ones, a constant, the identity)
  and the value differs from it.

Not listed: trainable variables and the parameters of frozen layers (the
initial weights, which DP-SGD assumes public, as it assumes of every
initial weight), Keras' random-seed state, optimizer and metric
variables (not the model's), and state declared public with
`declare_public`. `tfdp.models.load_pretrained` declares what it loads
public: the documentation treats pretrained weights as public data.
State of a layer of your own that does not keep its initializer is not
checked.
"""

import collections
import warnings
import weakref

import keras
import numpy as np

# Printed lines of state, at most; the rest is counted.
DESCRIBE_LIMIT = 10
# The attribute that marks a layer or a variable as declared public.
_PUBLIC_MARK = "_tfdp_declared_public"
# The models whose adapted state was announced, with what was announced.
_ANNOUNCED = weakref.WeakKeyDictionary()
_DETERMINISTIC_INITIALIZERS = (keras.initializers.Zeros, keras.initializers.Ones,
                               keras.initializers.Constant, keras.initializers.Identity)
_LOOKUP_LAYERS = (keras.layers.StringLookup, keras.layers.IntegerLookup)

AdaptedState = collections.namedtuple("AdaptedState", ["layer", "variable", "reason"])
AdaptedState.__doc__ = """One value the model holds before training that ε does not cover.

Args:
    layer: str. The layer's name.
    variable: str. The variable's path (`layer/mean`), or the layer's path
        and what it holds (`string_lookup/vocabulary`) for state that is no
        Keras variable.
    reason: str. Why it is listed.
"""


def declare_public(layer_or_variable):
    """Declares state public: computed from public data, it is no longer listed.

    Declare only what did not come from the private data: statistics
    adapted on a public dataset, a vocabulary from a public corpus,
    pretrained weights. A layer's declaration covers its sublayers and
    every variable it has or builds later; declaring a model declares all
    of its layers. The mark lives on the Python objects: a model loaded
    from a file, or cloned, must be declared again.

    Args:
        layer_or_variable: a `keras.layers.Layer` (a model too) or a
            `keras.Variable`.

    Returns:
        `layer_or_variable`.

    Raises:
        ValueError: for anything else.
    """
    if isinstance(layer_or_variable, keras.layers.Layer):
        for layer in layer_or_variable._flatten_layers(include_self=True, recursive=True):
            object.__setattr__(layer, _PUBLIC_MARK, True)
    elif isinstance(layer_or_variable, keras.Variable):
        setattr(layer_or_variable, _PUBLIC_MARK, True)
    else:
        raise ValueError(
            "declare_public takes a Keras layer, model or variable. "
            f"Received: {type(layer_or_variable).__name__}")
    return layer_or_variable


def _is_public(obj):
    return bool(getattr(obj, _PUBLIC_MARK, False))


def find_adapted_state(model):
    """The state `model` holds that no private update wrote and ε does not cover.

    See the module docstring for what is listed. Reads variable values, so
    call it eagerly (outside a traced function).

    Args:
        model: `keras.Model` (or any Keras layer). A private model's inner
            model or the wrapper: both hold the same layers.

    Returns:
        A list of `AdaptedState`, in layer order.
    """
    found = []
    inside_text_vectorization = set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if id(layer) in inside_text_vectorization:
            continue
        if isinstance(layer, keras.layers.TextVectorization):
            # Its vocabulary sits in an inner lookup layer: name the outer one.
            inside_text_vectorization.update(
                id(inner) for inner in layer._flatten_layers(include_self=False))
        if _is_public(layer):
            continue
        found.extend(_layer_state(layer))
    return found


def _layer_state(layer):
    """The `AdaptedState` of one layer (its own variables, not its sublayers')."""
    kind = type(layer).__name__
    if isinstance(layer, keras.layers.Normalization):
        if layer.input_mean is not None or not layer.built:
            return []  # `mean=` and `variance=` were given: constants of the caller's.
        return [AdaptedState(layer.name, v.path,
                             f"{kind} adapted: the exact {what} of the data it was adapted on")
                for v, start, what in ((layer.adapt_mean, 0.0, "mean"),
                                       (layer.adapt_variance, 1.0, "variance"))
                if not _is_public(v) and not np.all(_value(v) == start)]
    if isinstance(layer, keras.layers.Discretization):
        if layer.num_bins is None or not layer.bin_boundaries:
            return []  # `bin_boundaries=` were given.
        return [AdaptedState(layer.name, f"{layer.name}/bin_boundaries",
                             f"{kind} adapted: quantiles of the data it was adapted on")]
    if isinstance(layer, keras.layers.TextVectorization):
        lookups = [inner for inner in layer._flatten_layers(include_self=False)
                   if isinstance(inner, _LOOKUP_LAYERS)]
        if any(_vocabulary_adapted(inner) for inner in lookups):
            return [AdaptedState(layer.name, f"{layer.name}/vocabulary",
                                 f"{kind} adapted: the tokens of the data it was adapted on")]
        return []
    if isinstance(layer, _LOOKUP_LAYERS):
        if _vocabulary_adapted(layer):
            return [AdaptedState(layer.name, f"{layer.name}/vocabulary",
                                 f"{kind} adapted: the tokens of the data it was adapted on")]
        return []
    found = []
    seed_states = {id(s.state) for s in getattr(layer, "_seed_generators", [])}
    # Own state only: a frozen layer's parameters are in `_trainable_variables`.
    for variable in getattr(layer, "_non_trainable_variables", []):
        if (_is_public(variable) or id(variable) in seed_states
                or variable.name == "seed_generator_state"):
            continue
        initializer = getattr(layer, f"{variable.name}_initializer", None)
        if initializer is None:
            continue  # Not knowable: a layer of the user's own.
        try:
            initializer = keras.initializers.get(initializer)
        except ValueError:
            continue
        if not isinstance(initializer, _DETERMINISTIC_INITIALIZERS):
            continue
        start = np.asarray(initializer(shape=variable.shape, dtype=variable.dtype))
        if not np.array_equal(_value(variable), start):
            found.append(AdaptedState(
                layer.name, variable.path,
                f"{kind} state set before training (differs from its "
                f"{type(initializer).__name__.lower()} initializer)"))
    return found


def _vocabulary_adapted(layer):
    """Whether a lookup layer holds a vocabulary it was not constructed with."""
    return (layer.input_vocabulary is None
            and len(layer.get_vocabulary(include_special_tokens=False)) > 0)


def _value(variable):
    return np.asarray(keras.ops.convert_to_numpy(variable.value))


def describe_adapted_state(found, *, limit=DESCRIBE_LIMIT):
    """The lines that announce `found`: what is listed, why, and what to do.

    Args:
        found: list of `AdaptedState` (`find_adapted_state`), not empty.
        limit: int. State lines shown at most; the rest are counted.
            Defaults to `DESCRIBE_LIMIT`.

    Returns:
        str, one line per entry after a headline, ending with how to declare
        the state public or compute it privately.
    """
    lines = [f"adapted state: {len(found)} value(s) set before training are NOT COVERED "
             "by epsilon unless they came from public data (the released model holds "
             "them exactly):"]
    lines += [f"  {entry.variable}: {entry.reason}" for entry in found[:limit]]
    if len(found) > limit:
        lines.append(f"  ... and {len(found) - limit} more")
    lines.append("  Computed from public data: tfdp.declare_public(layer) before training. "
                 "From private data: pass constants instead (e.g. Normalization(mean=..., "
                 "variance=...)) computed by a DP mechanism whose epsilon you add to the "
                 "budget (docs/KERAS.md, \"State set before training\").")
    return "\n".join(lines)


def as_records(found):
    """`found` as JSON-ready dicts (`summary.json`)."""
    return [entry._asdict() for entry in found]


def warn_adapted_state(model):
    """Warns (`UserWarning`) of `model`'s adapted state; once per model and list.

    The Keras and TF-Privacy-compat routes call it before the first private
    update; the warning comes again only if the list changed.

    Args:
        model: `keras.Model`.

    Returns:
        The list of `AdaptedState` found.
    """
    found = find_adapted_state(model)
    key = tuple(found)
    if found and _ANNOUNCED.get(model) != key:
        warnings.warn(describe_adapted_state(found), UserWarning, stacklevel=2)
    _ANNOUNCED[model] = key
    return found
