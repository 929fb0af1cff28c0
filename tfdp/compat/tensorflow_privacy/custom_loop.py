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

The training probe: every other route runs `tfdp.dp.sensitivity.probe_training`
before its first release, which refuses a layer or a loss through which one
example's gradient depends on another example (MixUp, batch centering, a
softmax over the batch, a batch mean in the loss) or a layer that writes
state from the batch. A custom loop hands over a loss *vector*, already
computed: no function of the data to probe, and the tape cannot tell either
(it records the variables' part of the computation, not the data's: a
loss whose rows mix other rows' predictions, labels or inputs gives per-row
gradients like any other, and an eager tape cannot be replayed on other
rows). So the rule is declaration: before its first release the optimizer
must know the Keras model that owns `var_list` and its per-example loss,
`optimizer.declare_model(model, loss)` (the loss defaults to the model's
compiled loss), and the probe (`tfdp.keras.training_probe.probe_shapes`, the
Keras route's) runs on that model and loss, with random inputs of the
model's input shape (never the training data), at the batch size of the
loss vector, before anything is released. An undeclared loop, or a
`var_list` with a variable the declared model does not train, is refused
before any update. The vector handed to `minimize` must then be the declared
loss of the declared model's outputs, row by row: that is the contract the
probe checks, and the one assumption it cannot (see docs/MIGRATING.md).
"""

import dataclasses

import keras
import tensorflow as tf

from tfdp.dp import clipping
from tfdp.dp import jacobian_clipping
from tfdp.keras import training_probe
from tfdp.keras.per_example_loss import per_example_loss_fn

_UNDECLARED = (
    "A custom training loop must declare the Keras model it trains and its "
    "per-example loss before its first step, so that the training probe can "
    "refuse a layer or a loss that mixes examples (as every other route does): "
    "call `optimizer.declare_model(model, loss=per_example_loss)` once, with "
    "the model whose variables are in var_list and the loss that computes the "
    "vector handed to minimize (e.g. keras.losses.SparseCategoricalCrossentropy("
    "from_logits=True, reduction=None)); `loss` defaults to the model's "
    "compiled loss. Variables outside a Keras model cannot be probed: put them "
    "in a layer of one."
)


@dataclasses.dataclass(frozen=True)
class DeclaredModel:
    """The model and per-example loss a custom loop trains, for the training probe.

    Attributes:
        model: keras.Model. Owns the variables of `var_list`.
        loss: callable. `(y_true, y_pred) -> [B]`, the per-example loss.
        example_spec: `tf.TensorSpec`. One example's input.
        target_spec: `tf.TensorSpec`. One example's target.
    """

    model: keras.Model
    loss: object
    example_spec: tf.TensorSpec
    target_spec: tf.TensorSpec


def declare_model(model, loss=None, input_spec=None, target_spec=None):
    """The `DeclaredModel` of `optimizer.declare_model` (see the module docstring).

    Args:
        model: keras.Model. The model whose trainable variables the loop
            updates (all of them or some).
        loss: a Keras loss, its name, or a function `(y_true, y_pred) -> [B]`;
            any reduction (each example's value is used). Defaults to None:
            the model's compiled loss.
        input_spec: `tf.TensorSpec` or None. The batch of inputs, e.g.
            `tf.TensorSpec([None, 28, 28, 1], tf.float32)`. Defaults to
            None: the model's single declared input (`model.inputs`).
        target_spec: `tf.TensorSpec` or None. The batch of targets.
            Defaults to None: integer class ids `[None]` (the model's output
            without its last axis) for a sparse loss
            (`SparseCategoricalCrossentropy`), else float32 shaped like the
            model's output.

    Returns:
        A `DeclaredModel`.

    Raises:
        ValueError: for a model that is not a Keras model, no loss, or no
            input shape.
    """
    if not isinstance(model, keras.Model):
        raise ValueError(
            "declare_model takes the Keras model that owns the variables the custom "
            "loop trains. Received: model of type " + type(model).__name__)
    loss = model.loss if loss is None and getattr(model, "compiled", False) else loss
    if loss is None:
        raise ValueError(
            "The per-example loss of the custom loop is needed for the training probe: "
            "pass `declare_model(model, loss=...)` (the loss that computes the loss "
            "vector), or compile the model with it. Received: loss=None")
    per_example = per_example_loss_fn(loss)
    if input_spec is None:
        try:
            inputs = model.inputs  # A Functional or Sequential model's.
        except (AttributeError, ValueError):
            inputs = None
        if not inputs or len(inputs) != 1:
            raise ValueError(
                "The model declares no single input, so the training probe does not "
                "know the shape of an example: pass `input_spec=tf.TensorSpec([None, "
                "...], dtype)` to declare_model. Received: model "
                f"{model.name!r} without a single keras.Input")
        input_spec = tf.TensorSpec(inputs[0].shape, inputs[0].dtype)
    if not isinstance(input_spec, tf.TensorSpec) or input_spec.shape.rank is None:
        raise ValueError(
            "input_spec must be a tf.TensorSpec of the batch, e.g. "
            f"tf.TensorSpec([None, 28, 28, 1], tf.float32). Received: {input_spec!r}")
    example_spec = tf.TensorSpec(input_spec.shape[1:], input_spec.dtype)
    if target_spec is None:
        target_spec = _default_target_spec(model, example_spec, per_example)
    elif not isinstance(target_spec, tf.TensorSpec) or target_spec.shape.rank is None:
        raise ValueError(
            "target_spec must be a tf.TensorSpec of the batch's targets, e.g. "
            f"tf.TensorSpec([None], tf.int32). Received: {target_spec!r}")
    else:
        target_spec = tf.TensorSpec(target_spec.shape[1:], target_spec.dtype)
    return DeclaredModel(model, per_example, example_spec, target_spec)


def _default_target_spec(model, example_spec, per_example):
    """One example's target: float32 shaped like the output, or a class id.

    The first that the loss takes on two random rows, float first unless
    the loss's name says sparse (a class id shaped like the output
    without its last axis).
    """
    shape = [2] + [8 if d is None else d for d in example_spec.shape]
    # Outside any tape and function: the model on two rows of zeros.
    with tf.init_scope():
        out = tf.nest.flatten(model(tf.zeros(shape, example_spec.dtype), training=False))[0]
        dense = tf.TensorSpec(out.shape[1:], tf.float32)
        ids = tf.TensorSpec(out.shape[1:-1], tf.int32)
        sparse = per_example.__name__.lower().replace("_", "").startswith("sparse")
        for spec in ((ids, dense) if sparse else (dense, ids)):
            y = tf.zeros([2, *spec.shape], spec.dtype)
            try:
                values = per_example(y, out)
            except (ValueError, TypeError, tf.errors.InvalidArgumentError):
                continue
            if values.shape == [2]:
                return spec
    raise ValueError(
        f"The loss {per_example.__name__!r} takes neither float targets shaped like the "
        "model's output nor class ids, so the training probe cannot draw targets for "
        "it: pass `target_spec=tf.TensorSpec([None, ...], dtype)` to declare_model. "
        f"Received: model output of shape {out.shape}")


def probe(optimizer, rows, var_list):
    """Runs the training probe of the declared model before a custom loop's first release.

    Cached per model, loss and batch size (`training_probe.probe_shapes`),
    so later calls cost a dictionary look-up. Eager, also inside a
    `tf.function` (on a helper thread).

    Args:
        optimizer: `DPKerasOptimizer` with a declared model.
        rows: int. The batch size (rows of the loss vector).
        var_list: list of variables to update.

    Raises:
        ValueError: when no model is declared, a variable of `var_list` is
            not a trainable variable of the declared model, or the probe
            refuses a layer or the loss (naming it).
    """
    declared = optimizer.declared_model
    if declared is None:
        raise ValueError(f"{_UNDECLARED} Received: no declared model")
    model = declared.model
    # Any variable of the model (a non-trainable one too: the probe tests the
    # layers' rows whatever they read, and the loop clips var_list's
    # gradients itself), as the Keras variable or the tf.Variable it holds.
    owned = {id(v) for v in model.variables}
    owned.update(id(v.value) for v in model.variables if isinstance(v, keras.Variable))
    foreign = [v.name for v in var_list if id(v) not in owned]
    if foreign:
        raise ValueError(
            f"var_list holds variables that are not variables of the declared model "
            f"{model.name!r}, so the training probe could not test what they compute: "
            "declare the model that owns them (`optimizer.declare_model(model, "
            f"loss=...)`). Received: {foreign}")
    group = 1 if optimizer.num_microbatches is None else rows // int(optimizer.num_microbatches)
    # The method `fit` would resolve: the probe's layer and loss checks are
    # the same for every method, and its leave-one-out check then bounds
    # the engine's clipped sum as on the fit route (the loop's own Jacobian
    # clipping clips each microbatch's gradient alike).
    method = clipping.resolve_method(model, optimizer.method)
    training_probe.probe_shapes(model, optimizer, declared.loss, declared.example_spec,
                                declared.target_spec, group, rows=rows, method=method)


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
                # A Keras variable is watched through the tf.Variable it holds.
                tape.watch([v.value if isinstance(v, keras.Variable) else v
                            for v in tf.nest.flatten(var_list)])
            loss = loss()
        loss = tf.convert_to_tensor(loss)
    if callable(var_list):
        var_list = var_list()
    return loss, tf.nest.flatten(var_list), tape


def prepare(optimizer, rows, var_list):
    """Binds the optimizer to a custom loop of `rows` examples per call (eager or traced).

    The first call fixes the stream route at B = rows × k (the logical batch
    the ledger accounts, and, without microbatches, the divisor) and builds
    the optimizer; a later call of another size is refused.
    """
    fixed = getattr(optimizer, "custom_loop_rows", None)
    if fixed is None:
        route = optimizer.fit_route
        if route is not None and route.physical_batch_size not in (None, rows):
            raise ValueError(
                "This optimizer was planned for batches of another size: a custom loop "
                "takes the batch size of its first call, and every call must have "
                f"as many rows. Received: {rows} rows, planned "
                f"{route.physical_batch_size}"
            )
        optimizer.mechanism_builder.route_fit(arrays=False, physical_batch_size=rows)
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
    with tf.init_scope():  # The noise state of the route's scheme (a no-op once made).
        optimizer.logical_step.prepare_route()


# A constant: the message carries no value of the batch.
NONFINITE_MESSAGE = (
    "A loss row of this custom-loop step, or its gradient, is NaN or inf. A custom loop "
    "clips a loss vector through its tape, which cannot drop one example alone (the "
    "batched backward pass makes every row NaN), so nothing of this step was released "
    "and the loop stops. This stop depends on the training data and is not covered by "
    "epsilon. Remove non-finite inputs and targets, or train with `fit`, which drops "
    "and counts such examples."
)


def clipped_batch(optimizer, loss, var_list, tape):
    """`(Σ clip(g_j), var_list)` of one batch's microbatches, the optimizer prepared for it."""
    loss, var_list, tape = loss_and_tape(loss, var_list, tape)
    with tape:
        losses, rows = microbatch_losses(loss, optimizer.num_microbatches)
    # Before anything of this batch is clipped or released.
    probe(optimizer, rows, var_list)
    # The engine's clipping method of a loss vector and its tape.
    clip = optimizer.mechanism_builder.clip_settings()
    summed, norms = jacobian_clipping.jacobian_clipped_sum(
        tape, losses, var_list, clip["l2_norm_clip"],
        unconnected_gradients_to_zero=optimizer.unconnected_gradients_to_zero,
        clipping=clip["clipping"], clipping_gamma=clip["clipping_gamma"])
    prepare(optimizer, rows, var_list)
    # A tape cannot drop one example alone: the batched backward pass spreads
    # one example's NaN/Inf to every row (0 · NaN), so the step would release
    # noise only, and that example would move the release by up to (M − 1)·C.
    # Nothing of such a step is released; the loop stops instead.
    finite = tf.reduce_all(tf.math.is_finite(norms))
    with tf.control_dependencies([tf.debugging.Assert(finite, [NONFINITE_MESSAGE])]):
        summed = [tf.identity(s) for s in summed]
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
