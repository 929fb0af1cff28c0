"""Rules for `DepthwiseConv2D` and `SeparableConv2D` (MobileNet, EfficientNet, ConvNeXt).

A depthwise conv is, channel by channel, a conv with D = kh·kw inputs and
p = depth multiplier outputs over T = Ho·Wo positions. By the layer-wise
rule of Bu et al. (2022) a ghost norm pays off only where 2T² < p·D, i.e.
at T = 1 (and T = 2 under a 3×3 kernel, left instantiated): the 1×1 maps
at the end of a CNN on small images, where a "same" kernel's other taps
read only padding. There the norm comes from the input and the output
gradient (`DepthwiseGhostFactors`). Elsewhere the per-example gradient is
small (kh·kw·C·p floats), so it is instantiated, with the rows moved into
the channels, by one op for the batch: up to 3×3 a depthwise backprop where
the kernel fits in the input, otherwise a forward depthwise conv by the
output gradient (`takes_backprop_route`). Neither unfolds the input.

A separable conv is a depthwise conv followed by a 1×1 (pointwise) conv.
The tap records the depthwise output h; the pointwise kernel's per-example
gradient is h_iᵀ G_i (ghost or instantiated by 2T² < p·D, as a dense layer
on T positions), and the depthwise kernel's comes from the gradient at h,
G_i·Wᵀ.
"""

import keras
import tensorflow as tf

from tfdp.dp import layer_grads
from tfdp.dp import layer_taps
from tfdp.dp.rules import registry


def _geometry(layer):
    sh, sw = layer.strides
    return [1, sh, sw, 1], layer.padding.upper(), list(layer.dilation_rate)


def depthwise(layer, inputs, kernel):
    """The layer's depthwise conv of `inputs` by `kernel` (channels last)."""
    strides, padding, dilations = _geometry(layer)
    return tf.nn.depthwise_conv2d(inputs, kernel, strides, padding, dilations=dilations)


# Kernels of at most this many taps take the depthwise backprop of
# `per_example_depthwise_grads`, larger ones its correlation route. On 2 CPU
# cores, batch 16, oneDNN's filter gradient of a 3×3 depthwise conv with the
# rows in its channels is 1.5-3× faster than the correlation (MobileNetV2's
# shapes); of a 5×5 or 7×7 one it is 1.1-50× slower (EfficientNetB0's and
# ConvNeXt's shapes, 7×7 positions the worst).
MAX_BACKPROP_TAPS = 9


def takes_backprop_route(layer, input_shapes, kernel_shape):
    """Whether `per_example_depthwise_grads` takes the backprop route, else the correlation.

    The backprop route needs a kernel of at most `MAX_BACKPROP_TAPS` taps and
    inputs at least as large as the kernel's reach: where "same" padding
    makes the kernel overhang a smaller input on both sides, oneDNN's filter
    gradient is 25-250× slower than the correlation (2 CPU cores, 3×3, 1×1
    and 2×2 inputs, 192-960 channels, batch 16-128: 8-346 against 0.7-2.7 ms;
    MobileNetV2 at 32 px, batch 128, spent 14× the non-private step there).

    Args:
        layer: the layer (its dilation).
        input_shapes: the depthwise inputs' shapes [B·k, H, W, C], one per
            call; unknown sizes count as large enough.
        kernel_shape: the depthwise kernel's shape.
    """
    kh, kw = int(kernel_shape[0]), int(kernel_shape[1])
    if kh * kw > MAX_BACKPROP_TAPS:
        return False
    dh, dw = layer.dilation_rate
    reach_h, reach_w = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    return not any(
        (shape[1] is not None and shape[1] < reach_h)
        or (shape[2] is not None and shape[2] < reach_w)
        for shape in input_shapes
    )


def per_example_depthwise_grads(layer, inputs, output_grads, kernel_shape, k=1):
    """Per-example depthwise kernel gradients [B, kh, kw, C, mult].

    Row r's gradient for channel c at tap (i, j) is Σ_{h,w} x[r, h·s + i·d,
    w·s + j·d, c] · g[r, h, w, c·mult + m]. Both routes move the rows into
    the channels (row r's channel c becomes channel r·C + c) and take one op
    for the whole batch; neither unfolds the input:
    - the filter gradient of the layer's depthwise conv, [kh, kw, rows·C,
      mult], for small kernels on inputs they fit in
      (`takes_backprop_route`);
    - else a forward depthwise conv of the padded input by the output
      gradient used as a filter, dilated by the stride: its output at
      (i, j) is the sum above.

    Args:
        layer: the layer (its strides, padding and dilation).
        inputs: list of tensors [B·k, H, W, C]. The depthwise inputs, one per call.
        output_grads: list of tensors [B·k, Ho, Wo, C·mult]. Gradients at the
            depthwise outputs.
        kernel_shape: the depthwise kernel's shape.
        k: int. Rows per example. Defaults to 1.
    """
    kh, kw, channels, mult = (int(d) for d in kernel_shape)
    route = (_depthwise_grads_by_backprop
             if takes_backprop_route(layer, [x.shape for x in inputs], kernel_shape)
             else _depthwise_grads_by_correlation)
    total = None
    for x, g in zip(inputs, output_grads):
        x, g = tf.cast(x, tf.float32), tf.cast(g, tf.float32)
        # Both routes give tap-major gradients, channel r·C + c holding row r's c.
        grad = tf.reshape(route(layer, x, g, kernel_shape), [kh, kw, -1, channels, mult])
        grad = tf.transpose(grad, [2, 0, 1, 3, 4])
        total = grad if total is None else total + grad
    if k > 1:
        total = tf.reduce_sum(
            tf.reshape(total, [-1, k, kh, kw, channels, mult]), axis=1)
    return total


def _rows_as_channels(t):
    """[rows, H, W, C] -> [1, H, W, rows·C], row r's channel c at r·C + c."""
    shape = tf.shape(t)
    t = tf.transpose(t, [1, 2, 0, 3])
    return tf.reshape(t, [1, shape[1], shape[2], shape[0] * shape[3]])


def filter_backprop(layer, x, g, kernel_shape):
    """The gradient of Σ g·depthwise(x, W) in W: the layer's filter backprop, summed over x's rows."""
    zeros = tf.zeros(kernel_shape, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(zeros)
        y = depthwise(layer, x, zeros)
    return tape.gradient(y, zeros, output_gradients=g)


def _depthwise_grads_by_backprop(layer, x, g, kernel_shape):
    kh, kw, channels, mult = (int(d) for d in kernel_shape)
    rows = tf.shape(x)[0]
    return filter_backprop(layer, _rows_as_channels(x), _rows_as_channels(g),
                           tf.stack([kh, kw, rows * channels, mult]))


def _depthwise_grads_by_correlation(layer, x, g, kernel_shape):
    kh, kw, channels, mult = (int(d) for d in kernel_shape)
    sh, sw = layer.strides
    dh, dw = layer.dilation_rate
    x_shape, g_shape = tf.shape(x), tf.shape(g)
    rows, out_h, out_w = g_shape[0], g_shape[1], g_shape[2]
    # The input rows and columns the layer's conv reads: TensorFlow's SAME
    # padding (the odd one after), then a crop of what VALID leaves unread.
    read_h = (out_h - 1) * sh + (kh - 1) * dh + 1
    read_w = (out_w - 1) * sw + (kw - 1) * dw + 1
    if layer.padding == "same":
        pad_h = tf.maximum(read_h - x_shape[1], 0)
        pad_w = tf.maximum(read_w - x_shape[2], 0)
        x = tf.pad(x, [[0, 0], [pad_h // 2, pad_h - pad_h // 2],
                       [pad_w // 2, pad_w - pad_w // 2], [0, 0]])
    x = x[:, :read_h, :read_w, :]
    # The filter [Ho, Wo, rows·C, mult]: row r's channel c, multiplier m.
    g = tf.reshape(g, [rows, out_h, out_w, channels, mult])
    g = tf.reshape(tf.transpose(g, [1, 2, 0, 3, 4]), [out_h, out_w, rows * channels, mult])
    # TensorFlow takes strides or dilations above 1, not both: the layer's
    # dilation becomes a stride over the taps afterwards.
    grad = tf.nn.depthwise_conv2d(_rows_as_channels(x), g, [1, 1, 1, 1], "VALID",
                                  dilations=[sh, sw])
    return grad[0, ::dh, ::dw, :]


def _positions(records):
    t = 0
    for record in records:
        shape = record.outputs.shape
        t += int(shape[1]) * int(shape[2])
    return t


def depthwise_norm_mode(t, kernel_shape, rows=1):
    """Bu et al.'s rule per channel, for one output position: ghost where 2T² < p·D.

    D = kh·kw taps and p = the multiplier, so 2T² < p·D holds at T = 1 for
    any kernel of 2 or more taps: the 1×1 maps at the end of a CNN on small
    images. There the per-example gradient (kh·kw·C·mult floats, for a
    "same" kernel mostly taps that read padding) is larger than the input
    and output gradient a ghost norm keeps. Wider maps (2T² ≥ p·D but for
    T = 2 under a 3×3 kernel) and several rows or calls per example are
    instantiated, whatever the method: a depthwise ghost norm's Gram
    matrices, C·T² per example, would be far larger than its per-example
    gradient elsewhere.

    Args:
        t: int. Output positions of one row.
        kernel_shape: the depthwise kernel's shape.
        rows: int. Rows (augmentations times calls) per example. Defaults to 1.
    """
    kh, kw, _, mult = (int(d) for d in kernel_shape)
    if t == 1 and rows == 1 and 2 < kh * kw * mult:
        return layer_grads.GHOST
    return layer_grads.INSTANTIATE


def depthwise_why(t, kernel_shape, rows=1):
    """Why `depthwise_norm_mode` chose its mode, for `dp.plan`."""
    kh, kw, _, mult = (int(d) for d in kernel_shape)
    if depthwise_norm_mode(t, kernel_shape, rows) == layer_grads.GHOST:
        return "depthwise: T=1, 2T²<pD per channel"
    if 2 * t * t >= kh * kw * mult:
        return "depthwise: 2T²≥pD per channel"
    if rows > 1:
        return "depthwise: several rows per example, instantiated"
    return "depthwise: T>1, instantiated"


class DepthwiseGhostFactors:
    """Norms and clipped sums of a depthwise kernel with one output position per example.

    Channel c's gradient is the outer product u_c g_cᵀ of the taps the
    position reads (kh·kw) and its output gradient (mult), so its squared
    norm is ‖u_c‖²‖g_c‖², and ‖u_c‖² is the layer's depthwise conv of x² by
    a kernel of ones. Until the sum, what is kept is the input and the
    output gradient; the sum is the batch's filter backprop of c⊙G.
    """

    def __init__(self, layer, inputs, output_grads, kernel_shape):
        self.layer = layer
        self.kernel_shape = [int(d) for d in kernel_shape]
        self.x = tf.cast(inputs, tf.float32)
        self.g = tf.cast(output_grads, tf.float32)  # [B, 1, 1, C·mult]

    def sq_norms(self):
        kh, kw, channels, mult = self.kernel_shape
        taps = depthwise(self.layer, tf.square(self.x), tf.ones([kh, kw, channels, 1]))
        gg = tf.reduce_sum(tf.reshape(tf.square(self.g), [-1, channels, mult]), -1)
        return tf.reduce_sum(tf.reshape(taps, [-1, channels]) * gg, 1)

    def dot(self, kernel):
        """⟨per-example gradient, W⟩: the depthwise output by W, dotted with G."""
        return tf.reduce_sum(depthwise(self.layer, self.x, tf.cast(kernel, tf.float32)) * self.g,
                             [1, 2, 3])

    def clipped_sum(self, coeffs, keep=None):
        x = layer_grads.keep_rows(self.x, keep)
        g = layer_grads.keep_rows(self.g, keep) * tf.reshape(coeffs, [-1, 1, 1, 1])
        return filter_backprop(self.layer, x, g, self.kernel_shape)


class PointwiseFactors(layer_grads.LinearFactors):
    """`LinearFactors` of a separable conv's pointwise kernel: U = the depthwise output."""

    @property
    def u(self):
        if self._u is None:
            us = [layer_grads.flatten_bt(tf.cast(r.statistics, tf.float32), self.k)
                  for r in self.records]
            self._u = us[0] if len(us) == 1 else tf.concat(us, axis=1)
        return self._u

    def kernel_from_matrix(self, matrix):
        return tf.reshape(matrix, self.layer.pointwise_kernel.shape)


class DepthwiseClip(registry.LayerClip):
    """Depthwise kernel instantiated per example or by ghost norm
    (`depthwise_norm_mode`); a separable conv's pointwise kernel and any bias
    from `LinearFactors`."""

    def __init__(self, layer, records, output_grads, context):
        self.layer = layer
        self.variables = layer_taps.own_trainable_variables(layer)
        self.separable = isinstance(layer, keras.layers.SeparableConv2D)
        self.depthwise_kernel = layer.depthwise_kernel if self.separable else layer.kernel
        grads = [tf.cast(g, tf.float32) for g in output_grads]
        if self.separable:
            self.factors = PointwiseFactors(layer, records, grads, context.k)
            pointwise = tf.cast(layer.pointwise_kernel[0, 0], tf.float32)
            inputs = [r.inputs for r in records]
            depthwise_grads = [tf.einsum("bhwo,co->bhwc", g, pointwise) for g in grads]
            t = _positions(records)
            p, d = int(layer.pointwise_kernel.shape[-1]), int(layer.pointwise_kernel.shape[-2])
            self.mode = layer_grads.linear_norm_mode(t, p, d, context.method)
        else:
            self.factors = layer_grads.LinearFactors(layer, records, grads, context.k)
            inputs, depthwise_grads = [r.inputs for r in records], grads
            self.mode = layer_grads.INSTANTIATE
        kernel_shape = self.depthwise_kernel.shape
        self.depthwise_mode = depthwise_norm_mode(
            _positions(records), kernel_shape, rows=context.k * len(records))
        self.per_example = None
        if not registry.trains(layer, self.depthwise_kernel):
            # Frozen: no per-example depthwise gradients, nor their ghost norm.
            self.depthwise_mode = None
        elif self.depthwise_mode == layer_grads.GHOST:
            self.depthwise_factors = DepthwiseGhostFactors(
                layer, inputs[0], depthwise_grads[0], kernel_shape)
        else:
            self.per_example = per_example_depthwise_grads(
                layer, inputs, depthwise_grads, kernel_shape, context.k)
        # A ghost norm's sum may come from a second backward pass, which then
        # forms the layer's other sums too: the same arithmetic as their
        # norms, from the same recorded ops.
        pointwise_trains = self.separable and registry.trains(layer, layer.pointwise_kernel)
        ghost = layer_grads.GHOST in (self.depthwise_mode,
                                      self.mode if pointwise_trains else None)
        self.from_backward = registry.is_float32(layer) and ghost

    def _role(self, variable):
        if variable is self.depthwise_kernel:
            return "depthwise"
        if self.separable and variable is self.layer.pointwise_kernel:
            return "pointwise"
        return "bias"

    def sq_norm(self, variable):
        role = self._role(variable)
        if role == "depthwise":
            if self.per_example is None:
                return self.depthwise_factors.sq_norms()
            return tf.reduce_sum(tf.square(self.per_example), [1, 2, 3, 4])
        if role == "pointwise":
            return self.factors.kernel_sq_norms(self.mode)
        return self.factors.bias_sq_norms()

    def dot(self, variable):
        role = self._role(variable)
        w = tf.convert_to_tensor(variable)
        if role == "depthwise":
            if self.per_example is None:
                return self.depthwise_factors.dot(w)
            return tf.reduce_sum(self.per_example * w[None], [1, 2, 3, 4])
        if role == "pointwise":
            return self.factors.kernel_dot_weights()
        return tf.reduce_sum(self.factors.bias_per_example * tf.reshape(w, [1, -1]), 1)

    def clipped_sum(self, variable, coeffs, keep=None):
        role = self._role(variable)
        if role == "depthwise":
            if self.per_example is None:
                return self.depthwise_factors.clipped_sum(coeffs, keep)
            return tf.tensordot(coeffs, layer_grads.keep_rows(self.per_example, keep), axes=1)
        if role == "pointwise":
            return self.factors.kernel_clipped_sum(coeffs, keep)
        return self.factors.bias_clipped_sum(coeffs, keep)


_CALLS = {
    keras.layers.DepthwiseConv2D: keras.layers.DepthwiseConv2D.call,
    keras.layers.SeparableConv2D: keras.layers.SeparableConv2D.call,
}


@registry.register_rule(keras.layers.DepthwiseConv2D, keras.layers.SeparableConv2D)
class DepthwiseConvRule(registry.Rule):
    """Depthwise kernels instantiated per example; pointwise kernels by 2T² < p·D."""

    name = "depthwise"

    def applies(self, layer):
        return (
            any(type(layer).call is call for call in _CALLS.values())
            and layer.data_format == "channels_last"
            and layer.padding in ("valid", "same")
            and registry.is_plain(layer)
        )

    def tapped_call(self, layer, original):
        separable = isinstance(layer, keras.layers.SeparableConv2D)

        def call(inputs, *args, **kwargs):
            recorder = layer_taps.active_recorder()
            if recorder is None or recorder.mode != "record":
                return original(inputs, *args, **kwargs)
            if separable:
                hidden = depthwise(layer, inputs, layer.depthwise_kernel)
                pre = tf.nn.conv2d(hidden, layer.pointwise_kernel, 1, "VALID")
            else:
                hidden = None
                pre = depthwise(layer, inputs, layer.kernel)
            if layer.use_bias:
                pre = pre + layer.bias
            pre = recorder.record(
                layer_taps.TapRecord(layer, inputs, pre, statistics=hidden)
            )
            return layer.activation(pre) if layer.activation is not None else pre

        return call

    def decays(self, layer, variable):
        return variable is not getattr(layer, "bias", None)

    def is_offset(self, layer, variable):
        return variable is getattr(layer, "bias", None)

    def clip(self, layer, records, output_grads, context):
        return DepthwiseClip(layer, records, output_grads, context)

    def cost(self, layer, records, method, batch_size):
        t = _positions(records)
        separable = isinstance(layer, keras.layers.SeparableConv2D)
        kernels = [layer.depthwise_kernel, layer.pointwise_kernel] if separable else [layer.kernel]
        if not any(registry.trains(layer, kernel) for kernel in kernels):
            return registry.offsets_only_cost(layer, t, 0, 0, batch_size)
        kernel = layer.depthwise_kernel if separable else layer.kernel
        kh, kw, channels, mult = (int(n) for n in kernel.shape)
        tapped = method in registry.TAPPED_METHODS
        rows = len(records)
        depthwise_mode = (depthwise_norm_mode(t, kernel.shape, rows) if tapped
                          else layer_grads.INSTANTIATE)
        if depthwise_mode == layer_grads.GHOST:
            # x² by the window while the norm is computed; the input and
            # output gradient until the sum.
            instantiated = 0
            inputs = int(records[0].inputs.shape[1:].num_elements())
            work = inputs + 2 * channels
            ghost_kept = inputs + channels * mult
        else:
            instantiated, work, ghost_kept = kh * kw * channels * mult, 0, 0
        why = depthwise_why(t, kernel.shape, rows) if tapped else f"depthwise: method={method}"
        mode = depthwise_mode
        p = d = 0
        if separable:
            p, d = int(layer.pointwise_kernel.shape[-1]), int(layer.pointwise_kernel.shape[-2])
            mode = (layer_grads.linear_norm_mode(t, p, d, method) if tapped
                    else layer_grads.INSTANTIATE)
            if tapped:
                why += "; pointwise " + registry.layerwise_why(t, p, d, method)
            if mode == layer_grads.GHOST:
                work += 2 * t * t
                ghost_kept += t * p
            else:
                instantiated += p * d
        memory = batch_size * (instantiated + work) * registry.BYTES
        kept = batch_size * (instantiated + ghost_kept)
        return registry.Cost(t, p, d, mode, memory, kept * registry.BYTES, why=why)
