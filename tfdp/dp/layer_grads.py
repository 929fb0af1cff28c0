"""Linear-layer factors: per-example squared gradient norms and clipped sums.

For a linear layer (Dense, EinsumDense, or a conv with its input unfolded;
the layer-specific parts live with their rules in `tfdp.dp.rules`) with unfolded input U_i (T×D)
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

import tensorflow as tf

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
            bias = getattr(self.layer, "bias", None)
            zs = []
            for record in self.records:
                z = tf.cast(record.outputs, tf.float32)
                if bias is not None:
                    z = z - tf.cast(bias, tf.float32)
                zs.append(flatten_bt(self.output_rows(z), self.k))
            self._z = zs[0] if len(zs) == 1 else tf.concat(zs, axis=1)
        return self._z

    def unfold(self, inputs):
        """One call's input rows as U, [B·k, T, D] (a conv unfolds its patches)."""
        return inputs

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
            uu = self.input_gram()
            gg = tf.matmul(g, g, transpose_b=True)
            return tf.reduce_sum(uu * gg, [1, 2])
        # Instantiated per-example gradients are kept for the clipped sum: by
        # the layer-wise rule they are no larger than the Gram matrices.
        self._per_example = self.per_example_kernel_grads()
        return tf.reduce_sum(tf.square(self._per_example), [1, 2])

    def input_gram(self):
        """U Uᵀ, [B, T, T]."""
        return tf.matmul(self.u, self.u, transpose_b=True)

    def per_example_kernel_grads(self):
        """U_iᵀ G_i, [B, D, p]."""
        return tf.matmul(self.u, self.g, transpose_a=True)

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


def linear_norm_mode(t, p, d, method, ghost_kept=None):
    """The layer-wise rule of Bu et al. (2022): ghost where 2T² < p·D.

    Under "bk" a layer is also instantiated where its per-example gradient
    (D·p floats per example) is no larger than `ghost_kept`, what bk would
    keep per example for the layer's ghost-norm sum Uᵀ(c·G): its input and
    output gradient, alive until the clipping coefficients are known. There
    the per-example gradients replace that sum's matmul, so instantiating
    saves the Gram matrices' work, T²(D + p) per example, and keeps no more
    (attention projections at T ≥ D/2, e.g. ViT-S/16's at T = 197, D = 384).

    Args:
        t, p, d: int. Positions, output width and input width of the layer.
        method: str. The clipping method.
        ghost_kept: int or None. Floats per example bk keeps for the layer's
            ghost sum; None where instantiating is not cheaper in time (a
            conv's per-example gradients come from a backprop per example).
            Defaults to None.

    Returns:
        `GHOST` or `INSTANTIATE`.
    """
    if method == "ghost" or t == 1:
        return GHOST
    if 2 * t * t >= p * d:
        return INSTANTIATE
    if method == "bk" and ghost_kept is not None and d * p <= ghost_kept:
        return INSTANTIATE
    return GHOST


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
