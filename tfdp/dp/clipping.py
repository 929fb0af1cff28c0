"""`clipped_grad_sum`: the sum over a batch of per-example clipped gradients.

Five methods give the same result to float tolerance:
- "naive": a Python loop over examples; the reference.
- "vectorized": `tf.vectorized_map` over the whole model, with conv kernel
  gradients computed by unfolding so that pfor needs no while_loop.
- "ghost": per-layer ghost norms (Gram matrices) for every conv/dense/
  embedding layer, then a second backward pass on Σ_i c_i·L_i.
- "mixed": ghost norm or per-example instantiation per layer by the rule
  2·T² < p·D (Bu et al. 2022); the instantiated layers' sums from their
  per-example gradients, the ghost layers' from the second backward pass.
- "bk": book-keeping. Norms as in "mixed"; every clipped sum is formed from
  what the norm kept (per-example gradients, or the layer's input and output
  gradient), with no second backward pass. The default ("auto").

The last three ("tapped") loop over per-layer rules (`tfdp.dp.rules`) and
compute each layer's norm inside the backward pass, as soon as its output
gradient exists (`norm_stream`), so that peak memory stays near non-private
training's. Each example's contribution has norm at most C only if its
clipped sum is formed from exactly what its norm was computed from. So
"ghost" and "mixed" take from the second backward pass only the layers where
that pass computes the same thing (float32 ghost-norm conv/dense/embedding
layers); the others (mixed precision, layers whose per-example gradients are
recomputed, e.g. with in-layer dropout) are summed from their rule's factors
as in "bk" (`tapped_clipping`). Models that per-layer
clipping cannot bound are refused (`model_probe`): a layer reading another
layer's variable (tied weights) makes "auto" use "vectorized"; a layer that
mixes examples is refused by every method.

Every method turns norms into factors with `clip_rule.clip_coefficients`
and differentiates the losses of `example_losses`; this module chooses the
method (`resolve_method`) and runs "naive" and "vectorized" itself.

A sixth, "jacobian" (`TAPE_METHODS`), clips a loss vector with the tape that
recorded it, where there is no model to tap (TF-Privacy's custom loop):
`jacobian_clipping.jacobian_clipped_sum`. `clipped_grad_sum` refuses it.
"""

import logging
import re

import tensorflow as tf

from tfdp import validation
from tfdp.dp import example_losses
from tfdp.dp import layer_grads
from tfdp.dp import layer_taps
from tfdp.dp import model_probe
from tfdp.dp import rules
from tfdp.dp import tapped_clipping
from tfdp.dp.clip_rule import ClipRule
from tfdp.dp.clip_rule import clip_coefficients  # noqa: F401  (public here too)
from tfdp.dp.rules.registry import TAPPED_METHODS
from tfdp.dp.rules.registry import weighted_sum
from tfdp.dp.tapped_clipping import uncovered_variables

METHODS = ("naive", "vectorized", "ghost", "mixed", "bk", "auto")
# Methods of a loss vector and its tape, not of a model: never chosen by
# "auto", and refused by `resolve_method` with the function to call instead.
TAPE_METHODS = ("jacobian",)


def default_weight_decay_variables(model):
    """Conv, dense and einsum kernels: the variables the paper decays.

    Each layer's rule answers for its variables (`rules.Rule.decays`).
    """
    return rules.weight_decay_variables(model)


def resolve_method(model, method, x=None):
    """Validates `method` for `model` and maps "auto" to the fastest that bounds it.

    Probes the model (`model_probe.probe`, cached) when an input signature is
    known: from `x`, else from the model's declared input.

    Args:
        model: keras.Model. The model to train.
        method: str. One of `METHODS`.
        x: optional tensor. A batch of inputs (may be symbolic).

    Returns:
        The method: "auto" resolved.

    Raises:
        ValueError: for an unknown method or a tape method (`TAPE_METHODS`,
            `jacobian_clipping.jacobian_clipped_sum`); for a model with a layer that mixes
            examples or writes non-trainable state from the batch (any
            method); for a tapped method and a model whose
            variables are not all read only by their owning layers.
    """
    if method in TAPE_METHODS:
        raise ValueError(
            f"method={method!r} clips a loss vector with the tape that recorded it, "
            "not a model: call tfdp.dp.jacobian_clipped_sum(tape, losses, variables, "
            f"l2_norm_clip). A model takes one of {METHODS}. Received: method={method!r}"
        )
    if method not in METHODS:
        raise ValueError(
            f"Unknown clipping method. Expected one of {METHODS}. "
            f"Received: method={method!r}"
        )
    layer_taps.tapped_layers(model)  # Raises where a rule refuses a layer.
    report = model_probe.probe(model, x)
    if report is not None:
        report.refuse_mixing()
        report.refuse_state_writes()
    if method == "auto":
        if uncovered_variables(model) or (report is not None and report.foreign_reads):
            logging.warning(
                "tfdp: some trainable variables are not owned by a leaf layer or are "
                "read outside their owner's call; using method='vectorized' instead "
                "of book-keeping."
            )
            return "vectorized"
        return "bk"
    if method in TAPPED_METHODS and report is not None:
        report.refuse_foreign_reads(method)
    return method


def clipped_grad_sum(
    model,
    per_example_loss_fn,
    x,
    y,
    *,
    l2_norm_clip,
    method="auto",
    sample_weight=None,
    weight_decay=0.0,
    weight_decay_variables=None,
    training=True,
    augmentation_multiplicity=1,
    clipping="standard",
    clipping_gamma=validation.DEFAULT_CLIPPING_GAMMA,
):
    """Sum over the batch of per-example gradients clipped to `l2_norm_clip`.

    Example i's loss is `sample_weight[i] * per_example_loss_fn(y, model(x))[i]`
    plus, for non-padding examples, `0.5 * weight_decay * Σ‖w‖²` over
    `weight_decay_variables` (so weight decay is clipped with the gradient, as
    in Kurakin et al. 2022). An example with weight 0 is padding: it
    contributes nothing and its norm is reported as 0. An example whose
    gradient is NaN/Inf is dropped (its contribution is zero; its norm is
    reported as non-finite so callers can count it).

    With `augmentation_multiplicity=K`, rows `i·K … i·K+K-1` of `x` are K
    augmentations of example i (De et al. 2022): its gradient is the mean of
    theirs, clipped once, and `norms` has one entry per example.

    Args:
        model: keras.Model. Its `trainable_variables` are differentiated.
        per_example_loss_fn: callable. `(y_true, y_pred) -> [B]` losses.
        x: tensor. Inputs, batch first.
        y: tensor. Targets, batch first.
        l2_norm_clip: float. The clipping bound C > 0.
        method: str. One of "naive", "vectorized", "ghost", "mixed", "bk",
            "auto". Defaults to "auto" (book-keeping where it applies).
        sample_weight: optional tensor [B]. Scales each example's loss before
            clipping. Defaults to ones.
        weight_decay: float. Coefficient of the in-loss L2 term. Defaults to 0.
        weight_decay_variables: optional list of variables to decay.
            Defaults to the conv and dense kernels.
        training: bool. Passed to the model call. Defaults to True.
        augmentation_multiplicity: int. Rows per example. Defaults to 1.
        clipping: str. "standard" (min(1, C/‖g‖)) or "automatic"
            (C/(‖g‖ + γ)); see `clip_coefficients`. Defaults to "standard".
        clipping_gamma: float. γ of "automatic". Defaults to 0.01.

    Returns:
        (grads, norms): `grads` aligned with `model.trainable_variables`;
        `norms` the per-example unclipped gradient norms, shape [B].
    """
    rule = ClipRule(l2_norm_clip, clipping, clipping_gamma)
    k = int(augmentation_multiplicity)
    if k < 1:
        raise ValueError(
            "augmentation_multiplicity must be >= 1. "
            f"Received: augmentation_multiplicity={augmentation_multiplicity}"
        )
    x = tf.convert_to_tensor(x)
    method = resolve_method(model, method, x)
    rows = tf.shape(x)[0]
    if sample_weight is None:
        sample_weight = tf.ones([rows], tf.float32)
    sample_weight = tf.cast(tf.reshape(sample_weight, [-1]), tf.float32)
    if weight_decay and weight_decay_variables is None:
        weight_decay_variables = default_weight_decay_variables(model)
    decay = example_losses.WeightDecay(weight_decay, weight_decay_variables or [])
    batch = example_losses.ExampleBatch(sample_weight, k)
    args = (model, per_example_loss_fn, x, y, batch, rule, decay, training)
    if method == "naive":
        return _naive(*args)
    if method == "vectorized":
        return _vectorized(*args)
    return tapped_clipping.tapped_clipped_sum(*args, method=method)



def _naive(model, loss_fn, x, y, batch, clip, decay, training):
    variables = model.trainable_variables
    sums = [tf.zeros_like(v) for v in variables]
    norms = []
    mask, k = batch.mask, batch.k
    for i in range(int(x.shape[0]) // k):
        rows = slice(i * k, (i + 1) * k)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(example_losses.per_example_losses(
                model, loss_fn, x[rows], y[rows], batch.row_weights[rows], training
            ))
            loss = loss + mask[i] * decay.penalty()
        grads = tape.gradient(
            loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        # Densify: the norm of IndexedSlices values miscounts repeated ids.
        grads = [tf.convert_to_tensor(g) for g in grads]
        norm = tf.linalg.global_norm(grads)
        coeff = clip.coefficients(norm[None], mask[i : i + 1])[0]
        sums = [s + tf.math.multiply_no_nan(g, coeff) for s, g in zip(sums, grads)]
        norms.append(norm)
    return sums, tf.stack(norms)


def _vectorized(model, loss_fn, x, y, batch, clip, decay, training):
    rules.install_taps(model)
    variables = model.trainable_variables
    mask, k = batch.mask, batch.k

    def grouped(t):
        t = tf.convert_to_tensor(t)
        return tf.reshape(t, tf.concat([[-1, k], tf.shape(t)[1:]], 0))

    def one_example(args):
        x_i, y_i, w_i, m_i = args  # k rows each.
        with layer_taps.recording("vectorized"), tf.GradientTape() as tape:
            loss = tf.reduce_sum(example_losses.per_example_losses(model, loss_fn, x_i, y_i, w_i, training))
            loss = loss + m_i * decay.penalty()
        return tape.gradient(
            loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )

    per_example, found = layer_grads.checked_vectorized_map(
        one_example, (grouped(x), grouped(y), grouped(batch.row_weights), mask)
    )
    if found:
        _refuse_miscomputed_vectorization(model, found)
    sq = tf.add_n(
        [tf.reduce_sum(tf.reshape(tf.square(g), [tf.shape(g)[0], -1]), 1) for g in per_example]
    )
    norms = tf.sqrt(sq)
    coeffs = clip.coefficients(norms, mask)
    grads = [weighted_sum(coeffs, g) for g in per_example]
    return grads, norms


def _refuse_miscomputed_vectorization(model, found):
    """Raises, naming the layer, where `tf.vectorized_map` would compute wrongly."""
    names = {layer.name for layer in model._flatten_layers(include_self=False, recursive=True)}
    op, a, b = found[0]
    # Tracing scopes are the layers' names, uniquified with a "_<n>" suffix.
    scopes = [
        part if part in names else re.sub(r"_\d+$", "", part)
        for part in op.name.split("/")
    ]
    scopes = [part for part in scopes if part in names]
    layer = scopes[-1] if scopes else op.name
    raise ValueError(
        f"method='vectorized' cannot clip layer '{layer}': tf.vectorized_map turns its "
        f"matmul into a BatchMatMul of shapes {a} x {b}, which TensorFlow's oneDNN CPU "
        "kernel computes wrongly and which can crash the process "
        "(`layer_grads.miscomputed_batch_matmuls`). Use method='bk', 'mixed', 'ghost' "
        "or 'naive', or set TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow is imported. "
        f"Received: method='vectorized', layer={layer!r}"
    )

