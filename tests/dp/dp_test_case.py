"""Shared helpers for DP engine tests: models and a method-equivalence check."""

import keras
import numpy as np
import tensorflow as tf

from tfdp import dp


def per_example_xent(y_true, logits):
    return keras.losses.sparse_categorical_crossentropy(y_true, logits, from_logits=True)


def per_example_embedding_loss(y_true, outputs):
    return tf.reduce_sum(tf.square(outputs - tf.cast(y_true, outputs.dtype)[:, None]), -1)


def text_model(vocab=20, seq=7, dim=8):
    """Embedding + Dense on 3-D inputs + LayerNorm + a shared Dense."""
    ids = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim, name="embedding")(ids)
    shared = keras.layers.Dense(dim, activation="tanh", name="shared_dense")
    h = shared(h)
    h = keras.layers.LayerNormalization(epsilon=1e-5, name="layer_norm")(h)
    h = shared(h)  # Called twice: its per-example gradient sums both calls.
    h = keras.layers.GlobalAveragePooling1D()(h)
    out = keras.layers.Dense(3, name="head")(h)
    return keras.Model(ids, out)


class DPTestCase(tf.test.TestCase):
    """Checks that every clipping method equals the naive per-example loop."""

    def assert_methods_match_naive(self, model, loss_fn, x, y, methods, sample_weight=None,
                                   weight_decay=0.0, rtol=1e-4, weight_decay_variables=None):
        """Each method's norms and clipped sum equal the naive loop's; returns C.

        C is the median norm, so that some examples are clipped and some not.
        """
        kwargs = dict(sample_weight=sample_weight, weight_decay=weight_decay,
                      weight_decay_variables=weight_decay_variables)
        _, norms = dp.clipped_grad_sum(
            model, loss_fn, x, y, l2_norm_clip=1e9, method="naive", **kwargs
        )
        real = norms.numpy()[norms.numpy() > 0]
        # C at the median norm: some examples are clipped, some are not.
        clip = float(np.median(real))
        self.assertGreater(np.sum(real > clip * 1.001), 0)
        self.assertGreater(np.sum(real < clip * 0.999), 0)
        ref_grads, ref_norms = dp.clipped_grad_sum(
            model, loss_fn, x, y, l2_norm_clip=clip, method="naive", **kwargs
        )
        for method in methods:
            grads, norms = dp.clipped_grad_sum(
                model, loss_fn, x, y, l2_norm_clip=clip, method=method, **kwargs
            )
            self.assertAllClose(ref_norms, norms, rtol=rtol, atol=1e-5, msg=f"norms, method={method}")
            self.assertLen(grads, len(model.trainable_variables))
            for v, g, r in zip(model.trainable_variables, grads, ref_grads):
                scale = float(tf.reduce_max(tf.abs(r))) + 1e-6
                self.assertAllClose(
                    r / scale, g / scale, rtol=rtol, atol=rtol,
                    msg=f"grad of {v.path}, method={method}",
                )
        return clip
