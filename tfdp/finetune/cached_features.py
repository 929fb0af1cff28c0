"""Private training of the last layer(s) on cached features of a frozen backbone.

When only the head of a model trains and the backbone before it is frozen,
each example's features are a fixed function of that example and of the
backbone's public weights. Training the head privately on features
computed once releases exactly what training it through the frozen
backbone releases: the same weights for the same key and data, and the
same ε for the same noise, sampling and steps. It is much faster: the
backbone runs once per example instead of once per step.

That holds only for a backbone whose forward pass in training mode (Keras
`fit` calls the model with `training=True`) equals its pass in inference
mode, per example, with no trainable weight and no state written from the
data. `cache_features` checks this before computing anything and refuses
other backbones.
"""

import keras
import numpy as np
import tensorflow as tf

from tfdp.dp import adapted_state
from tfdp.dp import layer_taps
from tfdp.dp import model_probe
from tfdp.finetune import heads as heads_lib

# Features cached per call of the backbone, by default. The check for
# mixing examples probes batches of this many rows, at a cost that grows
# with them (a small ViT on two CPU cores: 10 s at 64 rows, 37 s at 256).
DEFAULT_BATCH_SIZE = 64
# Rows of the probe batches that compare training and inference mode.
MODE_PROBE_ROWS = model_probe.MIN_PROBE_ROWS
# Relative tolerance (to the largest magnitude, at least 1) under which the
# outputs of the two modes count as equal: float round-off, not a change.
MODE_TOLERANCE = 1e-5


def split_last_layer(model, head=None):
    """Splits a Functional model into a backbone and the head that follows it.

    The cut is at the input of the head's first layer: the backbone maps
    the model's input to that tensor (the features), the head model maps
    the features to the model's output. Both share their layers, hence
    their variables, with `model`: training the head model trains
    `model`'s head, and `model` afterwards is the fine-tuned model. Nothing
    is frozen here: freeze the backbone before `cache_features`
    (`backbone.trainable = False`).

    Args:
        model: keras.Model. A built Functional or Sequential model with one
            input and one output.
        head: optional layer, layer name, or list of either, each a layer
            of the model's top-level graph. The head starts at the input of
            the first of them (in the model's layer order) and runs to the
            output. Defaults to None: the last Dense layer (`head_dense` of
            `tfdp.models.load_pretrained`'s models).

    Returns:
        `(backbone, head_model)`: two `keras.Model`s, named
        `"{model.name}_backbone"` and `"{model.name}_head"`.

    Raises:
        ValueError: for a model that is not Functional or Sequential, has
            several inputs or outputs, has no Dense layer and no `head`; for
            a `head` that is not one of its top-level layers, is called more
            than once, takes several inputs, or does not lead to the output;
            or where the output depends on the model's input other than
            through the head's input (a connection around the cut).
    """
    if not isinstance(model, keras.Model) or not model.built:
        raise ValueError(
            "split_last_layer needs a built keras.Model. "
            f"Received: model={getattr(model, 'name', model)!r}"
        )
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        inputs = outputs = None
    if not inputs or not outputs or len(inputs) != 1 or len(outputs) != 1:
        raise ValueError(
            "split_last_layer needs a Functional or Sequential model with one input and "
            f"one output (a graph of layers to cut). Received: model={model.name!r}"
        )
    heads = heads_lib.heads_of(model, head, "split_last_layer", top_level=True)
    order = {id(layer): i for i, layer in enumerate(model.layers)}
    first = min(heads, key=lambda layer: order[id(layer)])
    if len(first._inbound_nodes) != 1:
        raise ValueError(
            f"split_last_layer: the head layer {first.name!r} is called "
            f"{len(first._inbound_nodes)} times in the model, so its input is no single "
            f"cut. Received: head={first.name!r}"
        )
    features = first.input
    if not isinstance(features, keras.KerasTensor):
        raise ValueError(
            f"split_last_layer: the head layer {first.name!r} takes several inputs; the "
            f"features must be one tensor. Received: head={first.name!r}"
        )
    try:
        head_model = keras.Model(features, outputs[0], name=f"{model.name}_head")
    except ValueError as e:
        raise ValueError(
            f"split_last_layer: the model's output does not depend on the input of "
            f"{first.name!r} alone (a connection around the cut?): {e} "
            f"Received: head={first.name!r}"
        ) from e
    in_head = {id(layer) for layer in head_model.layers}
    for layer in heads:
        if id(layer) not in in_head:
            raise ValueError(
                f"split_last_layer: the head layer {layer.name!r} is not between the input "
                f"of {first.name!r} and the model's output. Received: head={head!r}"
            )
    backbone = keras.Model(inputs[0], features, name=f"{model.name}_backbone")
    return backbone, head_model


def _same(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return False
    scale = max(1.0, float(np.max(np.abs(a), initial=0.0)))
    return bool(np.max(np.abs(a - b), initial=0.0) <= MODE_TOLERANCE * scale)


def _tensors(nest):
    return [np.asarray(t) for t in tf.nest.flatten(nest)
            if isinstance(t, (tf.Tensor, tf.Variable, np.ndarray))]


def _layer_calls(model, x, training):
    """`model(x, training=training)` eagerly: (layer, inputs, outputs) per layer call.

    The calls are listed in order of completion, so that a sublayer comes
    before the layer or model that calls it.
    """
    calls = []
    patched = []

    def wrap(layer, original):
        def call(*args, **kwargs):
            outputs = original(*args, **kwargs)
            calls.append((layer, _tensors((args, kwargs)), _tensors(outputs)))
            return outputs

        return call

    for layer in heads_lib.all_layers(model):
        patched.append((layer, layer.__dict__.get("call")))
        layer.call = wrap(layer, layer.call)
    try:
        model(x, training=training)
    finally:
        for layer, previous in reversed(patched):
            if previous is not None:
                layer.call = previous
            else:
                object.__delattr__(layer, "call")
    return calls


def _both_modes(backbone, x, run):
    """`run(backbone, x, training)` for training=True, then False, from one random state.

    Returns:
        `(trained, inferred, draws)`: the two results, and whether the
        inference pass moved a random generator's state.
    """
    randomness = model_probe.RandomState(backbone)
    try:
        trained = run(backbone, x, True)
        randomness.restore()
        inferred = run(backbone, x, False)
        start = randomness.initial[0]
        draws = any(not np.array_equal(v.numpy(), start[id(v)]) for v in randomness.variables
                    if id(v) in randomness.random_ids)
    finally:
        # A training pass may move BatchNorm's moving statistics or a seed
        # generator: the backbone leaves the check as it came.
        randomness.restore()
    return trained, inferred, draws


def _mode_difference(backbone, x):
    """The first layer whose outputs on `x` differ between the modes, or None.

    Raises where the inference pass itself draws random values.

    The whole backbone's outputs are compared first (cheap); only if they
    differ are its layer calls recorded, to name the first layer whose
    outputs differ although its inputs do not (the backbone itself when no
    layer is to blame).
    """
    trained, inferred, draws = _both_modes(
        backbone, x, lambda model, inputs, training: _tensors(model(inputs, training=training)))
    if draws:
        raise ValueError(
            f"cache_features: the backbone {backbone.name!r} draws random values in "
            "inference mode. Features cached once would hold one draw; training "
            "through the backbone draws anew at every step. Remove the randomness or "
            f"train without a cache. Received: backbone={backbone.name!r}"
        )
    if len(trained) == len(inferred) and all(map(_same, trained, inferred)):
        return None
    trained, inferred, _ = _both_modes(backbone, x, _layer_calls)
    for (layer, a_in, a_out), (_, b_in, b_out) in zip(trained, inferred):
        inputs_same = len(a_in) == len(b_in) and all(map(_same, a_in, b_in))
        outputs_same = len(a_out) == len(b_out) and all(map(_same, a_out, b_out))
        if inputs_same and not outputs_same:
            return layer
    return backbone


def _declared_input(model):
    """The model's one declared input tensor, or None."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    return inputs[0] if inputs and len(inputs) == 1 else None


def _input_spec(backbone, x):
    """One example's shape and dtype: the backbone's declared input, else `x`'s."""
    declared = _declared_input(backbone)
    if declared is not None:
        return tuple(declared.shape[1:]), declared.dtype
    if x is None:
        raise ValueError(
            "check_cacheable needs `x` for a backbone without one declared input. "
            f"Received: backbone={backbone.name!r}, x=None"
        )
    return tuple(x.shape[1:]), x.dtype


def check_cacheable(backbone, x=None, batch_size=DEFAULT_BATCH_SIZE):
    """Raises unless features of `backbone` may stand for it in private training.

    The features are computed once, in inference mode, in batches of
    `batch_size`; training through the backbone would run it in training
    mode at every step. The two give the same features only if:
    - no backbone weight trains;
    - each layer's training-mode outputs equal its inference-mode outputs,
      compared on public probe batches (`tfdp.dp.model_probe.probe_inputs`,
      never the data): no dropout, noise or random augmentation active in
      training, no BatchNormalization normalising with batch statistics;
    - the inference pass draws no random values (a feature computed once
      must be the feature of every step);
    - no layer mixes the examples of a batch or writes state from it
      (`tfdp.dp.model_probe.probe` at `batch_size` rows).
    It also announces the backbone's adapted state, as a private fit of the
    whole model would (`tfdp.dp.adapted_state.warn_adapted_state`): ε does
    not cover statistics adapted on private data.

    Args:
        backbone: keras.Model. A built model, e.g. from `split_last_layer`.
        x: optional array. Inputs, whose per-example shape and dtype stand
            in for a backbone without a declared input; never read
            otherwise. Defaults to None.
        batch_size: int. Rows per call when the features are computed.
            Defaults to `DEFAULT_BATCH_SIZE`.

    Raises:
        ValueError: naming the first layer that fails a condition above.
    """
    for layer in [*heads_lib.all_layers(backbone), backbone]:
        trainable = layer_taps.own_trainable_variables(layer)
        if trainable:
            raise ValueError(
                f"cache_features needs a frozen backbone: layer {layer.name!r} has "
                f"trainable weights ({', '.join(v.path for v in trainable)}). Features "
                "computed once would not follow their training. Freeze it "
                "(`backbone.trainable = False`) or train the whole model without "
                f"a cache. Received: layer={layer.name!r}, variable={trainable[0].path!r}"
            )
    if backbone.trainable_weights:
        raise ValueError(
            "cache_features needs a frozen backbone: it has trainable weights that no "
            f"layer owns ({', '.join(v.path for v in backbone.trainable_weights)}). "
            f"Freeze them. Received: variable={backbone.trainable_weights[0].path!r}"
        )
    shape, dtype = _input_spec(backbone, x)
    # One batch of rows from every public value range: one pass per mode.
    probe = tf.concat([model_probe.probe_inputs(backbone, shape, dtype, MODE_PROBE_ROWS,
                                                value_range=value_range)[0]
                       for value_range in model_probe.probe_value_ranges(dtype)], axis=0)
    layer = _mode_difference(backbone, probe)
    if layer is not None:
        raise ValueError(
            f"cache_features: layer {layer.name!r} ({type(layer).__name__}) computes "
            "other outputs in training mode than in inference mode (e.g. dropout, "
            "noise or random augmentation, or BatchNormalization with batch "
            "statistics). Training through the backbone runs it with training=True; "
            "features cached in inference mode would not be what that training "
            "sees. Freeze such a layer in inference mode (`layer.trainable = False` "
            "for BatchNormalization), remove it, or train without a cache. "
            f"Received: layer={layer.name!r}"
        )
    if _declared_input(backbone) is not None:
        report = model_probe.probe(backbone, rows=batch_size)
    else:
        report = model_probe.probe(backbone, tf.zeros((batch_size,) + shape, dtype))
    report.refuse_mixing()
    report.refuse_state_writes()
    adapted_state.warn_adapted_state(backbone)


def cache_features(backbone, x, batch_size=DEFAULT_BATCH_SIZE, path=None):
    """The backbone's features of every example of `x`, computed once.

    Checks first that the features may stand for the backbone in private
    training (`check_cacheable`: frozen, the same in training and inference
    mode, no mixing of examples, no state written), then runs
    `backbone(batch, training=False)` on `x` in order, `batch_size` rows at
    a time. Train the head model of `split_last_layer` on the result with
    the labels of `x`, as the whole model would be trained on `x`: the
    release and its ε are those of that training.

    The features are private data, exactly as the images are: each row
    is a function of one private example. Keep them where the private data
    is kept, never release them, and delete them with the run's data. They
    live in memory (the returned array), or with `path` in that `.npy` file,
    which this writes (replacing any file there) and reads back as a
    read-only memory map.

    Args:
        backbone: keras.Model. A frozen backbone, e.g. from `split_last_layer`.
        x: array `[N, ...]`. The inputs, in the order of their labels.
        batch_size: int. Rows per call of the backbone. Defaults to
            `DEFAULT_BATCH_SIZE`.
        path: optional str or path-like. A `.npy` file to write the features
            to. Defaults to None (in memory).

    Returns:
        A numpy array `[N, *feature_shape]` of the backbone's output dtype,
        or with `path` a read-only `np.memmap` of the file.

    Raises:
        ValueError: for `batch_size` below 1, an `x` without examples, a backbone that
            `check_cacheable` refuses, or for a `path` not ending in `.npy`.
    """
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be at least 1. Received: batch_size={batch_size}")
    batch_size = int(batch_size)
    if path is not None and not str(path).endswith(".npy"):
        raise ValueError(f"path must name a .npy file. Received: path={str(path)!r}")
    x = x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)
    if not x.shape or int(x.shape[0]) == 0:
        raise ValueError(f"x holds no example. Received: x.shape={tuple(x.shape)}")
    check_cacheable(backbone, x, batch_size)

    # One tracing for every batch, the last (smaller) one included.
    @tf.function(input_signature=[tf.TensorSpec((None,) + tuple(x.shape[1:]), x.dtype)])
    def features_of(batch):
        return backbone(batch, training=False)

    n = int(x.shape[0])
    features = None
    for start in range(0, n, batch_size):
        batch = features_of(tf.convert_to_tensor(x[start:start + batch_size])).numpy()
        if features is None:
            shape = (n,) + batch.shape[1:]
            features = (np.empty(shape, batch.dtype) if path is None else
                        np.lib.format.open_memmap(str(path), mode="w+", dtype=batch.dtype,
                                                  shape=shape))
        features[start:start + batch_size] = batch
    if path is None:
        return features
    features.flush()
    del features
    return np.load(str(path), mmap_mode="r")
