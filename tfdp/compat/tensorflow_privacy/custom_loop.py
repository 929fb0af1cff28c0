"""TF-Privacy's custom-training-loop API on a compat optimizer: a loss vector and a tape.

TF-Privacy's optimizers also trained outside `fit`:

```python
with tf.GradientTape() as tape:
    loss = per_example_loss(y, model(x))          # a vector, one loss per example
optimizer.minimize(loss, model.trainable_variables, tape=tape)
```

Each of the `num_microbatches` consecutive groups of the loss vector (one
per row when `None`) has its mean loss differentiated, by a Jacobian of the
microbatch losses (no model to tap here, unlike `fit`'s engine); each
microbatch gradient is clipped to C, the clipped gradients are summed,
noised once with std σ·C and divided by the number of microbatches.

Privacy: the noise is the optimizer's (its secret key, one seed per noised
release, never reused), and every release is counted in `iterations`, so
`optimizer.ledger(dataset_size=N)` accounts it. `apply_gradients` applies
only the very gradients `_compute_gradients` last returned, once. The batches of a custom loop
are the user's, so they are accounted as fit's stream batches
(`sampler="shuffle"`, one Gaussian mechanism per pass of N // B steps,
without amplification): that holds when each example sits at most once in
each run of N // B consecutive steps, e.g. epochs over a shuffled dataset of
N examples batched with `drop_remainder=True`. B is fixed by the first call
(its loss rows), and every later call must have as many: a pass of other
sizes would not hold N // B steps. N is not known to the optimizer, so the
ledger asks for it (`ledger(dataset_size=N)`).
"""

import tensorflow as tf


def microbatch_losses(loss, num_microbatches):
    """`[M]` mean losses of TF-Privacy's consecutive microbatches, and the rows of `loss`."""
    rows = loss.shape[0] if loss.shape.rank else None
    if rows is None:
        raise ValueError(
            "The loss of a custom training loop must be a vector of per-example "
            "losses with a static length (the batch size), as TF-Privacy's. "
            f"Received: loss of shape {loss.shape}"
        )
    groups = rows if num_microbatches is None else int(num_microbatches)
    if rows % groups:
        raise ValueError(
            "The batch size must be a multiple of num_microbatches. "
            f"Received: batch_size={rows}, num_microbatches={groups}"
        )
    return tf.reduce_mean(tf.reshape(loss, [groups, -1]), axis=1), rows


def clipped_sum(tape, losses, var_list, l2_norm_clip, unconnected_gradients_to_zero):
    """Σ_j clip(∇ losses[j], C) over the microbatches, one tensor per variable.

    Args:
        tape: `tf.GradientTape` that recorded `losses`.
        losses: `[M]` tensor. Microbatch mean losses.
        var_list: list of variables.
        l2_norm_clip: float. C.
        unconnected_gradients_to_zero: bool. A variable the loss does not
            reach gets zero gradients instead of an error.

    Returns:
        A list of tensors shaped like `var_list`.
    """
    unconnected = (tf.UnconnectedGradients.ZERO if unconnected_gradients_to_zero
                   else tf.UnconnectedGradients.NONE)
    jacobians = tape.jacobian(losses, var_list, unconnected_gradients=unconnected)
    missing = [v.name for v, j in zip(var_list, jacobians) if j is None]
    if missing:
        raise ValueError(
            "The loss does not depend on some variables of var_list, whose gradients "
            "are None: pass `unconnected_gradients_to_zero=True` to the optimizer (as "
            f"in TF-Privacy) or leave them out of var_list. Received: {missing}"
        )
    groups = tf.shape(losses)[0]
    squares = [tf.reduce_sum(tf.reshape(tf.square(j), [groups, -1]), axis=1) for j in jacobians]
    norms = tf.sqrt(tf.add_n(squares))
    # min(1, C / ||g_j||): a microbatch's gradient is clipped to norm C.
    factors = tf.minimum(1.0, l2_norm_clip / tf.maximum(norms, 1e-30))
    return [tf.tensordot(tf.cast(factors, j.dtype), j, axes=1) for j in jacobians]


def loss_and_tape(loss, var_list, tape):
    """TF-Privacy's `(loss, var_list, tape)` resolved: a callable loss runs under a tape."""
    if not callable(loss) and tape is None:
        raise ValueError(
            "`tape` is required when a `Tensor` loss is passed (as in TF-Privacy). "
            "Received: tape=None"
        )
    tape = tape if tape is not None else tf.GradientTape()
    with tape:
        if callable(loss):
            if not callable(var_list):
                tape.watch(tf.nest.flatten(var_list))
            loss = loss()
        loss = tf.convert_to_tensor(loss)
    if callable(var_list):
        var_list = var_list()
    return loss, tf.nest.flatten(var_list), tape


def prepare(optimizer, rows, var_list):
    """Binds the optimizer to a custom loop of `rows` examples per call (eager or traced).

    The first call plans the stream route at B = rows × k (the logical batch
    the ledger accounts, and, without microbatches, the divisor) and builds
    the optimizer; a later call of another size is refused.
    """
    fixed = getattr(optimizer, "custom_loop_rows", None)
    if fixed is None:
        plan = optimizer.fit_plan
        if plan is not None and plan.physical_batch_size not in (None, rows):
            raise ValueError(
                "This optimizer was planned for batches of another size: a custom loop "
                "takes the batch size of its first call, and every call must have "
                f"as many rows. Received: {rows} rows, planned "
                f"{plan.physical_batch_size}"
            )
        optimizer.mechanism_builder.plan(arrays=False, physical_batch_size=rows)
        optimizer.custom_loop_rows = rows
    elif rows != fixed:
        raise ValueError(
            "Every call of a custom training loop must have the batch size of the "
            "first (the ledger accounts passes of N // B steps of B examples, and "
            "without microbatches B divides the noisy sum): drop the remainder "
            f"batch (`drop_remainder=True`). Received: {rows} rows, first call {fixed}"
        )
    if not optimizer.built:
        with tf.init_scope():
            optimizer.build(var_list)


def clipped_batch(optimizer, loss, var_list, tape):
    """`(Σ clip(g_j), var_list)` of one batch's microbatches, the optimizer prepared for it."""
    loss, var_list, tape = loss_and_tape(loss, var_list, tape)
    with tape:
        losses, rows = microbatch_losses(loss, optimizer.num_microbatches)
    summed = clipped_sum(tape, losses, var_list, optimizer.l2_norm_clip,
                         optimizer.unconnected_gradients_to_zero)
    prepare(optimizer, rows, var_list)
    return summed, var_list


def noisy_gradients(optimizer, loss, var_list, tape):
    """The clipped, noised mean of one batch, released now and counted in `iterations`."""
    summed, var_list = clipped_batch(optimizer, loss, var_list, tape)
    step = tf.cast(optimizer.iterations, tf.int64)
    allowed = optimizer.account.release_allowed(step)
    with tf.control_dependencies([tf.debugging.assert_equal(
            allowed, True, message="The privacy budget is spent: no more steps may be released.")]):
        # The noise seed is the step: counting the release moves it on, so
        # no two releases share noise.
        noisy = optimizer.mechanism_builder.aggregator.noisy_mean(summed, step)
    with tf.control_dependencies(noisy):
        optimizer.iterations.assign_add(1)
        optimizer.account.record_release()
    # A tuple, not a list: Keras would track a list attribute.
    optimizer.released_gradients = tuple(noisy)
    return list(zip(noisy, var_list))


def take_released(optimizer, grads_and_vars):
    """`(grads, variables)` when `grads_and_vars` holds the last released gradients, else None.

    The very tensors `noisy_gradients` returned, in order, and not applied
    yet: anything else (Keras' plain gradients, or gradients computed from
    the released ones) is not theirs to apply. Either way they are
    forgotten, so they are applied at most once.
    """
    released = optimizer.released_gradients
    optimizer.released_gradients = None
    if released is None:
        return None
    try:
        pairs = [tuple(pair) for pair in grads_and_vars]
    except TypeError:
        return None
    if (len(pairs) != len(released) or any(len(pair) != 2 for pair in pairs)
            or any(grad is not mine for (grad, _), mine in zip(pairs, released))):
        return None
    return [grad for grad, _ in pairs], [var for _, var in pairs]


def apply_released(optimizer, grads, variables):
    """Applies released gradients through the wrapped optimizer, counted once.

    `iterations` counted the release when it was returned (it also seeds the
    next noise); the wrapped optimizer's `apply` counts it again, so the
    count is taken back first, and restored if the update fails before it
    counts, so that no seed is ever used twice.
    """
    for grad, var in zip(grads, variables):
        if not grad.shape.is_compatible_with(var.shape):
            raise ValueError(
                "A released gradient must be applied to its variable. Received: a "
                f"gradient of shape {grad.shape} for variable {var.name} of shape {var.shape}")
    released = tf.identity(tf.convert_to_tensor(optimizer.iterations))
    optimizer.iterations.assign_sub(1)
    try:
        optimizer.apply_noisy(grads, variables)
    except Exception:
        optimizer.iterations.assign(tf.maximum(optimizer.iterations, released))
        raise


def minimize(optimizer, loss, var_list, tape):
    """Clips, accumulates k batches, noises once and applies through the wrapped optimizer."""
    summed, var_list = clipped_batch(optimizer, loss, var_list, tape)
    # The logical step of `fit`: accumulate; after k batches noise once and
    # apply with the wrapped optimizer (which counts the step), within budget.
    optimizer.logical_step.add_batch(summed, var_list)
