"""Transfer-learning helpers: new heads, frozen sub-blocks, partial loading.

The paper's best private ImageNet run fine-tunes a Places365-pretrained
ResNet-18 with "3 frozen block groups". In tfdp terms that is
`freeze_sub_blocks(model, 4)`: `k` counts entries of
`("stem", "block_group1", "block_group2", "block_group3", "block_group4")`,
so `k=4` freezes the stem and block groups 1-3 while block group 4, the final
GroupNorm (`head_norm`) and `head_dense` train.
"""

import gin
import keras

from tfdp.models.sub_blocks import SUB_BLOCKS
from tfdp.models.sub_blocks import sub_block_layers

FREEZABLE_SUB_BLOCKS = SUB_BLOCKS[:5]


@gin.configurable(module="tfdp.models")
def replace_head(model, num_classes, layer_name="head_dense"):
    """Returns a model sharing every layer of `model` but a fresh classifier.

    The new `Dense(num_classes)` is built from the old one's config (same
    name, activation and initialisers), so it starts from a fresh draw of
    the same initialiser (Xavier for the tfdp ResNets). All other layers are
    the very same objects as in `model`: their weights, and their
    `trainable` flags, are shared, not copied.

    Args:
        model: keras.Model. A Functional model whose output is produced by
            `layer_name`.
        num_classes: int. Number of logits of the new head.
        layer_name: str. Name of the classifier layer. Defaults to
            `"head_dense"`.

    Returns:
        A new Functional `keras.Model` with the same inputs and name.
    """
    if num_classes < 1:
        raise ValueError(
            f"`num_classes` must be >= 1. Received: num_classes={num_classes}"
        )
    try:
        old = model.get_layer(layer_name)
    except ValueError:
        raise ValueError(
            f"The model has no layer named {layer_name!r}. "
            f"Received: layer_name={layer_name!r}"
        ) from None
    if not isinstance(old, keras.layers.Dense):
        raise ValueError(
            f"The head must be a Dense layer. Received: {layer_name!r} of type "
            f"{type(old).__name__}"
        )
    if len(model.outputs) != 1 or model.outputs[0] is not old.output:
        raise ValueError(
            f"The head layer must produce the model's only output, otherwise "
            f"layers after it would be lost. Received: layer_name={layer_name!r}"
        )
    config = old.get_config()
    config["units"] = num_classes
    head = keras.layers.Dense.from_config(config)
    outputs = head(old.input)
    # Pass a lone input as a tensor, not a list, so the new model accepts
    # the same call structure as the old one.
    inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
    return keras.Model(inputs, outputs, name=model.name)


@gin.configurable(module="tfdp.models")
def freeze_sub_blocks(model, k):
    """Freezes the first `k` of (stem, block_group1, ..., block_group4).

    `k=0` trains everything; `k=4` (the paper's "3 frozen block groups")
    freezes the stem and block groups 1-3; `k=5` leaves only the head
    (`head_norm`, `head_dense`) trainable. The layers of the remaining
    sub-blocks and of the head are set trainable, so calling this again with
    another `k` re-plans the freezing rather than accumulating it.

    Args:
        model: keras.Model. A model using the tfdp layer naming scheme.
        k: int. Number of leading sub-blocks to freeze, in `[0, 5]`.

    Returns:
        `model`, modified in place, for chaining.

    Raises:
        ValueError: if `k` is out of range or one of the sub-blocks to freeze
            has no layers in `model` (e.g. `block_group4` of a Wide ResNet).
    """
    if not isinstance(k, int) or not 0 <= k <= len(FREEZABLE_SUB_BLOCKS):
        raise ValueError(
            f"`k` must be an int in [0, {len(FREEZABLE_SUB_BLOCKS)}]. Received: k={k}"
        )
    for i, sub_block in enumerate(SUB_BLOCKS):
        layers = sub_block_layers(model, sub_block)
        frozen = i < k
        if frozen and not layers:
            raise ValueError(
                f"Cannot freeze {sub_block!r}: the model has no layer named "
                f"'{sub_block}_*'. Received: k={k}"
            )
        for layer in layers:
            layer.trainable = not frozen
    return model


def _load_source(source):
    if isinstance(source, keras.Model):
        return source
    path = str(source)
    if path.endswith(".keras"):
        return keras.models.load_model(path, compile=False)
    # `.weights.h5` files key variables by class-derived attribute names, not
    # by layer names, so they cannot be matched by name.
    raise ValueError(
        "`checkpoint_path_or_model` must be a keras.Model or a `.keras` file. "
        f"Received: checkpoint_path_or_model={source!r}"
    )


def _weighted_leaves(model, path=""):
    for layer in model.layers:
        layer_path = f"{path}/{layer.name}" if path else layer.name
        if isinstance(layer, keras.Model):
            yield from _weighted_leaves(layer, layer_path)
        elif layer.weights:
            yield layer_path, layer


def _skipped(path, skip):
    return path in skip or path.rsplit("/", 1)[-1] in skip


@gin.configurable(module="tfdp.models")
def load_weights_matching(model, checkpoint_path_or_model, skip=("head_dense",)):
    """Copies weights into `model` from a checkpoint, matching layers by name.

    Every layer with weights in either model is paired by name (the
    `/`-joined path for layers inside nested models) and every variable pair
    must have the same shape. Nothing is assigned unless all pairs match, so
    a failed call leaves `model` untouched.

    Args:
        model: keras.Model. The model to load into.
        checkpoint_path_or_model: str, path or keras.Model. A `.keras` file
            (loaded without compiling) or a model holding the source weights.
        skip: tuple of str. Layer names (or paths) left out on both sides,
            typically the classifier, which has a different number of classes
            when transferring. Defaults to `("head_dense",)`.

    Returns:
        list of str: the names of the layers whose weights were loaded.

    Raises:
        ValueError: listing every mismatch: layers missing from the source,
            layers of the source missing from `model`, and layers whose
            variable count or shapes differ.
    """
    source = _load_source(checkpoint_path_or_model)
    skip = tuple(skip or ())
    target_layers = {
        p: l for p, l in _weighted_leaves(model) if not _skipped(p, skip)
    }
    source_layers = {
        p: l for p, l in _weighted_leaves(source) if not _skipped(p, skip)
    }
    problems = []
    for path in target_layers:
        if path not in source_layers:
            problems.append(f"{path}: missing from the source")
    for path in source_layers:
        if path not in target_layers:
            problems.append(f"{path}: in the source but not in the model")
    pairs = []
    for path, layer in target_layers.items():
        src = source_layers.get(path)
        if src is None:
            continue
        target_shapes = [tuple(w.shape) for w in layer.weights]
        source_shapes = [tuple(w.shape) for w in src.weights]
        if target_shapes != source_shapes:
            problems.append(
                f"{path}: shape mismatch, model {target_shapes} vs "
                f"source {source_shapes}"
            )
        else:
            pairs.append((path, layer, src))
    if problems:
        raise ValueError(
            f"Cannot load weights: {len(problems)} mismatch(es):\n  "
            + "\n  ".join(problems)
        )
    for _, layer, src in pairs:
        layer.set_weights(src.get_weights())
    return [path for path, _, _ in pairs]
