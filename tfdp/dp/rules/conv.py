"""Rules for Keras convolutions, keyed on Keras's base conv class.

- `conv2d`: an ungrouped, channels-last `Conv2D` with valid/same padding. Its
  per-example kernel gradient is U_iᵀ G_i with U_i the unfolded input patches
  (T = Ho·Wo positions, D = kh·kw·C_in); the norm is a ghost norm (from the
  unfolded Gram or the pixel Gram, `conv_input_gram`) or instantiated by the
  layer-wise rule 2T² < p·D (`linear.LinearRule`). Instantiated gradients
  and the clipped sum come from `Conv2DBackpropFilter`, without unfolding.
- `conv`: every other `BaseConv` layer (Conv1D, causal too; Conv3D; grouped
  Conv2D): per-example kernel gradients by one conv backprop per example, in
  a `tf.map_fn`, with no unfolded input. No ghost route is implemented for
  these layers, so the plan shows them instantiated whatever 2T² < p·D says.

The conv geometry, unfolding and pixel-Gram helpers live here with the rules.
"""

import keras
from keras.src.layers.convolutional import base_conv
import tensorflow as tf

from tfdp.dp import layer_grads
from tfdp.dp import layer_taps
from tfdp.dp.rules import depthwise_conv
from tfdp.dp.rules import generic
from tfdp.dp.rules import linear
from tfdp.dp.rules import registry

_BASE_CALL = keras.layers.Conv2D.call
_BASE_OP = keras.layers.Conv2D.convolution_op


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


def unfold(layer, inputs):
    """Unfolded input U of a Conv2D, [B, T, kh·kw·C_in] in the reshaped kernel's layout."""
    kh, kw = layer.kernel_size
    if kh == kw == 1:
        # A 1×1 patch is the pixel itself; "same" never pads a 1×1 conv.
        sh, sw = layer.strides
        return layer_grads.flatten_bt(inputs[:, ::sh, ::sw, :])
    if inputs.shape[-1] is not None and inputs.shape[-1] <= 3:
        # With few input channels a one-hot conv unfolds faster than
        # `extract_patches` (7 against 18 ms for the default run's first
        # conv at batch 256); with 16 it is slower (12 against 5 ms).
        return layer_grads.flatten_bt(unfold_by_conv(layer, inputs, layer.kernel.shape))
    strides, dilations, padding = conv_geometry(layer)
    patches = tf.image.extract_patches(inputs, [1, kh, kw, 1], strides, dilations, padding)
    return layer_grads.flatten_bt(patches)


def _same_padding(size, out, kernel, dilation):
    total = max((out - 1) + (kernel - 1) * dilation + 1 - size, 0)
    return [total // 2, total - total // 2]


def pixel_gram_geometry(layer, input_shapes, output_shapes, k=1):
    """Padding of the pixel-Gram route of `conv_input_gram`, or None.

    Static: from the recorded calls' shapes. None when the route does not
    apply (a stride, a 1×1 kernel, calls at several resolutions, unknown
    sizes) or when, per example, the padded pixel Gram P ((n·Hp·Wp)² floats)
    would be larger than what the unfolded route holds: U (n·T·kh·kw·C) and
    U Uᵀ ((n·T)²), with n = k × calls.

    Returns:
        (pads_h, pads_w), each [before, after], or None.
    """
    kh, kw = layer.kernel_size
    if tuple(layer.strides) != (1, 1) or kh * kw == 1:
        return None
    shapes = {tuple(s[1:]) for s in input_shapes}
    out_shapes = {tuple(s[1:3]) for s in output_shapes}
    if len(shapes) != 1 or len(out_shapes) != 1:
        return None
    (h, w, c), (ho, wo) = next(iter(shapes)), next(iter(out_shapes))
    if None in (h, w, c, ho, wo):
        return None
    dh, dw = layer.dilation_rate
    if layer.padding == "same":
        pads_h, pads_w = _same_padding(h, ho, kh, dh), _same_padding(w, wo, kw, dw)
    else:
        pads_h, pads_w = [0, 0], [0, 0]
    n = k * len(input_shapes)
    padded = n * (h + sum(pads_h)) * (w + sum(pads_w))
    t = n * ho * wo
    if padded * padded > t * kh * kw * c + t * t:
        return None
    return pads_h, pads_w


def pixel_gram_floats(geometry, input_shape, output_shape, n):
    """Floats of one example's pixel-Gram norm work: P, U Uᵀ and G Gᵀ.

    Args:
        geometry: `(pads_h, pads_w)` from `pixel_gram_geometry`.
        input_shape: the layer's input shape [B, H, W, C] (static H, W).
        output_shape: its output shape [B, Ho, Wo, p] (static Ho, Wo).
        n: int. Calls times rows per example.
    """
    pads_h, pads_w = geometry
    h, w = (int(s) for s in input_shape[1:3])
    ho, wo = (int(s) for s in output_shape[1:3])
    positions = n * (h + sum(pads_h)) * (w + sum(pads_w))
    t = n * ho * wo
    return positions * positions + 2 * t * t


def conv_input_gram(layer, inputs, outputs, k=1):
    """U Uᵀ of a stride-1 conv, [B, n·T, n·T], without unfolding its input.

    Patch rows (i, j) and (i', j') share kernel offsets, so
    (U Uᵀ)[(i,j),(i',j')] = Σ_(a,b) P[(i+a·dh, j+b·dw), (i'+a·dh, j'+b·dw)]
    with P the Gram matrix of the zero-padded input's pixels (channels
    contracted). P costs (H·W)²·C per example against T²·kh·kw·C for the
    unfolded Gram, and `extract_patches`, which writes kh·kw copies of the
    input, is the dominant cost of conv ghost norms on CPU.

    Args:
        layer: keras.layers.Conv2D. With strides 1 and a kernel larger than 1×1.
        inputs: list of tensors [B·k, H, W, C]. The layer's recorded inputs
            (one per call), all of one spatial shape.
        outputs: list of tensors [B·k, Ho, Wo, p]. The matching outputs.
        k: int. Rows per example (augmentation multiplicity). Defaults to 1.

    Returns:
        The Gram matrix ordered (call, row, Ho, Wo) like `LinearFactors.g`,
        or None where `pixel_gram_geometry` says the route does not apply.
    """
    geometry = pixel_gram_geometry(layer, [x.shape for x in inputs], [y.shape for y in outputs], k)
    if geometry is None:
        return None
    pads_h, pads_w = geometry
    kh, kw = layer.kernel_size
    dh, dw = layer.dilation_rate
    h, w, c = (int(d) for d in inputs[0].shape[1:])
    ho, wo = (int(d) for d in outputs[0].shape[1:3])
    n = k * len(inputs)
    x = tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1, k, h, w, c]) for v in inputs], axis=1)
    pixels = tf.reshape(x, [-1, n * h * w, c])
    gram = tf.reshape(tf.matmul(pixels, pixels, transpose_b=True), [-1, n, h, w, n, h, w])
    # Padding pixels are zero, so padding P equals P of the padded input.
    gram = tf.pad(gram, [[0, 0], [0, 0], pads_h, pads_w, [0, 0], pads_h, pads_w])
    # The shifts are separable: summing the column offsets first, then the
    # row offsets, takes kh + kw slices instead of kh·kw (on CPU at 32 px,
    # ResNet-18's ghost norms in 7.3 against 9.0 ms per step).
    columns = None
    for b in range(kw):
        j = b * dw
        part = gram[:, :, :, j:j + wo, :, :, j:j + wo]
        columns = part if columns is None else columns + part
    total = None
    for a in range(kh):
        i = a * dh
        part = columns[:, :, i:i + ho, :, :, i:i + ho, :]
        total = part if total is None else total + part
    return tf.reshape(total, [-1, n * ho * wo, n * ho * wo])


# Floats of one example's unfolded input U (T·D) above which a conv's
# per-example kernel gradients come from `conv_per_example_kernel_grads`
# instead: below it, U for the whole batch is small and one batched matmul
# beats B small ops (the default run's first conv: T·D = 12,544, 26 against
# 34 ms per step at batch 256); above it, U is what fills memory (ResNet's
# stem at 224 px: 1.8 M per example, 118 MB at batch 16).
MAX_UNFOLDED_PER_EXAMPLE = 2**16


def conv_kernel_grad(layer, inputs, output_grads, kernel_shape=None):
    """The conv's kernel gradient Σ_rows U_rowᵀ G_row, by `Conv2DBackpropFilter`.

    Args:
        layer: keras.layers.Conv2D. The layer (its geometry).
        inputs: tensor [n, H, W, C]. Inputs of the rows to sum.
        output_grads: tensor [n, Ho, Wo, p]. Their output gradients.
        kernel_shape: list of 4 ints or None. The kernel's shape; defaults to
            the layer's (a LoRA factor A has the layer's geometry and r filters).

    Returns:
        A tensor shaped like the kernel.
    """
    strides, dilations, padding = conv_geometry(layer)
    filter_sizes = list(layer.kernel.shape if kernel_shape is None else kernel_shape)
    return tf.raw_ops.Conv2DBackpropFilter(
        input=inputs, filter_sizes=filter_sizes, out_backprop=output_grads,
        strides=strides, padding=padding, dilations=dilations, data_format="NHWC",
    )


def rows_by_example(t, k):
    """`t` [B·k, ...] as float32 [B, k, ...]: each example's k rows together."""
    t = tf.cast(t, tf.float32)
    shape = tf.shape(t)
    return tf.reshape(t, tf.concat([[shape[0] // k, k], shape[1:]], 0))


def conv_per_example_kernel_grads(layer, inputs, output_grads, k=1, kernel_shape=None):
    """Per-example kernel gradients of a conv, [B, kh·kw·C_in, p], without unfolding.

    One `Conv2DBackpropFilter` per example (its k rows as the op's batch, which
    it sums), in a `tf.map_fn`: the same arithmetic as U_iᵀ G_i, but with no
    unfolded input, which holds kh·kw copies of the input for the whole batch
    (about 4× the memory and, at 224 px on CPU, up to 4× the time).

    Args:
        layer: keras.layers.Conv2D. The layer.
        inputs: list of tensors [B·k, H, W, C]. Its recorded inputs, one per call.
        output_grads: list of tensors [B·k, Ho, Wo, p]. The matching output gradients.
        k: int. Rows per example (augmentation multiplicity). Defaults to 1.
        kernel_shape: list of 4 ints or None. As in `conv_kernel_grad`.

    Returns:
        A float32 tensor [B, kh·kw·C_in, p] in the layout of the reshaped kernel.
    """
    kernel_shape = list(layer.kernel.shape if kernel_shape is None else kernel_shape)

    def one_example(pairs):
        total = None
        for x_i, g_i in pairs:
            part = conv_kernel_grad(layer, x_i, g_i, kernel_shape)
            total = part if total is None else total + part
        return tf.reshape(total, [-1, kernel_shape[-1]])

    pairs = [(rows_by_example(x, k), rows_by_example(g, k))
             for x, g in zip(inputs, output_grads)]
    # parallel_iterations bounds how many examples' work is in flight at once.
    return tf.map_fn(
        one_example, pairs, fn_output_signature=tf.float32, parallel_iterations=4
    )


class ConvFactors(layer_grads.LinearFactors):
    """`LinearFactors` of a Conv2D: U unfolded only where a route needs it.

    A conv whose norm is not a ghost norm and whose clipped sum goes through
    `Conv2DBackpropFilter` never unfolds its input; a stride-1 ghost norm
    takes U Uᵀ from the pixel Gram where that is cheaper.

    Args:
        layer, records, output_grads, k: as for `LinearFactors`.
        kernel_shape: list of 4 ints or None. The shape of the kernel whose
            gradients these are. Defaults to None (the layer's); a LoRA factor
            A is a conv of the layer's geometry with r filters.
    """

    def __init__(self, layer, records, output_grads, k=1, kernel_shape=None):
        super().__init__(layer, records, output_grads, k)
        self.kernel_shape = list(layer.kernel.shape if kernel_shape is None else kernel_shape)

    def kernel_from_matrix(self, matrix):
        return tf.reshape(matrix, self.kernel_shape)

    def unfold(self, inputs):
        return unfold(self.layer, inputs)

    def kernel_sq_norms(self, mode):
        if mode == layer_grads.GHOST and self._u is None and self.g.shape[1] != 1:
            sq_norms = self._pixel_gram_sq_norms()
            if sq_norms is not None:
                return sq_norms
        return super().kernel_sq_norms(mode)

    def per_example_kernel_grads(self):
        # A 1×1 conv's U is its input (strided): U_iᵀ G_i is one batched
        # matmul, several times faster than a backprop per example.
        if (self._u is None and tuple(self.layer.kernel_size) != (1, 1)
                and self._unfolded_size() > MAX_UNFOLDED_PER_EXAMPLE):
            return conv_per_example_kernel_grads(
                self.layer, [r.inputs for r in self.records], self.output_grads, self.k,
                self.kernel_shape,
            )
        return super().per_example_kernel_grads()

    def _pixel_gram_sq_norms(self):
        """Ghost norms by `conv_input_gram`, in chunks of the batch where the
        work is large (`MAX_GHOST_WORK_BYTES`); None where the route does not apply."""
        inputs = [r.inputs for r in self.records]
        outputs = [r.outputs for r in self.records]
        geometry = pixel_gram_geometry(
            self.layer, [x.shape for x in inputs], [y.shape for y in outputs], self.k
        )
        if geometry is None:
            return None

        def sq_norms(xs, g):
            # The outputs give only the static output size.
            uu = conv_input_gram(self.layer, xs, outputs, self.k)
            gg = tf.matmul(g, g, transpose_b=True)
            return tf.reduce_sum(uu * gg, [1, 2])

        n = self.k * len(inputs)
        chunk = layer_grads.examples_per_chunk(
            pixel_gram_floats(geometry, inputs[0].shape, outputs[0].shape, n)
        )
        rows = inputs[0].shape[0]
        if rows is not None and rows // self.k <= chunk:
            return sq_norms(inputs, self.g)
        return layer_grads.over_example_chunks(sq_norms, inputs, self.g, chunk, self.k)

    def _unfolded_size(self):
        """Floats of one example's U, T·D (static even when the batch is not)."""
        t, _, d = layer_grads.linear_dims(self.layer, self.records)
        return self.k * t * d

    def kernel_clipped_sum(self, coeffs, keep=None):
        if self._per_example is not None:
            return super().kernel_clipped_sum(coeffs, keep)
        # Σ_i c_i U_iᵀ G_i is the conv kernel gradient of the output
        # gradient scaled per example: no unfolded input needed.
        row_coeffs = tf.repeat(coeffs, self.k) if self.k > 1 else coeffs
        row_keep = None if keep is None else tf.repeat(keep, self.k)
        summed = None
        for record, grad in zip(self.records, self.output_grads):
            part = conv_kernel_grad(
                self.layer,
                layer_grads.keep_rows(tf.cast(record.inputs, tf.float32), row_keep),
                tf.math.multiply_no_nan(
                    tf.cast(grad, tf.float32), row_coeffs[:, None, None, None]
                ),
                self.kernel_shape,
            )
            summed = part if summed is None else summed + part
        return summed


@registry.register_rule(keras.layers.Conv2D)
class Conv2DRule(linear.LinearRule):
    """U_i: the unfolded input patches; ghost norms may use the pixel Gram."""

    name = "conv2d"

    def applies(self, layer):
        return (
            type(layer).call is _BASE_CALL
            and type(layer).convolution_op is _BASE_OP
            and layer.data_format == "channels_last"
            and layer.groups == 1
            and layer.padding in ("valid", "same")
            and registry.is_plain(layer)
        )

    def factors(self, layer, records, output_grads, k):
        return ConvFactors(layer, records, output_grads, k)

    def tapped_call(self, layer, original):
        def call(inputs, *args, **kwargs):
            recorder = layer_taps.active_recorder()
            if recorder is None:
                return original(inputs, *args, **kwargs)
            if recorder.mode == "vectorized" and registry.trains(layer, layer.kernel):
                pre = vectorizable_conv(layer, inputs, layer.kernel)
            else:
                pre = layer.convolution_op(inputs, layer.kernel)
            if layer.use_bias:
                pre = pre + layer.bias
            if recorder.mode == "record":
                pre = recorder.record(layer_taps.TapRecord(layer, inputs, pre))
            return layer.activation(pre) if layer.activation is not None else pre

        return call

    def ghost_kept_floats(self, layer, records):
        # A conv's per-example gradients mostly come from a filter backprop
        # per example, slower than its ghost norm: the layer-wise rule alone.
        return None

    def pixel_gram_floats(self, layer, records):
        geometry = pixel_gram_geometry(
            layer, [r.inputs.shape for r in records], [r.outputs.shape for r in records]
        )
        if geometry is None:
            return None
        return pixel_gram_floats(
            geometry, records[0].inputs.shape, records[0].outputs.shape, len(records)
        )


BASE_CONV_CALLS = (base_conv.BaseConv.call, keras.layers.Conv1D.call)


def conv_padding(layer):
    """The padding of the layer's conv op: causal padding is applied to the input first."""
    return "valid" if layer.padding == "causal" else layer.padding


def conv(layer, inputs, kernel):
    """The layer's conv op, on inputs already causally padded."""
    return keras.ops.conv(
        inputs, kernel, strides=list(layer.strides), padding=conv_padding(layer),
        dilation_rate=layer.dilation_rate, data_format="channels_last",
    )


def is_depthwise_conv2d(layer):
    """A Conv2D with one input channel per group (groups = input channels)."""
    return (
        isinstance(layer, keras.layers.Conv2D) and layer.groups > 1
        and int(layer.kernel.shape[2]) == 1 and layer.padding in ("valid", "same")
    )


@registry.register_rule(base_conv.BaseConv)
class ConvRule(generic.InstantiatingRule):
    """Per-example kernel and bias gradients of any channels-last Keras conv."""

    name = "conv"
    why = "no ghost route: per example"

    def applies(self, layer):
        return (
            type(layer).call in BASE_CONV_CALLS
            and type(layer).convolution_op is base_conv.BaseConv.convolution_op
            and layer.data_format == "channels_last"
            and registry.is_plain(layer)
        )

    def decays(self, layer, variable):
        return variable is layer.kernel

    def is_offset(self, layer, variable):
        return variable is getattr(layer, "bias", None)

    def cost(self, layer, records, method, batch_size):
        if not registry.trains(layer, layer.kernel):
            return registry.offsets_only_cost(layer, 0, 0, 0, batch_size)
        return super().cost(layer, records, method, batch_size)

    def tapped_call(self, layer, original):
        def call(inputs, *args, **kwargs):
            recorder = layer_taps.active_recorder()
            if recorder is None or recorder.mode != "record":
                return original(inputs, *args, **kwargs)
            x = inputs
            if layer.padding == "causal":
                x = keras.ops.pad(inputs, layer._compute_causal_padding())
            pre = conv(layer, x, layer.kernel)
            if layer.use_bias:
                pre = pre + layer.bias
            # The recorded input is the conv op's: causally padded.
            pre = recorder.record(layer_taps.TapRecord(layer, x, pre))
            return layer.activation(pre) if layer.activation is not None else pre

        return call

    def per_example_grads(self, layer, records, output_grads, variables):
        kernel_shape = layer.kernel.shape
        # A frozen kernel (the bias alone trains) needs no backprop per row.
        wants_kernel = any(v is layer.kernel for v in variables)
        total_kernel, total_bias = None, None
        for record, grad in zip(records, output_grads):
            x, g = tf.cast(record.inputs, tf.float32), tf.cast(grad, tf.float32)
            bias = tf.reduce_sum(tf.reshape(g, [tf.shape(g)[0], -1, g.shape[-1]]), 1)
            total_bias = bias if total_bias is None else total_bias + bias
            if not wants_kernel:
                continue
            zeros = tf.zeros(kernel_shape, tf.float32)

            def one_row(pair, zeros=zeros):
                x_i, g_i = pair
                with tf.GradientTape() as tape:
                    tape.watch(zeros)
                    y = conv(layer, x_i[None], zeros)
                return tape.gradient(y, zeros, output_gradients=g_i[None])

            if is_depthwise_conv2d(layer):
                # One input channel per group (ConvNeXt's 7×7 convs): a
                # depthwise conv, whose backprop is far cheaper than a
                # grouped conv's on CPU. Kernel [kh, kw, 1, C·m] is the
                # depthwise kernel [kh, kw, C, m] reshaped.
                kh, kw, _, filters = kernel_shape
                channels = int(x.shape[-1])
                depthwise_shape = [kh, kw, channels, filters // channels]
                kernel = depthwise_conv.per_example_depthwise_grads(
                    layer, [x], [g], depthwise_shape)
                kernel = tf.reshape(kernel, tf.concat([[-1], kernel_shape], 0))
            else:
                # parallel_iterations bounds how many rows' work is in flight at once.
                kernel = tf.map_fn(one_row, (x, g), fn_output_signature=tf.float32,
                                   parallel_iterations=4)
            total_kernel = kernel if total_kernel is None else total_kernel + kernel
        return [total_kernel if v is layer.kernel else total_bias for v in variables]
