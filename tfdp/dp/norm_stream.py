"""Per-example gradient norms computed inside one backward pass, layer by layer.

Asking the tape for every layer's output gradient at once keeps them all alive
until the last one is produced, and book-keeping keeps them until the clip
coefficients are known: at 224 px that is about twice the memory of
non-private training. Here each tapped call's output passes through an
identity whose custom gradient receives the layer's output gradient G as soon
as backprop produces it, computes from (recorded input, G) the layer's
per-example squared-norm contribution with the layer's rule, and returns it
as the gradient of `norm_input`, a [B] zero tensor the identity takes as a
second input. One `tape.gradient(loss, norm_input)` then returns
Σ_layers ‖g_i^layer‖², and each G is freed once its own layer is done, as in
non-private backprop (Bu et al. 2022 report mixed ghost clipping at about the
memory of non-private training this way).

A layer's clipped sum comes either from what its `LayerClip` keeps (its
instantiated per-example gradients, small by the layer-wise rule; or, for a
ghost norm, its input and output gradient, small where T is) or from a
second backward pass on Σ_i c_i·L_i ("ghost", "mixed": only for
`LayerClip.from_backward` layers, so that pass stops at the lowest of them).
"""

import tensorflow as tf


class NormStream:
    """The `on_record` hook of `layer_taps.recording` that streams norms.

    Use: watch `norm_input`, run the forward pass under
    `layer_taps.recording(on_record=stream.tap)`, call `stream.start(layers)`
    with the layers whose norms may stream (each called once), take
    `tape.gradient(loss, stream.norm_input)`, then `stream.stop()` so that
    later backward passes through the same tape skip the norm work.

    Args:
        num_examples: int or scalar tensor. Examples in the batch (rows / k).
        context: `rules.ClipContext`. Passed to each rule's `clip`.
        layer_sq_norms: callable. `LayerClip -> [B]` squared norms of all the
            layer's variables (weight decay included).
        keep_all: bool. Keep every layer's `LayerClip` (book-keeping: no
            second backward pass), not only those that are not
            `from_backward`. Defaults to False.
    """

    def __init__(self, num_examples, context, layer_sq_norms, keep_all=False):
        self.norm_input = tf.zeros([num_examples], tf.float32)
        self.kept_clips = []
        self._context = context
        self._layer_sq_norms = layer_sq_norms
        self._keep_all = keep_all
        self._wrapped = set()
        self._streaming = set()
        self._active = False

    def tap(self, record):
        """Wraps a recorded float tensor output in the norm-computing identity."""
        outputs = record.outputs
        if not (isinstance(outputs, tf.Tensor) and outputs.dtype.is_floating):
            return outputs
        self._wrapped.add(id(record))

        @tf.custom_gradient
        def identity(pre, norm_input):
            def grad(dy):
                sq_norms = self._contribution(record, dy)
                # Backprop below this layer waits for its norm: otherwise the
                # executor may run ahead and keep every layer's output
                # gradient (and unfolded input) alive at once.
                with tf.control_dependencies([sq_norms]):
                    return tf.identity(dy), sq_norms

            return tf.identity(pre), grad

        return identity(outputs, self.norm_input)

    def can_stream(self, records):
        """Whether a layer's calls can stream: one call, wrapped by `tap`.

        A layer called several times has cross terms between its calls in
        ‖Σ_calls U_iᵀ G_i‖², which no single call's backward sees.
        """
        return len(records) == 1 and id(records[0]) in self._wrapped

    def start(self, layers):
        """Turns on norm computation for `layers` in the next backward pass."""
        self._streaming = {id(layer) for layer in layers}
        self._active = True

    def stop(self):
        self._active = False

    def _contribution(self, record, output_grad):
        layer = record.layer
        if not self._active or id(layer) not in self._streaming:
            return tf.zeros_like(self.norm_input)
        # Started from the output gradient: work that reads only the layer's
        # input would otherwise run after the forward pass, for all layers at once.
        with tf.control_dependencies([output_grad]):
            layer_clip = layer._tfdp_rule.clip(layer, [record], [output_grad], self._context)
            if self._keep_all or not layer_clip.from_backward:
                self.kept_clips.append(layer_clip)
            return self._layer_sq_norms(layer_clip)
