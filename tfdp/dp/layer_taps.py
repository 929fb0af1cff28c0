"""Taps on the layers that own trainable variables.

The fast clipping methods need, for every trainable layer, its input and the
gradient of the (summed, per-example) loss with respect to its pre-activation
output. Because examples never interact (no BatchNorm), the gradient of the
summed loss with respect to example i's activations is example i's own
gradient, so one batched backward pass gives every per-example output gradient.

We patch each layer's `call` once (instance attribute) with a wrapper that is a
pass-through unless a recorder is active on the current thread. Thread-local
state keeps MirroredStrategy replicas, which trace in parallel threads, apart.
"""

import contextlib
import threading

import keras
import tensorflow as tf

KIND_CONV2D = "conv2d"
KIND_DENSE = "dense"
KIND_EMBEDDING = "embedding"
KIND_NORM = "norm"
KIND_GENERIC = "generic"

_local = threading.local()
_BASE_CONV_CALL = keras.layers.Conv2D.call
_BASE_CONV_OP = keras.layers.Conv2D.convolution_op


class TapRecord:
    """One call of a tapped layer: its input and its pre-activation output."""

    __slots__ = ("layer", "inputs", "outputs", "call_fn")

    def __init__(self, layer, inputs, outputs, call_fn=None):
        self.layer = layer
        self.inputs = inputs
        self.outputs = outputs
        self.call_fn = call_fn


class _Recorder:
    def __init__(self, mode):
        self.mode = mode
        self.records = []
        self.suspended = False


def _active_recorder():
    recorder = getattr(_local, "recorder", None)
    if recorder is None or recorder.suspended:
        return None
    return recorder


@contextlib.contextmanager
def recording(mode="record"):
    """Activates taps on this thread; yields the recorder.

    Args:
        mode: str. "record" stores a `TapRecord` per tapped call;
            "vectorized" computes conv layers with a conv whose weight
            gradient `tf.vectorized_map` can vectorize. Defaults to "record".
    """
    previous = getattr(_local, "recorder", None)
    recorder = _Recorder(mode)
    _local.recorder = recorder
    try:
        yield recorder
    finally:
        _local.recorder = previous


@contextlib.contextmanager
def suspended():
    """Makes taps pass-through, e.g. while recomputing a layer per example."""
    recorder = getattr(_local, "recorder", None)
    if recorder is None:
        yield
        return
    was = recorder.suspended
    recorder.suspended = True
    try:
        yield
    finally:
        recorder.suspended = was


def own_trainable_variables(layer):
    """Trainable variables the layer owns directly, not those of sublayers."""
    if not layer.trainable:
        return []
    return [v for v in getattr(layer, "_trainable_variables", []) if v.trainable]


def _is_plain(layer):
    return (
        getattr(layer, "quantization_mode", None) is None
        and not getattr(layer, "lora_enabled", False)
    )


def _is_float32(layer):
    return (
        getattr(layer, "compute_dtype", None) == "float32"
        and all(v.dtype == "float32" for v in getattr(layer, "_trainable_variables", []))
    )


def _is_plain_norm(layer):
    """GroupNormalization/LayerNormalization whose γ/β gradients have a closed form.

    Per example, ∂L/∂γ = Σ g ⊙ x̂ and ∂L/∂β = Σ g over the non-parameter axes,
    where g is the output gradient and x̂ the normalised input.
    """
    if not _is_float32(layer) or not layer.built:
        return False
    if (
        isinstance(layer, keras.layers.GroupNormalization)
        and type(layer).call is keras.layers.GroupNormalization.call
        and type(layer)._apply_normalization
        is keras.layers.GroupNormalization._apply_normalization
    ):
        ndim = getattr(layer.input_spec, "ndim", None)
        return ndim is not None and ndim >= 2 and layer.axis in (-1, ndim - 1)
    if (
        isinstance(layer, keras.layers.LayerNormalization)
        and type(layer).call is keras.layers.LayerNormalization.call
        and isinstance(layer.axis, list)
    ):
        return True
    return False


def layer_kind(layer):
    """The clipping kind of a layer that owns trainable variables.

    Raises:
        ValueError: for BatchNormalization, which mixes examples so that no
            per-example gradient exists.
    """
    if isinstance(layer, keras.layers.BatchNormalization):
        raise ValueError(
            f"Layer '{layer.name}' is a BatchNormalization layer. Batch "
            "statistics mix examples, so per-example gradients (and hence DP) "
            "are undefined. Convert the model with "
            "`tfdp.models.replace_batchnorm(model, groups=32)`. "
            f"Received: layer={layer.name!r}"
        )
    if (
        isinstance(layer, keras.layers.Conv2D)
        and type(layer).call is _BASE_CONV_CALL
        and type(layer).convolution_op is _BASE_CONV_OP
        and layer.data_format == "channels_last"
        and layer.groups == 1
        and layer.padding in ("valid", "same")
        and _is_plain(layer)
    ):
        return KIND_CONV2D
    if (
        isinstance(layer, keras.layers.Dense)
        and type(layer).call is keras.layers.Dense.call
        and _is_plain(layer)
    ):
        return KIND_DENSE
    if _is_plain_norm(layer):
        return KIND_NORM
    if (
        isinstance(layer, keras.layers.Embedding)
        and type(layer).call is keras.layers.Embedding.call
        and _is_plain(layer)
    ):
        return KIND_EMBEDDING
    return KIND_GENERIC


def tapped_layers(model):
    """All layers (recursively) that directly own trainable variables."""
    found = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if isinstance(layer, keras.layers.BatchNormalization):
            layer_kind(layer)  # Raises, even when frozen: never silently skip.
        if own_trainable_variables(layer):
            found.append(layer)
    return found


def install_taps(model):
    """Patches every trainable layer of `model` once; returns those layers."""
    layers = tapped_layers(model)
    for layer in layers:
        if getattr(layer, "_tfdp_original_call", None) is None:
            kind = layer_kind(layer)
            original = layer.call
            layer._tfdp_original_call = original
            layer._tfdp_kind = kind
            layer.call = _make_tapped_call(layer, kind, original)
    return layers


def _make_tapped_call(layer, kind, original):
    if kind == KIND_CONV2D:

        def call(inputs, *args, **kwargs):
            recorder = _active_recorder()
            if recorder is None:
                return original(inputs, *args, **kwargs)
            if recorder.mode == "vectorized":
                pre = vectorizable_conv(layer, inputs, layer.kernel)
            else:
                pre = layer.convolution_op(inputs, layer.kernel)
            if layer.use_bias:
                pre = pre + layer.bias
            if recorder.mode == "record":
                recorder.records.append(TapRecord(layer, inputs, pre))
            return layer.activation(pre) if layer.activation is not None else pre

        return call

    if kind == KIND_DENSE:

        def call(inputs, *args, **kwargs):
            recorder = _active_recorder()
            if recorder is None or recorder.mode != "record":
                return original(inputs, *args, **kwargs)
            pre = tf.matmul(inputs, layer.kernel) if inputs.shape.rank == 2 else (
                tf.tensordot(inputs, layer.kernel, axes=1)
            )
            if layer.bias is not None:
                pre = pre + layer.bias
            recorder.records.append(TapRecord(layer, inputs, pre))
            return layer.activation(pre) if layer.activation is not None else pre

        return call

    def call(inputs, *args, **kwargs):
        recorder = _active_recorder()
        outputs = original(inputs, *args, **kwargs)
        if recorder is not None and recorder.mode == "record":
            call_fn = lambda x: original(x, *args, **kwargs)  # noqa: E731
            recorder.records.append(TapRecord(layer, inputs, outputs, call_fn))
        return outputs

    return call


def conv_geometry(layer):
    """Strides, dilations and padding of a Conv2D as TF op arguments."""
    sh, sw = layer.strides
    dh, dw = layer.dilation_rate
    return [1, sh, sw, 1], [1, dh, dw, 1], layer.padding.upper()


def unfold_by_conv(layer, x, kernel_shape):
    """Unfolds conv input patches with a one-hot conv (vectorizable by pfor).

    `tf.image.extract_patches` has no pfor converter, while Conv2D does.
    The patch layout is (kh, kw, c_in), the layout of a reshaped Keras kernel.
    """
    kh, kw, cin = kernel_shape[0], kernel_shape[1], kernel_shape[2]
    depth = kh * kw * cin
    eye = tf.reshape(tf.eye(depth, dtype=x.dtype), (kh, kw, cin, depth))
    strides, dilations, padding = conv_geometry(layer)
    return tf.nn.conv2d(x, eye, strides, padding, dilations=dilations)


def vectorizable_conv(layer, x, kernel):
    """Conv2D whose kernel gradient avoids Conv2DBackpropFilter.

    Inside `tf.vectorized_map`, TF converts Conv2DBackpropFilter with a
    while_loop, which serialises per-example conv weight gradients. This conv
    computes the kernel gradient as unfolded-input^T @ output-gradient instead.
    """
    kernel = tf.convert_to_tensor(kernel)
    strides, dilations, padding = conv_geometry(layer)

    @tf.custom_gradient
    def conv(x, kernel):
        y = tf.nn.conv2d(x, kernel, strides, padding, dilations=dilations)

        def grad(dy):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y_again = tf.nn.conv2d(x, kernel, strides, padding, dilations=dilations)
            dx = tape.gradient(y_again, x, output_gradients=dy)
            patches = unfold_by_conv(layer, x, kernel.shape)
            dk = tf.einsum("bhwd,bhwp->dp", patches, dy)
            return dx, tf.reshape(dk, tf.shape(kernel))

        return y, grad

    return conv(x, kernel)
