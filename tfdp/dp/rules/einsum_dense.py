"""Rule for `keras.layers.EinsumDense` (e.g. `MultiHeadAttention`'s projections).

An EinsumDense whose equation contracts some input axes with the kernel
(D: their sizes' product), keeps the batch and some input axes as positions
(T) and adds the kernel's remaining axes to the output (p) is a Dense layer
on [B, T, D] inputs once its axes are permuted: the per-example kernel
gradient is U_iᵀ G_i, with ghost or instantiated norms by the layer-wise rule
(2T² < p·D), as for `Dense` on 3-D inputs. Attention's query/key/value
projection "abc,cde->abde" has T = sequence positions, D = width and
p = heads × key size; its output projection "abcd,cde->abe" contracts
(heads, key size). Equations outside that form (an input axis summed away,
a kernel axis shared with the input and output) get the generic rule.
"""

import keras
import tensorflow as tf

from tfdp.dp import layer_grads
from tfdp.dp import layer_taps
from tfdp.dp.rules import linear
from tfdp.dp.rules import registry


class EinsumLayout:
    """How an EinsumDense equation maps onto U_iᵀ G_i.

    Args:
        equation: str. The layer's equation, "input,kernel->output".
        input_rank: int. Rank of the layer's input, to expand an ellipsis.

    Attributes:
        inputs, kernel, outputs: str. The equation's three specs, ellipsis
            expanded into letters.
        positions: str. Input letters kept in the output, not in the kernel
            (T), in input order, after the batch letter.
        contracted: str. Kernel letters contracted with the input (D), in
            kernel order.
        produced: str. Kernel letters that go to the output (p), in kernel order.
        valid: bool. Whether the equation has this form.
    """

    def __init__(self, equation, input_rank):
        inputs, rest = equation.replace(" ", "").split(",")
        kernel, outputs = rest.split("->")
        if "..." in inputs:
            spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation]
            ellipsis = "".join(spare[: input_rank - (len(inputs) - 3)])
            inputs = inputs.replace("...", ellipsis)
            outputs = outputs.replace("...", ellipsis)
        self.inputs, self.kernel, self.outputs = inputs, kernel, outputs
        batch = inputs[:1]
        self.positions = "".join(c for c in inputs[1:] if c in outputs and c not in kernel)
        self.contracted = "".join(c for c in kernel if c in inputs and c not in outputs)
        self.produced = "".join(c for c in kernel if c in outputs and c not in inputs)
        letters = inputs + kernel + outputs
        self.valid = (
            "..." not in kernel + outputs
            and len(inputs) == input_rank
            and all(len(spec) == len(set(spec)) for spec in (inputs, kernel, outputs))
            and batch != "" and batch not in kernel and outputs[:1] == batch
            and sorted(inputs) == sorted(batch + self.positions + self.contracted)
            and sorted(outputs) == sorted(batch + self.positions + self.produced)
            and sorted(kernel) == sorted(self.contracted + self.produced)
            and all(c.isalpha() for c in letters)
        )

    def rows(self, tensor, spec, tail):
        """`tensor` (axes `spec`) as [B, T, ∏ tail sizes], axes permuted to batch, T, tail."""
        order = spec[0] + self.positions + tail
        tensor = tf.transpose(tensor, [spec.index(c) for c in order])
        shape = tf.shape(tensor)
        width = 1
        for s in tensor.shape[1 + len(self.positions):]:
            width *= int(s)
        return tf.reshape(tensor, tf.stack([shape[0], -1, width]))


def layer_layout(layer):
    """The `EinsumLayout` of an EinsumDense layer, at its input rank."""
    rank = getattr(getattr(layer, "input_spec", None), "ndim", None)
    if rank is None:
        rank = len(layer.equation.split(",")[0])  # No ellipsis: the spec's length.
    return EinsumLayout(layer.equation, rank)


class EinsumFactors(layer_grads.LinearFactors):
    """`LinearFactors` of an EinsumDense: U, G and the kernel in permuted layouts."""

    def __init__(self, layer, records, output_grads, k=1):
        self.layout = EinsumLayout(layer.equation, records[0].inputs.shape.rank)
        super().__init__(layer, records, output_grads, k)

    def unfold(self, inputs):
        return self.layout.rows(inputs, self.layout.inputs, self.layout.contracted)

    def output_rows(self, outputs):
        return self.layout.rows(outputs, self.layout.outputs, self.layout.produced)

    def kernel_from_matrix(self, matrix):
        return kernel_from_matrix(self.layout, matrix, self.layer.kernel.shape)

    def per_example_bias_grads(self):
        # Keras's bias spans the output axes from the first of `bias_axes` on,
        # with size 1 on those not in `bias_axes`: sum G over the others.
        outputs = self.layout.outputs
        first = min(outputs.index(c) for c in self.layer.bias_axes)
        summed = []
        for grad in self.output_grads:
            grad = tf.cast(grad, tf.float32)
            axes = [a for a in range(1, len(outputs))
                    if a < first or outputs[a] not in self.layer.bias_axes]
            per_row = tf.reduce_sum(grad, axes)
            summed.append(group_rows_flat(per_row, self.k))
        return tf.add_n(summed)


def kernel_from_matrix(layout, matrix, kernel_shape):
    """A [D, p] matrix (contracted, produced letters) in the kernel's axis order.

    Args:
        layout: `EinsumLayout`. The layer's equation.
        matrix: tensor [D, p]. Rows over the contracted letters, columns over
            the produced ones, each in kernel order.
        kernel_shape: the shape of the kernel (or of a kernel with the same
            letters, e.g. a LoRA factor whose last axis is the rank).

    Returns:
        A tensor of `kernel_shape`.
    """
    order = layout.contracted + layout.produced
    permuted = tf.reshape(matrix, [kernel_shape[layout.kernel.index(c)] for c in order])
    return tf.transpose(permuted, [order.index(c) for c in layout.kernel])


def matrix_from_kernel(layout, kernel):
    """The inverse of `kernel_from_matrix`: a kernel as its [D, p] matrix."""
    order = layout.contracted + layout.produced
    permuted = tf.transpose(kernel, [layout.kernel.index(c) for c in order])
    d = 1
    for c in layout.contracted:
        d *= int(kernel.shape[layout.kernel.index(c)])
    return tf.reshape(permuted, [d, -1])


def group_rows_flat(per_row, k):
    """[B·k, ...] per-row bias gradients -> [B, n] per-example sums."""
    return tf.reshape(layer_grads.group_rows(per_row, k), [tf.shape(per_row)[0] // k, -1])


@registry.register_rule(keras.layers.EinsumDense)
class EinsumDenseRule(linear.LinearRule):
    """Ghost or instantiated norms of U_iᵀ G_i over the equation's positions."""

    name = "einsum_dense"

    def applies(self, layer):
        if type(layer).call is not keras.layers.EinsumDense.call or not registry.is_plain(layer):
            return False
        return layer_layout(layer).valid

    def factors(self, layer, records, output_grads, k):
        return EinsumFactors(layer, records, output_grads, k)

    def dims(self, layer, records):
        layout = EinsumLayout(layer.equation, records[0].inputs.shape.rank)
        kernel = layer.kernel.shape
        p = d = 1
        for c in layout.produced:
            p *= int(kernel[layout.kernel.index(c)])
        for c in layout.contracted:
            d *= int(kernel[layout.kernel.index(c)])
        t = 0
        for record in records:
            n = 1
            for c in layout.positions:
                n *= int(record.outputs.shape[layout.outputs.index(c)])
            t += n
        return t, p, d

    def tapped_call(self, layer, original):
        def call(inputs, *args, **kwargs):
            recorder = layer_taps.active_recorder()
            if recorder is None:
                return original(inputs, *args, **kwargs)
            if recorder.mode == "vectorized":
                # Keras computes "abc,cde->abde" and similar equations as a
                # matmul of a 3-D input with a 2-D kernel (a broadcasting
                # BatchMatMulV2), which TF's pfor vectorizes wrongly and
                # which can corrupt memory (TF 2.21); `tf.einsum` is
                # vectorized correctly.
                pre = tf.einsum(layer.equation, inputs, tf.cast(layer.kernel, inputs.dtype))
            else:
                pre = keras.ops.einsum(layer.equation, inputs, layer.kernel)
            if layer.bias is not None:
                pre = pre + layer.bias
            if recorder.mode == "record":
                # The pre-activation output is recorded: its gradient is G.
                pre = recorder.record(layer_taps.TapRecord(layer, inputs, pre))
            return layer.activation(pre) if layer.activation is not None else pre

        return call
