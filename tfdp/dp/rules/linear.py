"""The shared part of the Dense and Conv2D rules: a linear map U_i W + b.

The per-example kernel gradient is U_iᵀ G_i (unfolded input U_i, T×D; output
gradient G_i, T×p). Its norm is a ghost norm or instantiated by the layer-wise
rule of Bu et al. (2022); see `layer_grads`.
"""

import math

import tensorflow as tf

from tfdp.dp import layer_grads
from tfdp.dp import layer_taps
from tfdp.dp.rules import registry


class LinearClip(registry.LayerClip):
    """`LayerClip` of a conv or dense layer from its `LinearFactors`."""

    def __init__(self, rule, layer, records, output_grads, context):
        self.layer = layer
        self.factors = rule.factors(layer, records, output_grads, context.k)
        t, p, d = rule.dims(layer, records)
        self.mode = layer_grads.linear_norm_mode(
            t, p, d, context.method, rule.ghost_kept_floats(layer, records))
        self.variables = layer_taps.own_trainable_variables(layer)
        # Instantiated per-example gradients are kept for the sum (they are
        # small by the layer-wise rule or bk's exception), so a second
        # backward pass need not reach this layer. Under mixed precision that
        # pass would compute U_iᵀ G_i in bfloat16 while the norm is float32:
        # the sum then comes from here too. With the kernel frozen, only the
        # bias's [B, p] per-example gradients are formed (U is never
        # unfolded), and its sum comes from them.
        self.from_backward = (
            registry.is_float32(layer) and self.mode == layer_grads.GHOST
            and registry.trains(layer, layer.kernel)
        )

    def _is_kernel(self, variable):
        return variable is self.layer.kernel

    def sq_norm(self, variable):
        if self._is_kernel(variable):
            return self.factors.kernel_sq_norms(self.mode)
        return self.factors.bias_sq_norms()

    def dot(self, variable):
        if self._is_kernel(variable):
            return self.factors.kernel_dot_weights()
        summed = self.factors.bias_per_example
        return tf.reduce_sum(summed * tf.reshape(tf.convert_to_tensor(variable), [1, -1]), 1)

    def clipped_sum(self, variable, coeffs, keep=None):
        if self._is_kernel(variable):
            return self.factors.kernel_clipped_sum(coeffs, keep)
        return self.factors.bias_clipped_sum(coeffs, keep)


class LinearRule(registry.Rule):
    """Base of the rules of layers whose kernel gradient is U_iᵀ G_i."""

    def decays(self, layer, variable):
        return variable is layer.kernel

    def factors(self, layer, records, output_grads, k):
        """The layer's `layer_grads.LinearFactors` (U and G in [B, T, ·] form)."""
        return layer_grads.LinearFactors(layer, records, output_grads, k)

    def dims(self, layer, records):
        """(T, p, D) from the recorded calls (static)."""
        return layer_grads.linear_dims(layer, records)

    def clip(self, layer, records, output_grads, context):
        return LinearClip(self, layer, records, output_grads, context)

    def is_offset(self, layer, variable):
        return variable is getattr(layer, "bias", None)

    def cost(self, layer, records, method, batch_size):
        t, p, d = self.dims(layer, records)
        if not registry.trains(layer, layer.kernel):
            return registry.offsets_only_cost(layer, t, p, d, batch_size)
        ghost_kept = self.ghost_kept_floats(layer, records)
        if method in registry.TAPPED_METHODS:
            mode = layer_grads.linear_norm_mode(t, p, d, method, ghost_kept)
        else:
            mode = layer_grads.INSTANTIATE
        pixel_gram = None
        if mode == layer_grads.GHOST:
            pixel_gram = self.pixel_gram_floats(layer, records)
        if pixel_gram:
            # Pixel Gram P of the padded input, then U Uᵀ and G Gᵀ, in
            # chunks of the batch where that is large.
            chunk = layer_grads.examples_per_chunk(pixel_gram)
            memory = min(batch_size, chunk) * pixel_gram
        elif mode == layer_grads.GHOST:
            memory = batch_size * 2 * t * t
        else:
            # Per-example gradients; a conv's come from Conv2DBackpropFilter
            # one example at a time, with no unfolded input.
            memory = batch_size * d * p
        kept = batch_size * (t * p if mode == layer_grads.GHOST else d * p)
        why = (registry.layerwise_why(t, p, d, method, ghost_kept)
               if method in registry.TAPPED_METHODS
               else f"method={method}")
        return registry.Cost(
            t, p, d, mode, memory * registry.BYTES, kept * registry.BYTES,
            pixel_gram=bool(pixel_gram), why=why,
        )

    def ghost_kept_floats(self, layer, records):
        """Floats per example that bk keeps for the layer's ghost-norm sum, or None.

        The sum Uᵀ(c·G) needs each call's input and output gradient until the
        clipping coefficients are known; where the per-example gradient is no
        larger, bk instantiates it (`layer_grads.linear_norm_mode`). None
        leaves the choice to the layer-wise rule alone.
        """
        return sum(
            math.prod(int(s) for s in record.inputs.shape[1:])
            + math.prod(int(s) for s in record.outputs.shape[1:])
            for record in records
        )

    def pixel_gram_floats(self, layer, records):
        """Floats per example of a cheaper Gram-matrix ghost-norm route, or None.

        A conv's route through the pixel Gram (`conv.conv_input_gram`).
        """
        return None
