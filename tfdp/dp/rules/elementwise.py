"""Rule for weights added or multiplied elementwise: class token, position
embedding, layer scale (`tfdp.layers`, and Keras ConvNeXt's `LayerScale`).

Example i's gradients follow from the output gradient G_i alone:
- x + E (`AddPositionEmbedding`): ∂L_i/∂E = G_i. Its norm is ‖G_i‖², with
  no extra memory (a ghost norm: nothing is instantiated); "ghost" and
  "mixed" take the sum Σ_i c_i·G_i from the second backward pass, which
  computes exactly that.
- [t; x] (`ClassToken`): ∂L_i/∂t = G_i at position 0, [C] per example.
- x ⊙ γ (`LayerScale`): ∂L_i/∂γ = Σ_positions G_i ⊙ x_i, [C] per example.
The last two are instantiated: C floats per example.
"""

import keras
import tensorflow as tf

from tfdp.dp import layer_grads
from tfdp.dp.rules import registry
from tfdp.layers import vit_layers

try:  # Keras's own layer scale, in keras.applications.ConvNeXt*.
    from keras.src.applications.convnext import LayerScale as KerasLayerScale
except ImportError:  # pragma: no cover (a Keras without it)
    KerasLayerScale = None

_SCALES = tuple(c for c in (vit_layers.LayerScale, KerasLayerScale) if c is not None)
_CALLS = {cls: cls.call for cls in (vit_layers.ClassToken, vit_layers.AddPositionEmbedding)
          + _SCALES}


def _weight(layer):
    """The layer's one elementwise weight."""
    if isinstance(layer, vit_layers.ClassToken):
        return layer.token
    if isinstance(layer, vit_layers.AddPositionEmbedding):
        return layer.embedding
    return layer.gamma


def _per_row(layer, record, grad):
    """[B·k, ...] per-row gradients of the layer's weight."""
    grad = tf.cast(grad, tf.float32)
    if isinstance(layer, vit_layers.ClassToken):
        return grad[:, 0, :]
    if isinstance(layer, vit_layers.AddPositionEmbedding):
        return grad
    x = tf.cast(record.inputs, tf.float32)
    channels = int(grad.shape[-1])
    return tf.reduce_sum(tf.reshape(grad * x, [tf.shape(grad)[0], -1, channels]), 1)


class ElementwiseClip(registry.PerExampleClip):
    """Per-example gradients [B, *weight shape]; the sum from the second backward
    pass for a float32 position embedding (its per-example gradient is G)."""

    def __init__(self, layer, variable, per_example):
        shape = (-1,) + tuple(int(d) for d in variable.shape)  # Static: traces too.
        super().__init__([variable], [tf.reshape(per_example, shape)])
        self.from_backward = (
            isinstance(layer, vit_layers.AddPositionEmbedding) and registry.is_float32(layer)
        )


@registry.register_rule(vit_layers.ClassToken, vit_layers.AddPositionEmbedding, *_SCALES)
class ElementwiseRule(registry.Rule):
    """Exact per-example gradients of an elementwise weight from G (no recomputation)."""

    name = "elementwise"

    def applies(self, layer):
        return any(
            isinstance(layer, cls) and type(layer).call is call for cls, call in _CALLS.items()
        )

    def clip(self, layer, records, output_grads, context):
        total = None
        for record, grad in zip(records, output_grads):
            per_row = _per_row(layer, record, grad)
            total = per_row if total is None else total + per_row
        per_example = layer_grads.group_rows(total, context.k)
        return ElementwiseClip(layer, _weight(layer), per_example)

    def cost(self, layer, records, method, batch_size):
        size = int(tf.size(_weight(layer)))
        kept = batch_size * size * registry.BYTES
        if isinstance(layer, vit_layers.AddPositionEmbedding):
            # The per-example gradient is G itself: no work memory.
            return registry.Cost(0, size, 1, layer_grads.GHOST, 0, kept, why="gradient is G")
        return registry.Cost(0, size, 1, layer_grads.INSTANTIATE, kept, kept,
                             why="C per example")
