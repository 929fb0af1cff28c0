"""The tapped clipping methods: "ghost", "mixed" and "bk", layer by layer.

Each layer's per-example norm comes from its rule (`tfdp.dp.rules`),
computed inside the backward pass as soon as the layer's output gradient
exists (`norm_stream`), so that peak memory stays near non-private
training's. "bk" forms every clipped sum from what the norm kept; "ghost"
and "mixed" take the sums of the layers whose backward pass computes what
their norm was computed from (float32 ghost-norm layers) from a second
backward pass on Σ_i c_i·L_i, and the others from their factors. A batch
with a non-finite example falls back to a pass that keeps every output
gradient (`_recorded`), so that its rows can be dropped.

`clipping.clipped_grad_sum` calls `tapped_clipped_sum`; `uncovered_variables`
are the trainable variables these methods cannot see.
"""

import tensorflow as tf

from tfdp.dp import layer_taps
from tfdp.dp import norm_stream
from tfdp.dp import rules
from tfdp.dp.example_losses import per_example_losses


def uncovered_variables(model):
    """Trainable variables that no tapped layer owns (e.g. a composite layer's)."""
    covered = set()
    for layer in layer_taps.tapped_layers(model):
        covered.update(id(v) for v in layer_taps.own_trainable_variables(layer))
    return [v for v in model.trainable_variables if id(v) not in covered]


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


def tapped_clipped_sum(model, loss_fn, x, y, batch, clip, decay, training, *, method):
    """Σ_i c_i·g_i and the per-example norms by a tapped method.

    Args:
        model: keras.Model. Its `trainable_variables` are differentiated.
        loss_fn: callable. `(y_true, y_pred) -> [B]` losses.
        x: tensor. Inputs, batch first.
        y: tensor. Targets, batch first.
        batch: `example_losses.ExampleBatch`. Row weights and masks.
        clip: `clip_rule.ClipRule`. C and the rule for the factors.
        decay: `example_losses.WeightDecay`. The in-loss weight decay.
        training: bool. Passed to the model call.
        method: str. "ghost", "mixed" or "bk".

    Returns:
        (grads, norms), as `clipping.clipped_grad_sum` returns them.

    Raises:
        ValueError: when a trainable variable is not owned by a tapped layer
            (`uncovered_variables`).
    """
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
            losses = per_example_losses(model, loss_fn, x, y, batch.row_weights, training)
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
            losses = per_example_losses(model, loss_fn, x, y, batch.row_weights, training)
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
