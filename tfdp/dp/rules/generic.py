"""The fallback rule: per-example gradients of any layer by vectorized VJPs."""

import keras
from keras.src.layers.convolutional import base_conv
import tensorflow as tf

from tfdp.dp import layer_grads
from tfdp.dp import layer_taps
from tfdp.dp.rules import registry


def generic_per_example_grads(layer, records, output_grads, variables):
    """Per-example gradients of a layer's own variables, by vectorized VJPs.

    Each example's recorded input is run through the layer again, alone, and
    differentiated against its output gradient. Exact for any layer whose
    output for an example depends only on that example's input
    (`model_probe` refuses the others). Where TF would vectorize the layer
    wrongly (`layer_grads.miscomputed_batch_matmuls`) the examples run one
    at a time. Where the layer draws random numbers
    (in-layer dropout) the recomputation draws its own; the norm and the
    clipped sum then both come from these gradients, so the bound holds.
    """
    total = None
    for record, grad in zip(records, output_grads):

        def one_example(args, record=record):
            x_i, g_i = args
            x1 = tf.nest.map_structure(lambda t: t[None], x_i)
            g1 = tf.nest.map_structure(lambda t: t[None], g_i)
            with layer_taps.suspended(), tf.GradientTape() as tape:
                out = record.call_fn(x1)
            return tape.gradient(
                out, variables, output_gradients=g1,
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )

        grads, found = layer_grads.checked_vectorized_map(one_example, (record.inputs, grad))
        if found:
            # TF would vectorize this layer wrongly: one example at a time.
            grads = tf.map_fn(
                one_example, (record.inputs, grad),
                fn_output_signature=[tf.TensorSpec(v.shape, v.dtype) for v in variables],
            )
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return total


class InstantiatingRule(registry.Rule):
    """A rule that instantiates per-example gradients of all the layer's variables.

    The sum is always formed from them ("ghost"/"mixed" too): they exist
    already, and the second backward pass need not compute what they do.
    """

    why = "per-example VJPs"  # Why instantiated, shown by `dp.plan`.

    def per_example_grads(self, layer, records, output_grads, variables):
        """Per-row gradients, one [B·k, ...] tensor per variable."""
        raise NotImplementedError

    def clip(self, layer, records, output_grads, context):
        variables = layer_taps.own_trainable_variables(layer)
        per_row = self.per_example_grads(layer, records, output_grads, variables)
        per_example = [
            tf.cast(layer_grads.group_rows(g, context.k), tf.float32) for g in per_row
        ]
        return registry.PerExampleClip(variables, per_example)

    def cost(self, layer, records, method, batch_size):
        params = sum(int(v.numpy().size) for v in layer_taps.own_trainable_variables(layer))
        memory = batch_size * params * registry.BYTES
        return registry.Cost(0, 0, 0, layer_grads.INSTANTIATE, memory, memory, why=self.why)


# The layers whose kernels take weight decay when they fall back to this rule.
_KERNEL_LAYERS = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    base_conv.BaseConv,
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
)
_KERNEL_NAMES = ("kernel", "depthwise_kernel", "pointwise_kernel")


@registry.register_rule(keras.layers.Layer)
class GenericRule(InstantiatingRule):
    """Any layer without a dedicated rule (e.g. a custom layer or EinsumDense)."""

    name = "generic"

    def decays(self, layer, variable):
        # Conv and dense kernels on this rule (a modified `call`, groups,
        # mixed precision, transposed and 1-D convolutions) are decayed as on
        # their own rules.
        return isinstance(layer, _KERNEL_LAYERS) and any(
            variable is getattr(layer, name, None) for name in _KERNEL_NAMES)

    def is_offset(self, layer, variable):
        # A variable the layer calls its bias (Keras's convention: transposed
        # convs, grouped convs, a custom layer's `self.bias`).
        return variable is getattr(layer, "bias", None)

    def per_example_grads(self, layer, records, output_grads, variables):
        return generic_per_example_grads(layer, records, output_grads, variables)
