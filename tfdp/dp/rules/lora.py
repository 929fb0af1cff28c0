"""Rule `lora`: LoRA-enabled Dense, EinsumDense and convolution layers.

Keras's `layer.enable_lora(rank, lora_alpha)` freezes the kernel W and adds
two trainable factors: the layer computes with the kernel W + s·A·B, with
s = lora_alpha / rank, A shaped like the kernel with its last axis replaced
by the rank r, and B [r, size of the kernel's last axis]; the product
contracts A's last axis with B's first. In the rows form of the layer's own
rule (U_i, T×D: the unfolded input of example i; G_i, T×p: its output
gradient, whose columns end with the kernel's last axis, p = p_o·p_ℓ):

- A: the layer with kernel A alone has the output gradient G_i^A = s·G_i Bᵀ
  (B applied to the kernel's last axis), so A's per-example gradient is
  U_iᵀ G_i^A, [D, p_o·r];
- B: with H_i the layer's output through A alone (computed from the recorded input,
  its T·p_o rows of r), B's per-example gradient is s·H_iᵀ G_i, [r, p_ℓ].

For Dense (p_o = 1) that is grad_A = s·xᵀ(g Bᵀ) and grad_B = s·(x A)ᵀ g.
For attention's query projection "abc,cde->abde" (kernel [width, heads, key
size]) A is [width, heads, r] and B [r, key size]: p_o = heads, and B's rows
run over positions and heads. Each factor's norm is a ghost norm
Σ (U Uᵀ) ⊙ (G Gᵀ) or instantiated, by the layer-wise rule 2T² < size
(`layer_grads.linear_norm_mode`), as for a plain layer: at ranks far below
the width the factors are instantiated, a few thousand floats per example.
Their clipped sums come from the same factors, never from a second
backward pass.

Where the layer's own per-example gradient M_i = U_iᵀ G_i is small enough
that full fine-tuning would instantiate it, and forming it costs less work
than the factor route, both factors come from it instead: dL/dA = s·M Bᵀ and
dL/dB = s·Aᵀ M (`LoraLayout.projects`). A small layer (the first conv of a
small convnet) then costs what full fine-tuning's per-example gradient
costs, plus two products no larger than the factors.

Layers covered, in float compute without quantization: Dense with Keras's
`call`; EinsumDense whose equation the `einsum_dense` rule takes and whose
kernel's last axis is an output axis (all of MultiHeadAttention's); and
channels-last, ungrouped Conv1D, Conv2D and Conv3D with Keras's `call`
(for Conv2D with valid or same padding, A is a conv of its own, with the
layer's geometry and the output gradient s·G Bᵀ, and takes the `conv` rule's
routes: a pixel-Gram ghost norm, clipped sums by `Conv2DBackpropFilter`; the
other convs take A's per-example gradients from one conv backprop per
example). Other
LoRA-enabled layers, and a LoRA layer whose base kernel was made trainable
again, get the generic rule.
"""

import math

import keras
from keras.src.layers.convolutional import base_conv
import tensorflow as tf

from tfdp.dp import layer_grads
from tfdp.dp import layer_taps
from tfdp.dp.rules import conv as conv_rules
from tfdp.dp.rules import einsum_dense
from tfdp.dp.rules import registry

DENSE, EINSUM, CONV2D, CONV = "dense", "einsum", "conv2d", "conv"


def lora_family(layer):
    """Which LoRA route handles `layer`: "dense", "einsum", "conv2d", "conv" or None.

    None for a layer without LoRA, a quantized one, a modified `call`, or an
    equation or conv outside the routes (see the module docstring).
    """
    if not getattr(layer, "lora_enabled", False):
        return None
    if getattr(layer, "quantization_mode", None) is not None:
        return None
    if isinstance(layer, keras.layers.Dense):
        return DENSE if type(layer).call is keras.layers.Dense.call else None
    if isinstance(layer, keras.layers.EinsumDense):
        if type(layer).call is not keras.layers.EinsumDense.call:
            return None
        layout = einsum_dense.layer_layout(layer)
        return EINSUM if layout.valid and layout.kernel[-1] in layout.produced else None
    if isinstance(layer, base_conv.BaseConv):
        if (type(layer).call not in conv_rules.BASE_CONV_CALLS
                or type(layer).convolution_op is not base_conv.BaseConv.convolution_op
                or layer.data_format != "channels_last" or layer.groups != 1):
            return None
        if isinstance(layer, keras.layers.Conv2D) and layer.padding in ("valid", "same"):
            return CONV2D
        return CONV
    return None


def lora_scale(layer):
    """s = lora_alpha / rank: the factor of A·B in the layer's kernel."""
    return float(layer.lora_alpha) / float(layer.lora_rank)


def lora_output(layer, inputs):
    """The layer's linear op with kernel A alone: H, the rank on the kernel's last axis.

    Args:
        layer: a LoRA-enabled layer of `lora_family`.
        inputs: tensor. The layer's input (a conv's causally padded).
    """
    a = tf.cast(layer.lora_kernel_a, inputs.dtype)
    if isinstance(layer, keras.layers.Dense):
        return tf.tensordot(inputs, a, axes=1) if inputs.shape.rank > 2 else tf.matmul(inputs, a)
    if isinstance(layer, keras.layers.EinsumDense):
        return tf.einsum(layer.equation, inputs, a)
    return conv_rules.conv(layer, inputs, a)


def rows_through(factors, op):
    """Each recorded call's input through `op` (a linear op), as rows like G, [B, rows, width].

    Args:
        factors: `layer_grads.LinearFactors` (its records, row layout and k).
        op: callable. Maps a call's float32 input to that op's output.
    """
    rows = [layer_grads.flatten_bt(factors.output_rows(op(tf.cast(r.inputs, tf.float32))),
                                   factors.k)
            for r in factors.records]
    return rows[0] if len(rows) == 1 else tf.concat(rows, axis=1)


class FactorGrad:
    """One LoRA factor's per-example gradients U_iᵀ G_i, as matrices [D, p].

    Args:
        u: tensor [B, T, D] or None (with `per_example`).
        g: tensor [B, T, p] or None (with `per_example`).
        mode: str. `layer_grads.GHOST` or `layer_grads.INSTANTIATE`.
        per_example: tensor [B, D, p] or None. Gradients instantiated by
            another route (a conv backprop per example).
    """

    def __init__(self, u, g, mode, per_example=None):
        self.u, self.g, self.mode, self.per_example = u, g, mode, per_example

    def sq_norms(self):
        """[B] squared Frobenius norms."""
        if self.per_example is None and self.g.shape[1] == 1:
            # One position: ‖uᵀg‖² = ‖u‖²·‖g‖².
            return (tf.reduce_sum(tf.square(self.u), [1, 2])
                    * tf.reduce_sum(tf.square(self.g), [1, 2]))
        if self.per_example is None and self.mode == layer_grads.GHOST:
            uu = tf.matmul(self.u, self.u, transpose_b=True)
            gg = tf.matmul(self.g, self.g, transpose_b=True)
            return tf.reduce_sum(uu * gg, [1, 2])
        if self.per_example is None:
            # Kept for the clipped sum: by the layer-wise rule, no larger
            # than the Gram matrices.
            self.per_example = tf.matmul(self.u, self.g, transpose_a=True)
        return tf.reduce_sum(tf.square(self.per_example), [1, 2])

    def dot(self, matrix):
        """[B] ⟨U_iᵀ G_i, matrix⟩ = Σ_t ⟨U_i·matrix, G_i⟩_t."""
        if self.per_example is not None:
            return tf.reduce_sum(self.per_example * matrix[None], [1, 2])
        return tf.reduce_sum(tf.tensordot(self.u, matrix, axes=1) * self.g, [1, 2])

    def clipped_sum(self, coeffs, keep=None):
        """Σ_i c_i·U_iᵀ G_i, [D, p]; `keep` (per example) drops NaN examples."""
        if self.per_example is not None:
            return tf.tensordot(coeffs, layer_grads.keep_rows(self.per_example, keep), axes=1)
        weighted = tf.math.multiply_no_nan(self.g, coeffs[:, None, None])
        u = layer_grads.keep_rows(self.u, keep)
        return tf.matmul(
            tf.reshape(u, [-1, tf.shape(u)[-1]]),
            tf.reshape(weighted, [-1, tf.shape(weighted)[-1]]),
            transpose_a=True,
        )


class ConvFactorGrad:
    """A conv's factor A as a conv of its own: the layer's geometry, kernel A, output gradient s·G Bᵀ.

    Its per-example gradients take `conv.ConvFactors`' routes, as the layer's
    own kernel would: a ghost norm from the pixel Gram, the clipped sum by
    one `Conv2DBackpropFilter`, a backprop per example where the unfolded
    input would be large. So A unfolds the input only where the layer's own
    kernel would.

    Args:
        layer: keras.layers.Conv2D. The LoRA layer.
        factors: `conv.ConvFactors` of the records, with the output gradients
            s·G Bᵀ and A's shape.
        mode: str. `layer_grads.GHOST` or `layer_grads.INSTANTIATE`.
    """

    def __init__(self, layer, factors, mode):
        self.layer, self.factors, self.mode = layer, factors, mode

    def sq_norms(self):
        """[B] squared Frobenius norms."""
        return self.factors.kernel_sq_norms(self.mode)

    def dot(self, matrix):
        """[B] ⟨U_iᵀ G_i^A, matrix⟩ = Σ_t ⟨conv(x_i, matrix), G_i^A⟩_t."""
        kernel = tf.reshape(matrix, self.factors.kernel_shape)
        h = rows_through(self.factors, lambda x: conv_rules.conv(self.layer, x, kernel))
        return tf.reduce_sum(h * self.factors.g, [1, 2])

    def clipped_sum(self, coeffs, keep=None):
        """Σ_i c_i·U_iᵀ G_i^A as a [D, r] matrix."""
        summed = self.factors.kernel_clipped_sum(coeffs, keep)
        return tf.reshape(summed, [-1, self.factors.kernel_shape[-1]])


def conv_factor_grads(layer, records, factor_grads, a_shape, k):
    """A's per-example gradients of a conv by one conv backprop per example, [B, D, r].

    Args:
        layer: the conv layer (its geometry).
        records: list of `layer_taps.TapRecord`. The recorded calls; their
            inputs are the conv op's (causally padded).
        factor_grads: list of tensors [B·k, ..., r]. The output gradient of
            the conv with kernel A, s·G Bᵀ, per call.
        a_shape: A's shape.
        k: int. Rows per example.
    """
    def one_example(pairs):
        total = None
        for x_i, g_i in pairs:
            zeros = tf.zeros(a_shape, tf.float32)
            with tf.GradientTape() as tape:
                tape.watch(zeros)
                y = conv_rules.conv(layer, x_i, zeros)  # The k rows as the conv's batch.
            part = tape.gradient(y, zeros, output_gradients=g_i)
            total = part if total is None else total + part
        return tf.reshape(total, [-1, a_shape[-1]])

    pairs = [(conv_rules.rows_by_example(r.inputs, k), conv_rules.rows_by_example(g, k))
             for r, g in zip(records, factor_grads)]
    # parallel_iterations bounds how many examples' work is in flight at once.
    return tf.map_fn(one_example, pairs, fn_output_signature=tf.float32, parallel_iterations=4)


class LoraLayout:
    """Static sizes of a LoRA layer's factors in the rows form (module docstring).

    Attributes:
        family: str. `lora_family(layer)`.
        t, p, d: int. Positions, output width and input width of the layer.
        rank: int. r.
        p_last: int. p_ℓ, the size of the kernel's last axis (B's columns).
        p_other: int. p_o = p / p_ℓ: other output axes of the kernel (heads).
    """

    def __init__(self, layer, records):
        self.family = lora_family(layer)
        if self.family == EINSUM:
            self.t, self.p, self.d = einsum_dense.EinsumDenseRule().dims(layer, records)
        else:
            self.t, self.p, self.d = layer_grads.linear_dims(layer, records)
        self.rank = int(layer.lora_rank)
        self.p_last = int(layer.lora_kernel_b.shape[-1])
        self.p_other = self.p // self.p_last

    def a_by_backprop(self, method, k=1):
        """Whether A's per-example gradients come from a conv backprop per example.

        Always for a conv other than a valid/same Conv2D; for such a Conv2D
        where A is instantiated and its unfolded input would be large
        (`conv.MAX_UNFOLDED_PER_EXAMPLE`).
        """
        if self.family == CONV:
            return True
        return (
            self.family == CONV2D
            and k * self.t * self.d > conv_rules.MAX_UNFOLDED_PER_EXAMPLE
            and layer_grads.linear_norm_mode(k * self.t, self.p_other * self.rank, self.d,
                                             method) == layer_grads.INSTANTIATE
        )

    def projects(self, method, k=1):
        """Whether both factors come from the kernel's per-example gradient M_i = U_iᵀ G_i.

        Only where U is at hand (not `a_by_backprop`), where the layer-wise
        rule would instantiate M for full fine-tuning and instantiates both
        factors (so M is no larger than what full fine-tuning would keep),
        and where forming M and projecting it, T·D·p + 2·D·p·r per example,
        is less work than the factor route's G Bᵀ, U_iᵀ G_i^A, H = U A and
        H_iᵀ G_i, 2·T·p_o·r·(p_ℓ + D). At r = 8 the small convnet's first
        conv projects (D·p = 1,024), its second conv does not (2T² < D·p).
        """
        if self.family == CONV or self.a_by_backprop(method, k):
            return False
        t = k * self.t
        if layer_grads.linear_norm_mode(t, self.p, self.d, method) != layer_grads.INSTANTIATE:
            return False
        if self.modes(method, k) != (layer_grads.INSTANTIATE, layer_grads.INSTANTIATE):
            return False
        projection = t * self.d * self.p + 2 * self.d * self.p * self.rank
        factors = 2 * t * self.p_other * self.rank * (self.p_last + self.d)
        return projection <= factors

    def modes(self, method, k=1):
        """(A's mode, B's mode): ghost or instantiated, by the layer-wise rule."""
        if self.a_by_backprop(method, k):
            mode_a = layer_grads.INSTANTIATE  # No ghost route without U.
        else:
            mode_a = layer_grads.linear_norm_mode(
                k * self.t, self.p_other * self.rank, self.d, method)
        mode_b = layer_grads.linear_norm_mode(
            k * self.t * self.p_other, self.p_last, self.rank, method)
        return mode_a, mode_b


class LoraClip(registry.LayerClip):
    """`LayerClip` of a LoRA-enabled layer: factors A and B, and the bias."""

    def __init__(self, layer, records, output_grads, context):
        self.layer = layer
        self.variables = layer_taps.own_trainable_variables(layer)
        a, b, bias = layer.lora_kernel_a, layer.lora_kernel_b, getattr(layer, "bias", None)
        for v in self.variables:
            if v is not a and v is not b and v is not bias:
                # Never leave a trainable variable unclipped (e.g. a base
                # kernel made trainable again after the rule was chosen).
                raise ValueError(
                    f"The LoRA rule clips a layer's factors and bias only, but layer "
                    f"'{layer.name}' trains {v.path}. Freeze it, or disable LoRA on the "
                    f"layer. Received: variable={v.path!r}"
                )
        k = context.k
        layout = LoraLayout(layer, records)
        self.layout = layout
        family = layout.family
        if family == EINSUM:
            self.factors = einsum_dense.EinsumFactors(layer, records, output_grads, k)
        elif family == CONV2D:
            self.factors = conv_rules.ConvFactors(layer, records, output_grads, k)
        else:
            # Dense, and a conv's output rows ([B, T, filters]) and bias.
            self.factors = layer_grads.LinearFactors(layer, records, output_grads, k)
        scale = lora_scale(layer)
        g = self.factors.g
        mode_a, mode_b = layout.modes(context.method, k)
        b_matrix = tf.cast(tf.convert_to_tensor(b), tf.float32)
        self.a_grads = self.b_grads = None
        if layout.projects(context.method, k):
            self._project(scale, b_matrix)
            return
        if registry.trains(layer, a):
            if family in (CONV2D, CONV):
                # A's own output gradient, s·G Bᵀ, per call.
                factor_grads = [
                    scale * tf.tensordot(tf.cast(grad, tf.float32), b_matrix, [[-1], [1]])
                    for grad in output_grads
                ]
                if family == CONV2D:
                    self.a_grads = ConvFactorGrad(layer, conv_rules.ConvFactors(
                        layer, records, factor_grads, k, kernel_shape=a.shape), mode_a)
                else:
                    per_example = conv_factor_grads(layer, records, factor_grads, a.shape, k)
                    self.a_grads = FactorGrad(None, None, mode_a, per_example)
            else:
                shape = tf.shape(g)
                rows = tf.reshape(g, [shape[0], shape[1], layout.p_other, layout.p_last])
                g_a = scale * tf.tensordot(rows, b_matrix, [[3], [1]])  # s·G Bᵀ
                g_a = tf.reshape(g_a, [shape[0], shape[1], layout.p_other * layout.rank])
                self.a_grads = FactorGrad(self.factors.u, g_a, mode_a)
        if registry.trains(layer, b):
            # H, the output through A alone, from the recorded inputs: B's
            # per-example gradient is H_iᵀ G_i.
            h = rows_through(self.factors, lambda x: lora_output(layer, x))
            batch = tf.shape(g)[0]
            self.b_grads = FactorGrad(
                tf.reshape(h, [batch, -1, layout.rank]),
                scale * tf.reshape(g, [batch, -1, layout.p_last]),
                mode_b,
            )

    def _project(self, scale, b_matrix):
        """Both factors' per-example gradients from M_i = U_iᵀ G_i (`LoraLayout.projects`)."""
        layout, layer = self.layout, self.layer
        m = self.factors.per_example_kernel_grads()  # [B, D, p_o·p_ℓ]
        m = tf.reshape(m, [tf.shape(m)[0], layout.d, layout.p_other, layout.p_last])
        if registry.trains(layer, layer.lora_kernel_a):
            grads = scale * tf.einsum("bdol,rl->bdor", m, b_matrix)
            grads = tf.reshape(grads, [tf.shape(m)[0], layout.d, layout.p_other * layout.rank])
            self.a_grads = FactorGrad(None, None, layer_grads.INSTANTIATE, grads)
        if registry.trains(layer, layer.lora_kernel_b):
            a = self._a_matrix(tf.cast(tf.convert_to_tensor(layer.lora_kernel_a), tf.float32))
            a = tf.reshape(a, [layout.d, layout.p_other, layout.rank])
            grads = scale * tf.einsum("bdol,dor->brl", m, a)
            self.b_grads = FactorGrad(None, None, layer_grads.INSTANTIATE, grads)

    def _a_matrix(self, a):
        """A as the [D, p_o·r] matrix of U_iᵀ G_i^A."""
        if self.layout.family == EINSUM:
            return einsum_dense.matrix_from_kernel(self.factors.layout, a)
        return tf.reshape(a, [-1, self.layout.p_other * self.layout.rank])

    def _a_kernel(self, matrix):
        """A [D, p_o·r] matrix in A's layout."""
        a = self.layer.lora_kernel_a
        if self.layout.family == EINSUM:
            return einsum_dense.kernel_from_matrix(self.factors.layout, matrix, a.shape)
        return tf.reshape(matrix, a.shape)

    def sq_norm(self, variable):
        if variable is self.layer.lora_kernel_a:
            return self.a_grads.sq_norms()
        if variable is self.layer.lora_kernel_b:
            return self.b_grads.sq_norms()
        return self.factors.bias_sq_norms()

    def dot(self, variable):
        value = tf.cast(tf.convert_to_tensor(variable), tf.float32)
        if variable is self.layer.lora_kernel_a:
            return self.a_grads.dot(self._a_matrix(value))
        if variable is self.layer.lora_kernel_b:
            return self.b_grads.dot(value)
        return tf.reduce_sum(self.factors.bias_per_example * tf.reshape(value, [1, -1]), 1)

    def clipped_sum(self, variable, coeffs, keep=None):
        if variable is self.layer.lora_kernel_a:
            return self._a_kernel(self.a_grads.clipped_sum(coeffs, keep))
        if variable is self.layer.lora_kernel_b:
            return self.b_grads.clipped_sum(coeffs, keep)
        return self.factors.bias_clipped_sum(coeffs, keep)


@registry.register_rule(keras.layers.Dense, keras.layers.EinsumDense, base_conv.BaseConv)
class LoraRule(registry.Rule):
    """Per-example norms of the LoRA factors A and B (and the bias) from U, G and H."""

    name = "lora"

    def applies(self, layer):
        if lora_family(layer) is None:
            return False
        # Only the factors and the bias: a trainable base kernel needs its
        # own per-example gradient, which the generic rule gives.
        allowed = (layer.lora_kernel_a, layer.lora_kernel_b, getattr(layer, "bias", None))
        return all(any(v is w for w in allowed)
                   for v in layer_taps.own_trainable_variables(layer))

    def decays(self, layer, variable):
        return variable is layer.lora_kernel_a or variable is layer.lora_kernel_b

    def is_offset(self, layer, variable):
        return variable is getattr(layer, "bias", None)

    def tapped_call(self, layer, original):
        family = lora_family(layer)

        def call(inputs, *args, **kwargs):
            recorder = layer_taps.active_recorder()
            if recorder is None:
                return original(inputs, *args, **kwargs)
            x = inputs
            if recorder.mode == "vectorized":
                if family == EINSUM:
                    # `tf.einsum`, which TF's pfor vectorizes correctly (see
                    # the `einsum_dense` rule's tap).
                    pre = tf.einsum(layer.equation, x, tf.cast(layer.kernel, x.dtype))
                elif family == CONV2D:
                    # A kernel gradient pfor need not serialise (`conv.vectorizable_conv`).
                    pre = conv_rules.vectorizable_conv(layer, x, layer.kernel)
                else:
                    return original(inputs, *args, **kwargs)
            elif family == DENSE:
                kernel = layer.kernel  # Keras's merged W + s·A·B.
                pre = tf.matmul(x, kernel) if x.shape.rank == 2 else tf.tensordot(x, kernel, 1)
            elif family == EINSUM:
                pre = keras.ops.einsum(layer.equation, x, layer.kernel)
            else:
                if layer.padding == "causal":
                    x = keras.ops.pad(x, layer._compute_causal_padding())
                pre = conv_rules.conv(layer, x, layer.kernel)
            if layer.bias is not None:
                pre = pre + layer.bias
            if recorder.mode == "record":
                # The pre-activation output is recorded: its gradient is G.
                pre = recorder.record(layer_taps.TapRecord(layer, x, pre))
            return layer.activation(pre) if layer.activation is not None else pre

        return call

    def clip(self, layer, records, output_grads, context):
        return LoraClip(layer, records, output_grads, context)

    def cost(self, layer, records, method, batch_size):
        layout = LoraLayout(layer, records)
        t, p, d, r = layout.t, layout.p, layout.d, layout.rank
        a, b = layer.lora_kernel_a, layer.lora_kernel_b
        if not (registry.trains(layer, a) or registry.trains(layer, b)):
            return registry.offsets_only_cost(layer, t, p, d, batch_size)
        tapped = method in registry.TAPPED_METHODS
        mode_a, mode_b = layout.modes(method if tapped else "mixed")
        if not tapped:
            mode_a = mode_b = layer_grads.INSTANTIATE
        # (positions, rows width, columns width, mode) of each trained factor.
        pieces = []
        if registry.trains(layer, a):
            pieces.append((t, d, layout.p_other * r, mode_a))
        if registry.trains(layer, b):
            pieces.append((t * layout.p_other, r, layout.p_last, mode_b))
        work = kept = 0
        projects = tapped and layout.projects(method)
        for positions, rows, columns, mode in pieces:
            if mode == layer_grads.GHOST and positions > 1:
                work += 2 * positions * positions
                kept += positions * (rows + columns)
            else:
                work += rows * columns
                kept += rows * columns
        if projects:
            # M_i, D·p per example, lives until both factors are projected.
            work += d * p
        bias = getattr(layer, "bias", None)
        if bias is not None and registry.trains(layer, bias):
            size = math.prod(int(n) for n in bias.shape)
            work += size
            kept += size
        modes = {mode for *_, mode in pieces}
        mode = layer_grads.GHOST if modes == {layer_grads.GHOST} else layer_grads.INSTANTIATE
        names = {layer_grads.GHOST: "ghost", layer_grads.INSTANTIATE: "inst."}
        why = f"r={r}: " + ", ".join(
            f"{name} {names[m]}" for name, (*_, m) in zip(
                [n for n, v in (("A", a), ("B", b)) if registry.trains(layer, v)], pieces))
        if projects:
            why = f"r={r}: factors projected from the kernel's per-example gradient"
        return registry.Cost(
            t, p, d, mode, batch_size * work * registry.BYTES,
            batch_size * kept * registry.BYTES, why=why,
        )
