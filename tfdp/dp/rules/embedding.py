"""Rule for `keras.layers.Embedding`: ghost norms from token ids.

Example i's gradient of the table is Σ_t onehot(id_it) G_itᵀ, so its squared
norm is Σ_(t,s) [id_it = id_is]·⟨G_it, G_is⟩ and the clipped sum is a
segment sum of c_i·G_it over the ids.
"""

import keras
import tensorflow as tf

from tfdp.dp import layer_grads
from tfdp.dp.rules import registry


class EmbeddingClip(registry.LayerClip):
    """Token ids and output gradients of all calls of an Embedding layer."""

    def __init__(self, layer, records, output_grads, k=1):
        self.layer = layer
        self.variables = [layer.embeddings]
        self.from_backward = registry.is_float32(layer)
        ids = [
            tf.reshape(tf.cast(r.inputs, tf.int32), [tf.shape(r.inputs)[0] // k, -1])
            for r in records
        ]
        gs = [layer_grads.flatten_bt(tf.cast(g, tf.float32), k) for g in output_grads]
        self.ids = ids[0] if len(ids) == 1 else tf.concat(ids, 1)
        self.g = gs[0] if len(gs) == 1 else tf.concat(gs, 1)

    def sq_norm(self, variable):
        same = tf.cast(tf.equal(self.ids[:, :, None], self.ids[:, None, :]), self.g.dtype)
        gg = tf.einsum("btd,bsd->bts", self.g, self.g)
        return tf.reduce_sum(same * gg, [1, 2])

    def dot(self, variable):
        rows = tf.gather(tf.convert_to_tensor(variable), self.ids)
        return tf.reduce_sum(rows * self.g, [1, 2])

    def clipped_sum(self, variable, coeffs, keep=None):
        weighted = tf.math.multiply_no_nan(self.g, coeffs[:, None, None])
        dim = tf.shape(self.g)[-1]
        return tf.math.unsorted_segment_sum(
            tf.reshape(weighted, [-1, dim]),
            tf.reshape(self.ids, [-1]),
            self.layer.embeddings.shape[0],
        )


@registry.register_rule(keras.layers.Embedding)
class EmbeddingRule(registry.Rule):
    """Always a ghost norm: T² per example against a vocabulary-sized gradient."""

    name = "embedding"

    def applies(self, layer):
        return type(layer).call is keras.layers.Embedding.call and registry.is_plain(layer)

    def clip(self, layer, records, output_grads, context):
        return EmbeddingClip(layer, records, output_grads, context.k)

    def cost(self, layer, records, method, batch_size):
        t = sum(int(tf.size(r.inputs)) for r in records)
        p, d = int(layer.embeddings.shape[1]), int(layer.embeddings.shape[0])
        memory = batch_size * 2 * t * t * registry.BYTES
        return registry.Cost(t, p, d, layer_grads.GHOST, memory,
                             batch_size * t * p * registry.BYTES, why="token ids")
