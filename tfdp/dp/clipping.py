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
as in "bk". Models that per-layer
clipping cannot bound are refused (`model_probe`): a layer reading another
layer's variable (tied weights) makes "auto" use "vectorized"; a layer that
mixes examples is refused by every method.

A sixth, "jacobian" (`TAPE_METHODS`), clips a loss vector with the tape that
recorded it, where there is no model to tap (TF-Privacy's custom loop):
`jacobian_clipping.jacobian_clipped_sum`. `clipped_grad_sum` refuses it.
"""

import logging
import re

import tensorflow as tf

from tfdp import validation
from tfdp.dp import layer_grads
from tfdp.dp import layer_taps
from tfdp.dp import model_probe
from tfdp.dp import norm_stream
from tfdp.dp import rules
from tfdp.dp.rules.registry import TAPPED_METHODS
from tfdp.dp.rules.registry import weighted_sum

METHODS = ("naive", "vectorized", "ghost", "mixed", "bk", "auto")
# Methods of a loss vector and its tape, not of a model: never chosen by
# "auto", and refused by `resolve_method` with the function to call instead.
TAPE_METHODS = ("jacobian",)


def default_weight_decay_variables(model):
    """Conv, dense and einsum kernels: the variables the paper decays.

    Each layer's rule answers for its variables (`rules.Rule.decays`).
    """
    return rules.weight_decay_variables(model)


def clip_coefficients(norms, l2_norm_clip, mask, clipping="standard",
                      clipping_gamma=validation.DEFAULT_CLIPPING_GAMMA):
    """Each unit's factor c_i, zero for padding and for non-finite gradients.

    - "standard": c_i = min(1, C/‖g_i‖), clipping (Abadi et al. 2016).
    - "automatic": c_i = C/(‖g_i‖ + γ), normalising (Bu et al. 2023, AUTO-S):
      every unit contributes C·g_i/(‖g_i‖ + γ), of norm below C, so the
      sensitivity (and ε) is that of clipping to C, and no C needs tuning
      (it only scales the update, as the learning rate does).

    An example whose gradient is NaN/Inf contributes nothing: dropping one
    example's contribution keeps the sensitivity bound. This is the one place
    where a unit's factor is computed, for every clipping method.

    Args:
        norms: float tensor `[B]`. The units' gradient norms.
        l2_norm_clip: float. C.
        mask: float tensor `[B]`. 1 for real units, 0 for padding.
        clipping: str. "standard" or "automatic". Defaults to "standard".
        clipping_gamma: float. γ of "automatic". Defaults to 0.01.
    """
    norms = tf.convert_to_tensor(norms)
    clip = tf.cast(l2_norm_clip, norms.dtype)
    if clipping == "automatic":
        coeffs = clip / (norms + tf.cast(clipping_gamma, norms.dtype))
    else:
        coeffs = clip / tf.maximum(norms, clip)
    coeffs = tf.where(tf.math.is_finite(norms), coeffs, tf.zeros_like(coeffs))
    return coeffs * mask


class ClipRule:
    """C and the rule that turns a unit's norm into its factor (`clip_coefficients`).

    Args:
        l2_norm_clip: float. C > 0.
        clipping: str. "standard" or "automatic". Defaults to "standard".
        clipping_gamma: float. γ > 0 of "automatic". Defaults to 0.01.
    """

    def __init__(self, l2_norm_clip, clipping="standard",
                 clipping_gamma=validation.DEFAULT_CLIPPING_GAMMA):
        self.l2_norm_clip = validation.validate_l2_norm_clip(l2_norm_clip)
        self.clipping = validation.validate_clipping(clipping)
        self.clipping_gamma = validation.validate_clipping_gamma(clipping_gamma)

    def coefficients(self, norms, mask):
        """The units' factors (`clip_coefficients`)."""
        return clip_coefficients(norms, self.l2_norm_clip, mask, self.clipping,
                                 self.clipping_gamma)


def uncovered_variables(model):
    """Trainable variables that no tapped layer owns (e.g. a composite layer's)."""
    covered = set()
    for layer in layer_taps.tapped_layers(model):
        covered.update(id(v) for v in layer_taps.own_trainable_variables(layer))
    return [v for v in model.trainable_variables if id(v) not in covered]


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
    decay = _WeightDecay(weight_decay, weight_decay_variables or [])
    batch = _Batch(sample_weight, k)
    args = (model, per_example_loss_fn, x, y, batch, rule, decay, training)
    if method == "naive":
        return _naive(*args)
    if method == "vectorized":
        return _vectorized(*args)
    return _tapped(*args, method=method)


class _WeightDecay:
    def __init__(self, coefficient, variables):
        self.coefficient = float(coefficient)
        self.ids = {id(v) for v in variables} if self.coefficient else set()
        self.variables = list(variables) if self.coefficient else []

    def applies(self, variable):
        return id(variable) in self.ids

    def penalty(self):
        if not self.variables:
            return 0.0
        return 0.5 * self.coefficient * tf.add_n(
            [tf.reduce_sum(tf.square(v)) for v in self.variables]
        )


class _Batch:
    """Row weights (loss scale, 1/K folded in) and per-example masks."""

    def __init__(self, sample_weight, k):
        self.k = k
        self.row_weights = sample_weight / float(k)
        real_rows = tf.cast(sample_weight > 0, tf.float32)
        self.mask = tf.reduce_max(tf.reshape(real_rows, [-1, k]), 1) if k > 1 else real_rows


def _per_example_losses(model, loss_fn, x, y, weights, training):
    predictions = model(x, training=training)
    losses = tf.reshape(loss_fn(y, predictions), [-1])
    return tf.cast(losses, tf.float32) * weights


def _naive(model, loss_fn, x, y, batch, clip, decay, training):
    variables = model.trainable_variables
    sums = [tf.zeros_like(v) for v in variables]
    norms = []
    mask, k = batch.mask, batch.k
    for i in range(int(x.shape[0]) // k):
        rows = slice(i * k, (i + 1) * k)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(_per_example_losses(
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
            loss = tf.reduce_sum(_per_example_losses(model, loss_fn, x_i, y_i, w_i, training))
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


def _group_records(records):
    groups = {}
    order = []
    for record in records:
        key = id(record.layer)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(record)
    return [groups[k] for k in order]


def _check_covered(model, method):
    uncovered = uncovered_variables(model)
    if uncovered:
        raise ValueError(
            f"method={method!r} needs every trainable variable to be owned by "
            "a leaf layer that uses it in its own call. Not covered: "
            f"{[v.path for v in uncovered]}. Use method='vectorized'. "
            f"Received: method={method!r}"
        )


def _layer_sq_norms(layer_clip, decay, mask):
    """[B] squared norms of a layer's per-example gradients, weight decay included."""
    wd_per_example = decay.coefficient * mask
    total = tf.zeros_like(mask)
    for v in layer_clip.variables:
        sq = layer_clip.sq_norm(v)
        if decay.applies(v):
            # ‖g_i + wd·v‖² = ‖g_i‖² + 2·wd·⟨g_i, v⟩ + wd²‖v‖².
            sq += 2.0 * wd_per_example * layer_clip.dot(v)
            sq += tf.square(wd_per_example) * tf.reduce_sum(tf.square(v))
        total += sq
    return total


def _clip_after_output_grads(records, output_grads, context):
    """The layer's `LayerClip`, its work started only once its output gradients exist.

    The executor runs an op as soon as its inputs exist, so work that reads
    only the layer's input (GroupNorm's x̂, a conv's pixel Gram) would
    otherwise run right after the forward pass and be held for every layer
    at once.
    """
    layer = records[0].layer
    with tf.control_dependencies(output_grads):
        return layer._tfdp_rule.clip(layer, records, output_grads, context)


def _with_decay(sums, variables, decay, coeffs):
    total_coeff = tf.reduce_sum(coeffs)
    return [
        g + decay.coefficient * total_coeff * v if decay.applies(v) else g
        for g, v in zip(sums, variables)
    ]


def _second_backward(tape, losses, variables, coeffs, k):
    """Σ_i c_i·∂L_i/∂v for `variables` by a backward pass on the weighted losses."""
    if not variables:
        return {}
    row_coeffs = tf.repeat(coeffs, k) if k > 1 else coeffs
    result = tape.gradient(
        losses, variables, output_gradients=row_coeffs,
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )
    # Embedding gradients come back as IndexedSlices: return dense sums.
    return {id(v): tf.convert_to_tensor(g) for v, g in zip(variables, result)}


def _tapped(model, loss_fn, x, y, batch, clip, decay, training, *, method):
    _check_covered(model, method)
    rules.install_taps(model)
    return _streamed(model, loss_fn, x, y, batch, clip, decay, training, method=method)


def _recorded(model, loss_fn, x, y, batch, clip, decay, training, *, method):
    """The fallback of "ghost" and "mixed" for a batch with a non-finite example.

    Every layer's output gradient is asked of the tape at once and kept, so
    that the sums can be formed from factors with the example's rows zeroed.
    All are alive together: memory is about that of the first pass plus
    every output gradient, which is why this is only the rare fallback of
    `_streamed`.
    """
    variables = model.trainable_variables
    mask, k = batch.mask, batch.k
    with tf.GradientTape(persistent=True) as tape:
        with layer_taps.recording() as recorder:
            losses = _per_example_losses(model, loss_fn, x, y, batch.row_weights, training)
        total = tf.reduce_sum(losses)
    records = recorder.records
    output_grads = tape.gradient(
        total,
        [r.outputs for r in records],
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )
    grad_of = {id(r): g for r, g in zip(records, output_grads)}

    context = rules.ClipContext(method, k)
    sq_norms = tf.zeros_like(mask)
    clips = []  # Sums deferred: the coefficients are known only after all norms.
    for group in _group_records(records):
        clips.append(_clip_after_output_grads(group, [grad_of[id(r)] for r in group], context))
        sq_norms += _layer_sq_norms(clips[-1], decay, mask)

    norms = tf.sqrt(sq_norms)
    coeffs = clip.coefficients(norms, mask)

    def book_keeping(keep=None, skip=()):
        by_variable = {}
        for layer_clip in clips:
            for v in layer_clip.variables:
                if id(v) not in skip:
                    by_variable[id(v)] = layer_clip.clipped_sum(v, coeffs, keep)
        return by_variable

    def second_backward():
        # Only the layers whose backward pass computes what their norm was
        # computed from; the others are summed from their factors.
        backward = [v for c in clips if c.from_backward for v in c.variables]
        by_variable = book_keeping(skip={id(v) for v in backward})
        by_variable.update(_second_backward(tape, losses, backward, coeffs, k))
        return by_variable

    def in_order(by_variable):
        sums = [by_variable.get(id(v), tf.zeros_like(v)) for v in variables]
        return _with_decay(sums, variables, decay, coeffs)

    # A NaN/Inf example (zero coefficient) would still poison a sum through
    # NaN·0, so when there is one the sums are formed by book-keeping from
    # inputs and output gradients with that example's rows zeroed.
    finite = tf.math.is_finite(norms)
    result = tf.cond(
        tf.reduce_all(finite),
        lambda: in_order(second_backward()),
        lambda: in_order(book_keeping(keep=finite)),
    )
    return result, norms


def _streamed(model, loss_fn, x, y, batch, clip, decay, training, *, method):
    """Norms streamed through the backward pass, layer by layer (`norm_stream`).

    What each layer needs for its clipped sum is kept as its output gradient
    appears, and the rest freed, so peak memory stays near non-private
    training's: instantiated per-example gradients (layers with large T,
    where they are small), or the input and output gradient (ghost norms,
    small T). "bk" forms every sum from these. "ghost" and "mixed" keep only
    the former and take the ghost layers' sums from a second backward pass
    on Σ_i c_i·L_i, which stops at the lowest ghost layer: less memory where
    the ghost layers' output gradients are large, more time. Layers called
    several times, or whose output cannot be wrapped, have their output
    gradients asked of the tape as in `_recorded`.
    """
    variables = model.trainable_variables
    mask, k = batch.mask, batch.k
    context = rules.ClipContext(method, k)
    book_keeping = method == "bk"
    stream = norm_stream.NormStream(
        tf.shape(mask)[0], context, lambda c: _layer_sq_norms(c, decay, mask),
        keep_all=book_keeping,
    )
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(stream.norm_input)
        with layer_taps.recording(on_record=stream.tap) as recorder:
            losses = _per_example_losses(model, loss_fn, x, y, batch.row_weights, training)
        total = tf.reduce_sum(losses)
    groups = _group_records(recorder.records)
    streaming = [g for g in groups if stream.can_stream(g)]
    recorded = [g for g in groups if not stream.can_stream(g)]
    recorded_calls = [r for g in recorded for r in g]

    stream.start([g[0].layer for g in streaming])
    first = tape.gradient(
        total,
        [stream.norm_input] + [r.outputs for r in recorded_calls],
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )
    stream.stop()
    sq_norms = first[0]
    grad_of = {id(r): g for r, g in zip(recorded_calls, first[1:])}
    clips = list(stream.kept_clips)
    for group in recorded:
        clips.append(_clip_after_output_grads(group, [grad_of[id(r)] for r in group], context))
        sq_norms += _layer_sq_norms(clips[-1], decay, mask)

    norms = tf.sqrt(sq_norms)
    coeffs = clip.coefficients(norms, mask)

    from_factors = [c for c in clips if book_keeping or not c.from_backward]

    def summed(keep=None):
        skip = {id(v) for c in from_factors for v in c.variables}
        by_variable = _second_backward(
            tape, losses, [v for v in variables if id(v) not in skip], coeffs, k
        )
        for layer_clip in from_factors:
            for v in layer_clip.variables:
                by_variable[id(v)] = layer_clip.clipped_sum(v, coeffs, keep)
        sums = [by_variable[id(v)] for v in variables]
        return _with_decay(sums, variables, decay, coeffs)

    finite = tf.math.is_finite(norms)
    if book_keeping:
        # Every sum is formed from kept factors, which can drop a non-finite
        # example's rows (NaN·0 is NaN: a zero coefficient alone cannot).
        return tf.cond(tf.reduce_all(finite), summed, lambda: summed(keep=finite)), norms

    def recompute():
        # A backward pass cannot drop a non-finite example's rows. Rare, so
        # this path recomputes with every output gradient kept.
        return _recorded(
            model, loss_fn, x, y, batch, clip, decay, training, method=method
        )[0]

    return tf.cond(tf.reduce_all(finite), summed, recompute), norms
