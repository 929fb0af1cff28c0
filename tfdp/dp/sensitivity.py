"""Empirical checks that one example moves the clipped sum by at most C.

DP needs every example's contribution to the clipped sum S to be at most C in
L2 norm. `check_sensitivity` measures, for each example j of a probe batch,
‖S(D) − S(D without j)‖ / C, removing j as the data pipeline pads a batch: its
input zeroed and its weight 0, so that every other example keeps its row (and
its random draws: the model's random state, `random_state.RandomState`, is
restored before each sum). Any figure above 1 (beyond float error) means the
engine does not bound this model.

`probe_training` is what every training route runs before its first update
(the trainer, Keras `fit`, the TF-Privacy compat optimizers): at the physical
batch size that training uses, with the user's loss, it refuses a layer or a
loss that mixes examples, then measures the leave-one-out sensitivity of a few
examples of the full batch.
"""

import numpy as np
import tensorflow as tf

from tfdp.dp import clipping
from tfdp.dp import model_probe
from tfdp.dp import probe_batches
from tfdp.dp import random_state

TOLERANCE = 1e-4  # Float error allowed above 1 (`check_sensitivity` figures).
# Examples left out, one at a time, by `probe_training` (see its docstring).
LEAVE_OUT = 2


def check_sensitivity(model, loss, batch, l2_norm_clip, method="auto", leave_out=None,
                      **clip_kwargs):
    """Largest leave-one-out contribution over C, for each method.

    Args:
        model: keras.Model. The model to train.
        loss: callable. `(y_true, y_pred) -> [B]` per-example losses.
        batch: tuple `(x, y)` or `(x, y, sample_weight)`. The probe batch
            (the cost is one clipped sum per example left out, plus one).
        l2_norm_clip: float. The clipping bound C.
        method: str or sequence of str. Clipping method(s) to check.
            Defaults to "auto".
        leave_out: sequence of int or None. The examples (groups of
            `augmentation_multiplicity` rows) left out, one at a time, with
            the rest of the batch in place. Defaults to None: every example.
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
            m: check_sensitivity(model, loss, batch, l2_norm_clip, m, leave_out, **clip_kwargs)
            for m in method
        }
    x, y = tf.convert_to_tensor(batch[0]), tf.convert_to_tensor(batch[1])
    rows = int(x.shape[0])
    weights = (
        tf.ones([rows], tf.float32) if len(batch) < 3 or batch[2] is None
        else tf.cast(tf.reshape(batch[2], [-1]), tf.float32)
    )
    k = int(clip_kwargs.get("augmentation_multiplicity", 1))
    randomness = random_state.RandomState(model)

    def clipped_sum(inputs, sample_weight):
        randomness.restore()  # The same random draws (dropout masks, noise) each time.
        grads, _ = clipping.clipped_grad_sum(
            model, loss, inputs, y, l2_norm_clip=l2_norm_clip, method=method,
            sample_weight=sample_weight, **clip_kwargs,
        )
        return [tf.convert_to_tensor(g) for g in grads]

    examples = range(rows // k) if leave_out is None else leave_out
    try:
        full = clipped_sum(x, weights)
        worst = 0.0
        for j in examples:
            if not np.any(weights.numpy()[j * k:(j + 1) * k] > 0):
                continue
            keep = np.ones([rows], "float32")
            keep[j * k:(j + 1) * k] = 0.0
            keep_x = tf.reshape(tf.constant(keep), [-1] + [1] * (x.shape.rank - 1))
            without = clipped_sum(x * tf.cast(keep_x, x.dtype), weights * keep)
            diff = tf.linalg.global_norm([a - b for a, b in zip(full, without)])
            worst = max(worst, float(diff) / float(l2_norm_clip))
        if worst > 1.0 + TOLERANCE:
            # Is the figure a measurement? Not when the full sum itself moves.
            again = clipped_sum(x, weights)
            if float(tf.linalg.global_norm([a - b for a, b in zip(full, again)])) > (
                    TOLERANCE * float(l2_norm_clip)):
                raise ValueError(
                    f"Model '{model.name}' draws random values in training that the "
                    "probe cannot hold fixed between two clipped sums of the same batch "
                    "(it draws them from none of: a Keras SeedGenerator, a "
                    "tf.random.Generator held by a layer, numpy's or Python's global "
                    "generator), so one example's contribution cannot be measured. "
                    "Draw them with `keras.random` and a "
                    "`keras.random.SeedGenerator`, or a `tf.random.Generator` held by "
                    f"the layer. Received: model={model.name!r}, method={method!r}")
    finally:
        randomness.restore()
    return worst


def refuse_unbounded(figure, method):
    """Raises when a `check_sensitivity` figure exceeds 1 + `TOLERANCE`.

    With a tapped method the cause may be the method (a use of a variable
    that its per-layer norms miss), and a per-example method is the fix;
    with a per-example method ("naive", "vectorized") the model itself lets
    one example move the others' gradients.
    """
    if figure <= 1.0 + TOLERANCE:
        return
    if method in clipping.TAPPED_METHODS:
        fix = ("Use method='naive' or 'vectorized' (which compute each example's "
               "gradient by itself), or change the layers that the probe names.")
    else:
        fix = ("This method computes each example's gradient by itself, so the model "
               "lets one example change the others' gradients (e.g. mixing between "
               "examples that the layer check did not trigger): make every layer and "
               "the loss per-example.")
    raise ValueError(
        f"The clipping engine does not bound this model with method={method!r}: "
        f"one example changes the clipped sum by {figure:.6f}·C (> 1 + {TOLERANCE}). "
        f"Training would not be differentially private. {fix} "
        f"Received: sensitivity={figure:.6f}, method={method!r}"
    )


def refuse_mixing_loss(loss, y_pred, y_true, model):
    """Raises when `loss`'s value for one example depends on another example.

    For each set of `probe_batches.changed_row_sets`, those rows' predictions
    and targets are changed; every other row's loss must stay the same. So a
    dependence of any row's loss on any other row is tested. A batch mean
    inside the loss (e.g. the cross-entropy of `p − mean_over_batch(p)`)
    fails this: no clipping of per-example gradients can bound it.

    Args:
        loss: callable. `(y_true, y_pred) -> [B]`, the loss of training.
        y_pred: tensor. The model's predictions on the probe batch.
        y_true: tensor. The probe batch's targets.
        model: keras.Model. Named in the error.

    Raises:
        ValueError: naming the loss.
    """
    y_pred = tf.convert_to_tensor(y_pred)
    y_true = tf.convert_to_tensor(y_true)
    rows = int(y_pred.shape[0])
    if rows < 2:
        return
    # Other predictions and targets for every row: reversed classes scaled
    # (a scalar output shifted), and another row's target.
    flipped = y_pred if y_pred.shape.rank < 2 else tf.reverse(y_pred, axis=[-1])
    other_pred = flipped * tf.cast(3.0, y_pred.dtype) + tf.cast(1.0, y_pred.dtype)
    other_true = tf.roll(y_true, shift=1, axis=0)
    before = tf.cast(tf.reshape(loss(y_true, y_pred), [-1]), tf.float64).numpy()
    if before.shape[0] != rows:
        raise ValueError(
            f"The loss of model '{model.name}' must give one value per example. "
            f"Received: {before.shape[0]} values for a batch of {rows}, "
            f"loss={_name(loss)}"
        )
    for changed in probe_batches.changed_row_sets(rows):
        def pick(other, same):
            mask = tf.reshape(tf.constant(changed), [rows] + [1] * (same.shape.rank - 1))
            return tf.where(mask, other, same)

        after = tf.cast(tf.reshape(
            loss(pick(other_true, y_true), pick(other_pred, y_pred)), [-1]), tf.float64).numpy()
        kept = ~changed
        scale = max(float(np.max(np.abs(before[kept]), initial=0.0)), 1e-6)
        moved = float(np.max(np.abs(before[kept] - after[kept]), initial=0.0))
        if moved > 1e-5 * scale:
            raise ValueError(
                f"The loss {_name(loss)} mixes examples: changing some examples' "
                "predictions and targets changes the losses of other examples of the "
                "batch (e.g. a batch mean inside the loss). Per-example clipping cannot "
                "bound such a loss, so training would not be differentially private. "
                "Use a loss whose value for each example depends on that example "
                f"alone. Received: loss={_name(loss)}, change of the other examples' "
                f"losses={moved:.3g}"
            )


def _name(loss):
    return repr(getattr(loss, "name", None) or getattr(loss, "__name__", None)
                or type(loss).__name__)


def probe_training(model, loss, batch, l2_norm_clip, method="auto", leave_out=LEAVE_OUT,
                   input_ranges=None, **clip_kwargs):
    """Refuses a model or loss that DP-SGD cannot bound, at the batch size used.

    Run on a probe batch of distinct random examples with as many rows as
    the physical batches of training (at least `model_probe.MIN_PROBE_ROWS`)
    and the loss of training, in three parts:

    1. Layers: `model_probe.probe` changes sets of rows such that every
       row is tested against every other, and compares the unchanged rows'
       outputs, layer by layer (names the first layer that lets a row depend
       on another, e.g. batch statistics or a layer adding row j into row
       i, also one that does so only from some batch size on, or only for
       some values: its batches are drawn from the standard normal and the
       typical ranges of image data, `probe_batches.probe_value_ranges`, with
       the random state held fixed within a trial and varied between
       trials); it also refuses a layer that writes non-trainable state
       from the batch.
    2. The loss: `refuse_mixing_loss` changes the predictions and targets
       of the same sets of rows and compares every other row's loss (names
       the loss).
    3. The engine: the leave-one-out sensitivity (`check_sensitivity`) of
       `leave_out` examples (evenly spaced from the first to the last), each
       left out of the FULL batch. Refused above 1 + `TOLERANCE`.

    Why a few leave-outs suffice: what makes the sensitivity exceed C is a
    dependence between examples or a per-layer error of the engine. Parts 1
    and 2 test the dependence of every row on every other row, at the real
    batch size. The engine's per-example norms and clipping treat every row
    alike, and the probe's rows are exchangeable (i.i.d. random), so an
    engine error shows on any example left out; the full batch keeps the
    batch-size-dependent code paths of training. Leaving out every example
    would cost one clipped sum per row (256 at a physical batch of 256) and
    find nothing the first and last cannot: the cost is `leave_out` + 1
    clipped sums and about T·(m + 1) + 2 forward passes at the physical
    batch size, m the number of row sets (7 at 32 rows, 11 at 256) and T
    the trials (one per value range: 4 for real-valued inputs, 1 for
    integer ones; `model_probe.RANDOM_TRIALS` for a model that draws random
    values in training). Like any probe this is a check, not a proof.

    Args:
        model: keras.Model. The model to train.
        loss: callable. `(y_true, y_pred) -> [B]`, the per-example loss of
            training.
        batch: tuple `(x, y)`. A probe batch of the physical batch size (rows
            = examples × `augmentation_multiplicity`), e.g. `synthetic_batch`.
        l2_norm_clip: float. C.
        method: str. The clipping method (resolved, or "auto").
        leave_out: int. Examples left out one at a time. Defaults to
            `LEAVE_OUT`.
        input_ranges: sequence of `(low, high)` or None. Public ranges of
            the inputs that the route knows (e.g. its preprocessing's
            output for black and white images), probed besides the typical
            ones (`model_probe.probe`'s `ranges`). Defaults to None.
        **clip_kwargs: passed to `clipped_grad_sum`.

    Returns:
        The largest leave-one-out figure over C (a float).

    Raises:
        ValueError: naming the layer or the loss that mixes examples, or the
            method that does not bound the model.
    """
    x, y = tf.convert_to_tensor(batch[0]), tf.convert_to_tensor(batch[1])
    rows = int(x.shape[0])
    report = model_probe.probe(model, x, rows=rows, ranges=input_ranges or ())
    if report is not None:
        report.refuse_mixing()
        report.refuse_state_writes()
    resolved = clipping.resolve_method(model, method, x)
    randomness = random_state.RandomState(model)
    try:
        refuse_mixing_loss(loss, model(x, training=False), y, model)
    finally:
        randomness.restore()
    k = int(clip_kwargs.get("augmentation_multiplicity", 1))
    examples = rows // k
    chosen = sorted({int(j) for j in np.linspace(0, examples - 1, max(1, min(leave_out, examples)))})
    figure = check_sensitivity(model, loss, (x, y), l2_norm_clip, resolved, leave_out=chosen,
                               **clip_kwargs)
    refuse_unbounded(figure, resolved)
    return figure


def _output_dim(model, x):
    """The last dimension of the model's output on `x` (1 for a scalar)."""
    out = tf.nest.flatten(model(x, training=False))[0]
    return int(out.shape[-1]) if out.shape.rank > 1 else 1


def synthetic_batch(model, examples, x_shape, x_dtype, y_shape=(), y_dtype="int32",
                    num_classes=None, augmentation_multiplicity=1, seed=0):
    """A probe batch of distinct random examples (no training data).

    Args:
        model: keras.Model. Integer inputs are valid ids for its embeddings.
        examples: int. Examples (rows: examples × augmentation_multiplicity,
            each example's rows identical, as on-device augmentation gets
            them). At least `model_probe.MIN_PROBE_ROWS`.
        x_shape: tuple. One example's input shape.
        x_dtype: the input dtype.
        y_shape: tuple. One example's target shape. Defaults to `()`.
        y_dtype: the target dtype. Integer targets are classes in
            `[0, num_classes)`; float ones uniform in [0, 1). Defaults to
            "int32".
        num_classes: int or None. Defaults to the model output's last
            dimension (at least 2).
        augmentation_multiplicity: int. Defaults to 1.
        seed: int. Defaults to 0.

    Returns:
        `(x, y)` tensors.
    """
    examples = max(int(examples), model_probe.MIN_PROBE_ROWS)
    x, _ = probe_batches.probe_inputs(model, tuple(x_shape), x_dtype, examples, seed)
    rng = np.random.default_rng(seed + 1)
    y_dtype = tf.as_dtype(y_dtype)
    if y_dtype.is_integer:
        if num_classes is None:
            num_classes = max(_output_dim(model, x[:1]), 2)
        y = rng.integers(0, num_classes, size=(examples,) + tuple(y_shape))
    else:
        y = rng.uniform(size=(examples,) + tuple(y_shape))
    k = int(augmentation_multiplicity)
    x = tf.repeat(x, k, axis=0)
    y = tf.repeat(tf.constant(y, y_dtype), k, axis=0)
    return x, y
