"""The "jacobian" clipping method: a loss vector and the tape that recorded it.

Every other method (`clipping.clipped_grad_sum`) is handed the model and the
per-example loss function, and runs the forward pass itself. TF-Privacy's
custom loop hands over only what the user computed: a vector of losses and
the `tf.GradientTape` that recorded it. There is no model to tap and no
function to call again, so the per-unit gradients are the rows of the
Jacobian of that vector, `tape.jacobian(losses, variables)`: one backward
pass per row (vectorized by `pfor`), each example's gradient instantiated.
The rows are clipped with the engine's `clip_rule.clip_coefficients`, so the
sum is the one the naive loop would form from the same units.

A unit is one row of `losses`: an example, or a microbatch whose row is the
mean loss of its examples (TF-Privacy's `num_microbatches`), which the naive
loop reproduces with `augmentation_multiplicity` = the microbatch size.

Non-finite units: a unit whose Jacobian row is NaN/Inf gets coefficient 0
and its row is zeroed (0·NaN is NaN), and its norm is returned non-finite so
that the caller counts it. A tape cannot drop such a unit the way the model
methods do (they recompute, or form the sums from factors with its rows
zeroed): the recorded backward pass contracts every weight gradient over
the batch, so a NaN activation of one example, times the zero output
gradient of another unit's row, makes that row NaN too (0·NaN). In practice
a NaN/Inf example makes every row non-finite, and the whole batch is
dropped (`docs/CLIPPING.md`, "The jacobian method").
"""

import keras
import tensorflow as tf

from tfdp import validation
from tfdp.dp import clip_rule


def jacobian_clipped_sum(tape, losses, variables, l2_norm_clip, *,
                         unconnected_gradients_to_zero=False, clipping="standard",
                         clipping_gamma=validation.DEFAULT_CLIPPING_GAMMA):
    """Σ_j clip(∇ losses[j], C) over the rows of a loss vector, from its tape.

    The clipping method of a loss vector recorded by a tape, with no model to
    tap ("jacobian", `clipping.TAPE_METHODS`): the rows of
    `tape.jacobian(losses, variables)` are each clipped to norm C with
    `clip_rule.clip_coefficients` and summed.

    Args:
        tape: `tf.GradientTape`. Recorded `losses`; a non-persistent tape is
            used up by this call.
        losses: `[M]` tensor. One loss per unit (an example, or a
            microbatch's mean loss).
        variables: list of variables (Keras or `tf.Variable`) to
            differentiate.
        l2_norm_clip: float. The clipping bound C > 0.
        unconnected_gradients_to_zero: bool. A variable that `losses` does
            not reach gets zero gradients instead of an error. Defaults to
            False.
        clipping: str. "standard" or "automatic"
            (`clip_rule.clip_coefficients`). Defaults to "standard".
        clipping_gamma: float. γ of "automatic". Defaults to 0.01.

    Returns:
        `(summed, norms)`: a list of tensors shaped like `variables`, and the
        `[M]` unclipped gradient norms of the rows (NaN/Inf for a dropped
        one).

    Raises:
        ValueError: for a C that is not a positive finite number, for
            `losses` that is not a vector, or, without
            `unconnected_gradients_to_zero`, for a variable that `losses`
            does not reach.
    """
    rule = clip_rule.ClipRule(l2_norm_clip, clipping, clipping_gamma)
    losses = tf.convert_to_tensor(losses)
    if losses.shape.rank != 1:
        raise ValueError(
            "The jacobian clipping method takes a vector of losses, one per example "
            f"or microbatch. Received: losses of shape {losses.shape}"
        )
    unconnected = (tf.UnconnectedGradients.ZERO if unconnected_gradients_to_zero
                   else tf.UnconnectedGradients.NONE)
    # Through the tf.Variable a Keras variable holds: TensorFlow's zeros for
    # an unconnected source need its tf.DType (a Keras variable's is a str).
    sources = [v.value if isinstance(v, keras.Variable) else v for v in variables]
    jacobians = tape.jacobian(losses, sources, unconnected_gradients=unconnected)
    missing = [v.name for v, j in zip(variables, jacobians) if j is None]
    if missing:
        raise ValueError(
            "The loss does not depend on some variables, whose gradients are None: "
            "pass `unconnected_gradients_to_zero=True` (as TF-Privacy's optimizers "
            f"take it) or leave them out of the variables. Received: {missing}"
        )
    # Embedding gradients may come back as IndexedSlices: the norm of their
    # values would miscount repeated ids.
    jacobians = [tf.convert_to_tensor(j) for j in jacobians]
    units = tf.shape(losses)[0]
    squares = [tf.reduce_sum(tf.reshape(tf.square(tf.cast(j, tf.float32)), [units, -1]), axis=1)
               for j in jacobians]
    norms = tf.sqrt(tf.add_n(squares))
    # min(1, C/‖g_j‖), and 0 for a non-finite row, as on every method.
    factors = rule.coefficients(norms, tf.ones_like(norms))
    finite = tf.math.is_finite(norms)
    summed = []
    for j in jacobians:
        # The dropped rows zeroed too: their zero coefficient alone leaves 0·NaN.
        rows = tf.reshape(finite, [-1] + [1] * (j.shape.rank - 1))
        j = tf.where(rows, j, tf.zeros_like(j))
        summed.append(tf.tensordot(tf.cast(factors, j.dtype), j, axes=1))
    return summed, norms
