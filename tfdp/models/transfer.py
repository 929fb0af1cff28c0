"""Transfer-learning helpers: new heads, frozen sub-blocks, partial loading.

The paper's best private ImageNet run fine-tunes a Places365-pretrained
ResNet-18 with "3 frozen block groups". In tfdp terms that is
`freeze_sub_blocks(model, 4)`: `k` counts entries of
`("stem", "block_group1", "block_group2", "block_group3", "block_group4")`,
so `k=4` freezes the stem and block groups 1-3 while block group 4, the final
GroupNorm (`head_norm`) and `head_dense` train.
"""

import logging
import os

import gin
import keras

from tfdp.dp import adapted_state
from tfdp.dp import freezing
from tfdp.models.applications import keras_application
from tfdp.models.applications import prepare_batchnorm
from tfdp.models.sub_blocks import SUB_BLOCKS
from tfdp.models.sub_blocks import sub_block_layers

FREEZABLE_SUB_BLOCKS = SUB_BLOCKS[:5]


@gin.configurable(module="tfdp.models")
def replace_head(model, num_classes, layer_name="head_dense", logits=False):
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
        logits: bool. Give the new head no activation, whatever the old one
            had (e.g. the softmax of a `keras.applications` top), since
            tfdp's losses take logits. Defaults to `False`.

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
    if logits:
        config["activation"] = "linear"
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


def _output_layer(model):
    for layer in model.layers:
        try:
            if layer.output is model.outputs[0]:
                return layer
        except (AttributeError, ValueError):  # Layers called more than once.
            continue
    return None


def _check_weights_file(weights):
    if weights is None or weights == "imagenet":
        return
    path = str(weights)
    if not os.path.exists(path):
        raise ValueError(
            f"Pretrained weights file not found: {path!r}. Put the file at that path "
            "(a `.keras` model, a `.weights.h5` file saved with `model.save_weights`, "
            "or a keras.applications weights file of the backbone without its top), "
            "or, with a keras.applications `architecture`, pass weights='imagenet' to let "
            "Keras download its ImageNet weights. "
            f"Received: weights={weights!r}"
        )


@gin.configurable(module="tfdp.models")
def load_pretrained(
    num_classes=1000,
    input_shape=(224, 224, 3),
    *,
    weights=None,
    architecture=None,
    application_kwargs=None,
    model_fn=None,
    source_num_classes=None,
    batchnorm="group_norm",
    groups=16,
    head="head_dense",
    frozen_sub_blocks=0,
    freeze_layers=(),
    freeze_rules=(),
):
    """Builds a model from pretrained weights, ready for private fine-tuning.

    Bu et al. 2022 (Appendix D) fine-tune ImageNet-pretrained models with
    BatchNorm replaced by GroupNorm and the modules their engine cannot clip
    frozen; Kurakin et al. 2022 fine-tune a Places365-pretrained ResNet-18
    on ImageNet with a new head and 3 frozen block groups. Here:

    1. The weights are loaded, by one of three routes:
       - `architecture` (a `keras_application` name): `weights` goes to
         the `keras.applications` constructor: `"imagenet"` (Keras
         downloads it as usual) or a local weights file of the backbone
         without its top. Or `weights` is a `.keras` file of a
         `keras_application` model with the same `batchnorm` (e.g. a
         Places365-pretrained one), matched by name. The head is new.
       - `model_fn` (any tfdp builder, e.g. `vit_s16`): a `.keras` file is
         matched layer by layer by name, all but the heads
         (`load_weights_matching`); a `.weights.h5` file is loaded into
         `model_fn(num_classes=source_num_classes)` (same architecture),
         whose head is then replaced.
       - neither: `weights` is a `.keras` model, loaded whole; the layer
         producing its output, a `Dense`, becomes the new head.
    2. BatchNorm is replaced by GroupNorm or frozen (`batchnorm`); it is
       replaced after loading, so every other layer keeps its weights.
    3. The head gets `num_classes` logits, a fresh draw of its initialiser.
    4. Frozen: the first `frozen_sub_blocks` of the tfdp ResNets'
       sub-blocks, the layers named in `freeze_layers`, and what the engine
       cannot clip (`tfdp.dp.freeze_unclippable`, with `freeze_rules`).
    5. With `weights`, every loaded layer is declared public
       (`tfdp.declare_public`): pretrained weights are public data, so
       their buffers (a frozen BatchNorm's moving statistics) are not
       listed as state that ε does not cover. Weights pretrained on the
       private data are not public: load those yourself
       (`model.load_weights`), so that their state is listed.

    Args:
        num_classes: int. Logits of the new head. Defaults to `1000`.
        input_shape: tuple. `(height, width, channels)`. Defaults to
            `(224, 224, 3)`. Ignored for a whole `.keras` model, which has
            its own.
        weights: str or None. `"imagenet"` (with `architecture` only), or a
            path to a local file. `None` builds a randomly initialised
            model. Defaults to `None`.
        architecture: str or None. A `keras_application` architecture.
            Defaults to `None`.
        application_kwargs: dict or None. More arguments of
            `keras_application` (e.g. `{"alpha": 0.35}`). Defaults to `None`.
        model_fn: callable or None. `(num_classes=, input_shape=) ->
            keras.Model`, a tfdp builder. Defaults to `None`.
        source_num_classes: int or None. The head size of the model saved
            in a `.weights.h5` file. Defaults to `num_classes`.
        batchnorm: str. `"group_norm"` (fresh GroupNorm with `groups`
            groups) or `"freeze"` (inference mode, loaded statistics).
            Defaults to `"group_norm"`.
        groups: int. GroupNorm groups. Defaults to `16`.
        head: str. Name of the head of `model_fn`'s models. Defaults to
            `"head_dense"`.
        frozen_sub_blocks: int. `k` of `freeze_sub_blocks(model, k)`; only
            for models named like the tfdp ResNets. Defaults to `0`.
        freeze_layers: tuple of str. Names of more layers to freeze.
            Defaults to `()`.
        freeze_rules: tuple of str. See `tfdp.dp.freeze_unclippable`. Defaults to
            `()`.

    Returns:
        `(model, frozen)`: the model, and what was frozen, each entry
        `"name (reason)"`.

    Raises:
        ValueError: for a missing weights file (saying where to put it), a
            route that does not fit the arguments, or weights that do not
            fit the model.
    """
    if batchnorm not in ("group_norm", "freeze"):
        raise ValueError(
            "`batchnorm` must be 'group_norm' or 'freeze': the DP engine refuses a "
            f"trainable BatchNorm. Received: batchnorm={batchnorm!r}"
        )
    if architecture is not None and model_fn is not None:
        raise ValueError(
            "Pass `architecture` (a keras.applications backbone) or `model_fn`, not both. "
            f"Received: architecture={architecture!r}, model_fn={model_fn!r}"
        )
    _check_weights_file(weights)
    path = None if weights in (None, "imagenet") else str(weights)
    if weights == "imagenet" and architecture is None:
        raise ValueError(
            "weights='imagenet' needs a keras.applications `architecture`. "
            f"Received: architecture=None, model_fn={model_fn!r}"
        )
    shape = tuple(input_shape)
    new_head = True  # Whether the head is still the source's, to be replaced.
    if architecture is not None:
        if path is not None and path.endswith(".keras"):
            # A model saved by tfdp: its norms are already what `batchnorm` asks for.
            model = keras_application(architecture, num_classes, shape, batchnorm=batchnorm,
                                      groups=groups, **(application_kwargs or {}))
            source = keras.models.load_model(path, compile=False)
            source_head = _output_layer(source)
            load_weights_matching(
                model, source, skip=("head_dense",) + ((source_head.name,) if source_head else ()))
        else:
            model = keras_application(architecture, num_classes, shape, weights=weights,
                                      batchnorm="keep", **(application_kwargs or {}))
        head, new_head = "head_dense", False
    elif model_fn is not None:
        if path is not None and path.endswith(".weights.h5"):
            model = model_fn(num_classes=source_num_classes or num_classes, input_shape=shape)
            model.load_weights(path)
        else:
            model, new_head = model_fn(num_classes=num_classes, input_shape=shape), False
            if path is not None:
                load_weights_matching(model, path, skip=(head,))
    elif path is not None and path.endswith(".keras"):
        model = keras.models.load_model(path, compile=False)
        source_head = _output_layer(model)
        if not isinstance(source_head, keras.layers.Dense):
            raise ValueError(
                "The model in the `.keras` file must end in a Dense head to be replaced. "
                f"Received: weights={weights!r}, output layer "
                f"{getattr(source_head, 'name', None)!r}"
            )
        head = source_head.name
    else:
        raise ValueError(
            "Pass `architecture` or `model_fn`, or `weights` as a `.keras` model file. "
            f"Received: weights={weights!r}, architecture=None, model_fn=None"
        )
    model, frozen_bn = prepare_batchnorm(model, batchnorm, groups)
    if weights is not None:
        # Pretrained weights are public data: their buffers (a frozen
        # BatchNorm's moving statistics) are not state that ε fails to cover.
        adapted_state.declare_public(model)
    frozen = [f"{name} (BatchNorm in inference mode)" for name in frozen_bn]
    if new_head:
        model = replace_head(model, num_classes, layer_name=head, logits=True)
    if frozen_sub_blocks:
        freeze_sub_blocks(model, frozen_sub_blocks)
        for sub_block in SUB_BLOCKS[:frozen_sub_blocks]:
            frozen += [f"{l.name} (sub-block {sub_block})"
                       for l in sub_block_layers(model, sub_block)]
    for name in freeze_layers:
        model.get_layer(name).trainable = False
        frozen.append(f"{name} (freeze_layers)")
    frozen += freezing.freeze_unclippable(model, freeze_rules)
    return model, frozen


@gin.configurable(module="tfdp.models")
def pretrained(num_classes=1000, input_shape=(224, 224, 3), **kwargs):
    """`load_pretrained`'s model, for `ModelConfig.model_fn`; logs what was frozen.

    Bind `load_pretrained`'s arguments in gin (`gin/models/pretrained.gin`):
        ModelConfig.model_fn = @tfdp.models.pretrained
        load_pretrained.architecture = 'mobilenet_v2'
        load_pretrained.weights = '/data/weights/mobilenet_v2_notop.weights.h5'

    Args:
        num_classes: int. Logits of the new head. Defaults to `1000`.
        input_shape: tuple. `(height, width, channels)`. Defaults to
            `(224, 224, 3)`.
        **kwargs: Keyword arguments of `load_pretrained`, beside its gin
            bindings.

    Returns:
        The `keras.Model`.
    """
    model, frozen = load_pretrained(num_classes, input_shape, **kwargs)
    logging.warning("tfdp: fine-tuning %s; frozen: %s", model.name,
                    "; ".join(frozen) if frozen else "nothing")
    return model
