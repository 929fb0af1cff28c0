"""Conv/dense factors: per-example squared gradient norms and clipped sums.

For a linear layer (Conv2D unfolded, or Dense) with unfolded input U_i (T×D)
and output gradient G_i (T×p), the per-example kernel gradient is U_iᵀ G_i.
Its squared norm is either computed from it ("instantiate", O(D·p) memory per
example) or from Gram matrices ("ghost", O(T²)): Σ (U_i U_iᵀ) ⊙ (G_i G_iᵀ).
A shared layer called several times is handled by concatenating its calls
along T, since the per-example gradient is then Σ_calls U_iᵀ G_i.

In-loss weight decay `0.5·wd·‖W‖²` adds wd·W to every (non-padding)
example's kernel gradient, so its squared norm grows by
2·wd·⟨U_iᵀ G_i, W⟩ + wd²‖W‖², where ⟨U_iᵀ G_i, W⟩ = Σ_t ⟨U_i W, G_i⟩_t,
i.e. the pre-bias output dotted with the output gradient.
"""

import os

import keras
import tensorflow as tf

from tfdp.dp import layer_taps

GHOST = "ghost"
INSTANTIATE = "instantiate"


def flatten_bt(x, k=1):
    """[B·k, ..., C] -> [B, k·T, C]: an example's k rows (augmentations) form one T axis.

    The per-example gradient of a group of rows is Σ_rows U_rᵀ G_r, which is
    U_iᵀ G_i with the rows' positions concatenated, so every Gram-matrix and
    per-example formula applies to groups unchanged.
    """
    shape = tf.shape(x)
    return tf.reshape(x, tf.stack([shape[0] // k, -1, shape[-1]]))


def group_rows(per_row, k):
    """[B·k, ...] per-row gradients -> [B, ...] per-example sums."""
    if k == 1:
        return per_row
    shape = tf.shape(per_row)
    grouped = tf.reshape(per_row, tf.concat([[shape[0] // k, k], shape[1:]], 0))
    return tf.reduce_sum(grouped, 1)


def keep_rows(x, keep):
    """Zeroes the leading-axis entries where `keep` is False (None: keep all).

    Drops non-finite examples from sums: NaN·0 is NaN, so scaling by a zero
    clip coefficient alone cannot remove them.
    """
    if keep is None:
        return x
    shape = [-1] + [1] * (x.shape.rank - 1)
    # A broadcast scalar, not zeros_like(x): with a static shape, Grappler
    # folds zeros_like into a constant that the function holds for good
    # (about 120 MB for ResNet-18 at 224 px, batch 16, summed over layers).
    return tf.where(tf.reshape(keep, shape), x, tf.zeros([], x.dtype))


def unfold_inputs(layer, inputs):
    """Unfolded input U as [B, T, D] for a conv or dense layer."""
    if isinstance(layer, keras.layers.Conv2D):
        kh, kw = layer.kernel_size
        if kh == kw == 1:
            # A 1×1 patch is the pixel itself; "same" never pads a 1×1 conv.
            sh, sw = layer.strides
            return flatten_bt(inputs[:, ::sh, ::sw, :])
        if inputs.shape[-1] is not None and inputs.shape[-1] <= 3:
            # With few input channels a one-hot conv unfolds faster than
            # `extract_patches` (7 against 18 ms for the default run's first
            # conv at batch 256); with 16 it is slower (12 against 5 ms).
            return flatten_bt(layer_taps.unfold_by_conv(layer, inputs, layer.kernel.shape))
        strides, dilations, padding = layer_taps.conv_geometry(layer)
        patches = tf.image.extract_patches(
            inputs, [1, kh, kw, 1], strides, dilations, padding
        )
        return flatten_bt(patches)
    return flatten_bt(inputs)


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


# Bytes of a layer's pixel-Gram norm work for the whole batch above which
# it runs over chunks of the batch, one chunk at a time. At 64 px, batch 32,
# ResNet-18's group-2 convs need 29 MiB each, and with the executor free to
# run layers' work side by side bk's accumulation peaked at 351 against
# 254 MiB for non-private training; in chunks of 8 examples, 274 MiB, for
# 4–6 % more time.
MAX_GHOST_WORK_BYTES = 8 * 2**20


def examples_per_chunk(per_example_floats):
    """Examples per chunk of work of `per_example_floats` float32 each."""
    return max(1, MAX_GHOST_WORK_BYTES // (tf.float32.size * per_example_floats))


def over_example_chunks(fn, rows, examples, chunk, k=1):
    """`fn` on `chunk` examples at a time, in order, one chunk alive at a time.

    Args:
        fn: callable `(rows, examples) -> [c]` on one chunk: a list of
            tensors [c·k, ...] and a tensor [c, ...].
        rows: list of tensors [B·k, ...], k rows per example.
        examples: tensor [B, ...].
        chunk: int. Examples per chunk.
        k: int. Rows per example. Defaults to 1.

    Returns:
        A float32 tensor [B]: `fn`'s values, chunk after chunk. A last,
        shorter chunk is padded with zeros, whose values are dropped.
    """
    b = tf.shape(examples)[0]
    chunks = (b + chunk - 1) // chunk
    pad = chunks * chunk - b

    def split(t, per):
        t = tf.pad(t, [[0, pad * per]] + [[0, 0]] * (t.shape.rank - 1))
        return tf.reshape(t, tf.concat([[chunks, chunk * per], tf.shape(t)[1:]], 0))

    values = tf.map_fn(
        lambda e: fn(e[0], e[1]),
        ([split(r, k) for r in rows], split(examples, 1)),
        fn_output_signature=tf.float32,
        parallel_iterations=1,
    )
    return tf.reshape(values, [-1])[:b]


def conv_kernel_grad(layer, inputs, output_grads):
    """The conv's kernel gradient Σ_rows U_rowᵀ G_row, by `Conv2DBackpropFilter`.

    Args:
        layer: keras.layers.Conv2D. The layer (its kernel shape and geometry).
        inputs: tensor [n, H, W, C]. Inputs of the rows to sum.
        output_grads: tensor [n, Ho, Wo, p]. Their output gradients.

    Returns:
        A tensor shaped like the kernel.
    """
    strides, dilations, padding = layer_taps.conv_geometry(layer)
    return tf.raw_ops.Conv2DBackpropFilter(
        input=inputs, filter_sizes=layer.kernel.shape.as_list(), out_backprop=output_grads,
        strides=strides, padding=padding, dilations=dilations, data_format="NHWC",
    )


def conv_per_example_kernel_grads(layer, inputs, output_grads, k=1):
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

    Returns:
        A float32 tensor [B, kh·kw·C_in, p] in the layout of the reshaped kernel.
    """
    def by_example(t):
        t = tf.cast(t, tf.float32)
        shape = tf.shape(t)
        return tf.reshape(t, tf.concat([[shape[0] // k, k], shape[1:]], 0))

    def one_example(pairs):
        total = None
        for x_i, g_i in pairs:
            part = conv_kernel_grad(layer, x_i, g_i)
            total = part if total is None else total + part
        return tf.reshape(total, [-1, layer.kernel.shape[-1]])

    pairs = [(by_example(x), by_example(g)) for x, g in zip(inputs, output_grads)]
    # parallel_iterations bounds how many examples' work is in flight at once.
    return tf.map_fn(
        one_example, pairs, fn_output_signature=tf.float32, parallel_iterations=4
    )


def has_bias(layer):
    """Whether a conv or dense layer adds a bias."""
    if isinstance(layer, keras.layers.Conv2D):
        return layer.use_bias
    return layer.bias is not None


class LinearFactors:
    """U, G (and the pre-bias output) of all calls of a conv/dense layer.

    The unfolded input U and the pre-bias output are built lazily: a conv
    layer whose norm is not a ghost norm and whose clipped sum goes through
    `Conv2DBackpropFilter` never unfolds its input.
    """

    def __init__(self, layer, records, output_grads, k=1):
        self.layer = layer
        self.k = k
        self.records = list(records)
        self.output_grads = list(output_grads)
        self.is_conv = isinstance(layer, keras.layers.Conv2D)
        gs = [flatten_bt(self.output_rows(g), k) for g in self.output_grads]
        self.g = gs[0] if len(gs) == 1 else tf.concat(gs, axis=1)
        self.g = tf.cast(self.g, tf.float32)  # Clipping arithmetic in float32 under bf16.
        self._u = None
        self._z = None
        self._per_example = None
        self._bias_per_example = None

    @property
    def u(self):
        if self._u is None:
            us = [
                flatten_bt(self.unfold(tf.cast(r.inputs, tf.float32)), self.k)
                for r in self.records
            ]
            self._u = us[0] if len(us) == 1 else tf.concat(us, axis=1)
        return self._u

    @property
    def z(self):
        if self._z is None:
            bias = self.layer.bias if has_bias(self.layer) else None
            zs = []
            for record in self.records:
                z = tf.cast(record.outputs, tf.float32)
                if bias is not None:
                    z = z - tf.cast(bias, tf.float32)
                zs.append(flatten_bt(self.output_rows(z), self.k))
            self._z = zs[0] if len(zs) == 1 else tf.concat(zs, axis=1)
        return self._z

    def unfold(self, inputs):
        """One call's input rows as U, [B·k, T, D]."""
        return unfold_inputs(self.layer, inputs)

    def output_rows(self, outputs):
        """One call's output (or output gradient) rows as [B·k, T, p], like G."""
        return outputs

    def kernel_from_matrix(self, matrix):
        """A [D, p] kernel gradient in the layout of the layer's kernel."""
        return tf.reshape(matrix, self.layer.kernel.shape)

    def kernel_sq_norms(self, mode):
        g = self.g
        if g.shape[1] == 1:
            u = self.u
            return tf.reduce_sum(tf.square(u), [1, 2]) * tf.reduce_sum(tf.square(g), [1, 2])
        if mode == GHOST:
            if self.is_conv and self._u is None:
                sq_norms = self._pixel_gram_sq_norms()
                if sq_norms is not None:
                    return sq_norms
            uu = tf.matmul(self.u, self.u, transpose_b=True)
            gg = tf.matmul(g, g, transpose_b=True)
            return tf.reduce_sum(uu * gg, [1, 2])
        # Instantiated per-example gradients are kept for the clipped sum: by
        # the layer-wise rule they are no larger than the Gram matrices.
        if self.is_conv and self._u is None and self._unfolded_size() > MAX_UNFOLDED_PER_EXAMPLE:
            self._per_example = conv_per_example_kernel_grads(
                self.layer, [r.inputs for r in self.records], self.output_grads, self.k
            )
        else:
            self._per_example = tf.matmul(self.u, g, transpose_a=True)
        return tf.reduce_sum(tf.square(self._per_example), [1, 2])

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
        chunk = examples_per_chunk(
            pixel_gram_floats(geometry, inputs[0].shape, outputs[0].shape, n)
        )
        rows = inputs[0].shape[0]
        if rows is not None and rows // self.k <= chunk:
            return sq_norms(inputs, self.g)
        return over_example_chunks(sq_norms, inputs, self.g, chunk, self.k)

    def _unfolded_size(self):
        """Floats of one example's U, T·D (static even when the batch is not)."""
        t, _, d = linear_dims(self.layer, self.records)
        return self.k * t * d

    def kernel_dot_weights(self):
        """⟨per-example kernel gradient, W⟩ for each example."""
        return tf.reduce_sum(self.z * self.g, [1, 2])

    @property
    def bias_per_example(self):
        """[B, n] per-example bias gradients (n: the bias's size); kept rather than G."""
        if self._bias_per_example is None:
            self._bias_per_example = self.per_example_bias_grads()
        return self._bias_per_example

    def per_example_bias_grads(self):
        """[B, p]: Σ_t G_i[t], the gradient of a bias added at every position."""
        return tf.reduce_sum(self.g, 1)

    def bias_sq_norms(self):
        return tf.reduce_sum(tf.square(self.bias_per_example), 1)

    def kernel_clipped_sum(self, coeffs, keep=None):
        """Σ_i c_i·(per-example kernel gradient); `keep` (per example) drops NaN ones."""
        if self._per_example is not None:
            summed = tf.tensordot(coeffs, keep_rows(self._per_example, keep), axes=1)
        elif self.is_conv:
            # Σ_i c_i U_iᵀ G_i is the conv kernel gradient of the output
            # gradient scaled per example: no unfolded input needed.
            row_coeffs = tf.repeat(coeffs, self.k) if self.k > 1 else coeffs
            row_keep = None if keep is None else tf.repeat(keep, self.k)
            summed = None
            for record, grad in zip(self.records, self.output_grads):
                part = conv_kernel_grad(
                    self.layer,
                    keep_rows(tf.cast(record.inputs, tf.float32), row_keep),
                    tf.math.multiply_no_nan(
                        tf.cast(grad, tf.float32), row_coeffs[:, None, None, None]
                    ),
                )
                summed = part if summed is None else summed + part
            return summed
        else:
            weighted = tf.math.multiply_no_nan(self.g, coeffs[:, None, None])
            u = keep_rows(self.u, keep)
            summed = tf.matmul(
                tf.reshape(u, [-1, tf.shape(u)[-1]]),
                tf.reshape(weighted, [-1, tf.shape(weighted)[-1]]),
                transpose_a=True,
            )
        return self.kernel_from_matrix(summed)

    def bias_clipped_sum(self, coeffs, keep=None):
        weighted = tf.math.multiply_no_nan(keep_rows(self.bias_per_example, keep), coeffs[:, None])
        return tf.reshape(tf.reduce_sum(weighted, 0), self.layer.bias.shape)


def linear_norm_mode(t, p, d, method):
    """The layer-wise rule of Bu et al. (2022): ghost where 2T² < p·D."""
    if method == "ghost" or t == 1:
        return GHOST
    return GHOST if 2 * t * t < p * d else INSTANTIATE


def linear_dims(layer, records):
    """(T, p, D) of a conv/dense layer from its recorded calls (static)."""
    t = 0
    for record in records:
        shape = record.outputs.shape
        n = 1
        for s in shape[1:-1]:
            n *= int(s)
        t += n
    kernel = layer.kernel.shape
    d = 1
    for s in kernel[:-1]:
        d *= int(s)
    return t, int(kernel[-1]), d


def miscomputed_batch_matmuls(graph):
    """BatchMatMul ops of `graph` whose shapes TF 2.21's oneDNN CPU kernel gets wrong.

    `tf.vectorized_map` turns a per-example matmul of a [1, T, D] input by a
    [D, p] (or [1, D, p]) weight into one of [N, 1, T, D] by [1, 1, D, p]: a
    broadcast over batch axes where both operands have size 1. The oneDNN
    BatchMatMul kernel (on by default on x86 CPUs) returns garbage for such
    shapes and can corrupt memory (a segmentation fault, `free(): invalid
    pointer`); with `TF_ENABLE_ONEDNN_OPTS=0` or on a GPU they are exact.
    Keras's `EinsumDense` and `MultiHeadAttention` projections compute
    "abc,cde->abde" that way.

    Returns:
        A list of (op, shape_a, shape_b); empty where oneDNN is off or a GPU
        is present.
    """
    if os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0" or tf.config.list_logical_devices("GPU"):
        return []
    found = []
    for op in graph.get_operations():
        if op.type not in ("BatchMatMulV2", "BatchMatMulV3"):
            continue
        a, b = (t.shape for t in op.inputs[:2])
        if a.rank is None or b.rank is None:
            continue
        n = max(a.rank, b.rank) - 2
        batch_a = [1] * (n - a.rank + 2) + a.as_list()[:-2]
        batch_b = [1] * (n - b.rank + 2) + b.as_list()[:-2]
        if batch_a != batch_b and any(x == 1 and y == 1 for x, y in zip(batch_a, batch_b)):
            found.append((op, a, b))
    return found


def checked_vectorized_map(fn, elems):
    """`tf.vectorized_map(fn, elems)`, or None where TF would compute it wrongly.

    The vectorized computation is traced first and its graph scanned
    (`miscomputed_batch_matmuls`); it runs only where the scan finds nothing.

    Args:
        fn: callable. As for `tf.vectorized_map`.
        elems: a nest of tensors, batch first.

    Returns:
        (outputs, found): `fn`'s vectorized outputs and [], or None and the
        scan's findings.
    """
    flat = tf.nest.flatten(elems)

    def vectorized(*flat_elems):
        return tf.vectorized_map(fn, tf.nest.pack_sequence_as(elems, list(flat_elems)))

    concrete = tf.function(vectorized, autograph=False).get_concrete_function(*flat)
    found = miscomputed_batch_matmuls(concrete.graph)
    if found:
        return None, found
    return concrete(*flat), []
