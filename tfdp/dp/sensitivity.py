"""`check_sensitivity`: an empirical leave-one-out check of the clipping bound.

DP needs every example's contribution to the clipped sum S to be at most C in
L2 norm. For each example j of a probe batch this measures
‖S(D) − S(D without j)‖ / C, removing j as the data pipeline pads a batch: its
input zeroed and its weight 0, so that every other example keeps its row (and
its dropout mask: Keras random state is restored before each sum). Any figure
above 1 (beyond float error) means the engine does not bound this model.
"""

import numpy as np
import tensorflow as tf

from tfdp.dp import clipping

TOLERANCE = 1e-4  # Float error allowed above 1 (`check_sensitivity` figures).


def check_sensitivity(model, loss, batch, l2_norm_clip, method="auto", **clip_kwargs):
    """Largest leave-one-out contribution over C, for each method.

    Args:
        model: keras.Model. The model to train.
        loss: callable. `(y_true, y_pred) -> [B]` per-example losses.
        batch: tuple `(x, y)` or `(x, y, sample_weight)`. A small probe batch
            (a few examples: the cost is one clipped sum per example).
        l2_norm_clip: float. The clipping bound C.
        method: str or sequence of str. Clipping method(s) to check.
            Defaults to "auto".
        **clip_kwargs: passed to `clipped_grad_sum` (e.g. `weight_decay`,
            `augmentation_multiplicity`).

    Returns:
        For one method, a float: max_j ‖S(D) − S(D \\ {j})‖ / C. For a
        sequence, a dict from method to that figure.

    Raises:
        ValueError: when a method refuses the model (e.g. tied weights with a
            tapped method, or a layer that mixes examples).
    """
    if not isinstance(method, str):
        return {
            m: check_sensitivity(model, loss, batch, l2_norm_clip, m, **clip_kwargs)
            for m in method
        }
    x, y = tf.convert_to_tensor(batch[0]), tf.convert_to_tensor(batch[1])
    rows = int(x.shape[0])
    weights = (
        tf.ones([rows], tf.float32) if len(batch) < 3 or batch[2] is None
        else tf.cast(tf.reshape(batch[2], [-1]), tf.float32)
    )
    k = int(clip_kwargs.get("augmentation_multiplicity", 1))
    state = [(v, v.numpy()) for v in model.non_trainable_variables]

    def clipped_sum(inputs, sample_weight):
        for v, value in state:  # The same random draws (dropout masks) each time.
            v.assign(value)
        grads, _ = clipping.clipped_grad_sum(
            model, loss, inputs, y, l2_norm_clip=l2_norm_clip, method=method,
            sample_weight=sample_weight, **clip_kwargs,
        )
        return [tf.convert_to_tensor(g) for g in grads]

    try:
        full = clipped_sum(x, weights)
        worst = 0.0
        for j in range(rows // k):
            if not np.any(weights.numpy()[j * k:(j + 1) * k] > 0):
                continue
            keep = np.ones([rows], "float32")
            keep[j * k:(j + 1) * k] = 0.0
            keep_x = tf.reshape(tf.constant(keep), [-1] + [1] * (x.shape.rank - 1))
            without = clipped_sum(x * tf.cast(keep_x, x.dtype), weights * keep)
            diff = tf.linalg.global_norm([a - b for a, b in zip(full, without)])
            worst = max(worst, float(diff) / float(l2_norm_clip))
    finally:
        for v, value in state:
            v.assign(value)
    return worst


def refuse_unbounded(figure, method):
    """Raises when a `check_sensitivity` figure exceeds 1 + `TOLERANCE`."""
    if figure > 1.0 + TOLERANCE:
        raise ValueError(
            f"The clipping engine does not bound this model with method={method!r}: "
            f"one example changes the clipped sum by {figure:.6f}·C (> 1 + {TOLERANCE}). "
            "Training would not be differentially private. Use method='naive' or "
            "'vectorized', or change the layers that the probe names. "
            f"Received: sensitivity={figure:.6f}, method={method!r}"
        )
