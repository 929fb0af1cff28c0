"""Checks around a release that every route runs the same way.

- `check_parameters_are_finite`: after a release, stop when a parameter is
  NaN/Inf (the trainer's loop and Keras `fit` alike).
- `checked_labels` / `checked_targets`: in a traced step, refuse a batch
  whose labels are out of range (or whose float targets are not finite)
  before anything of it is released: the graph twin of
  `tfdp.validation.validate_labels` / `validate_targets`, for inputs that
  cannot be checked up front (a stream). The message is a constant: it
  never carries a label, a count or any other value of the batch.
- `nonfinite_units`: how many privacy units of a batch the clipping dropped
  for a non-finite gradient (a figure not covered by ε).
"""

import tensorflow as tf


def check_parameters_are_finite(variables, step, kept):
    """Stops when a parameter is NaN/Inf, before anything further is written (eager).

    The stop looks at the parameters only. They are the noisy mechanism's
    output, so whether they are finite reveals nothing that ε does not
    cover. A stop on the training examples themselves (say, when every
    example of a step had a non-finite gradient) would be a release of
    private data without noise; there is none: the clipping drops each
    non-finite example (its contribution is zero, which keeps the
    sensitivity bound) and the step is applied with its noise, whatever
    the examples were.

    Args:
        variables: list of `tf.Variable`. The model's trainable variables.
        step: int. The step just applied.
        kept: str. What the route keeps of the last good state, and where
            (a sentence for the message).

    Raises:
        FloatingPointError: `The parameters are NaN/Inf after step <step>:
            stopping. <kept>; lower the learning rate.`
    """
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in variables])
    if not bool(finite):
        raise FloatingPointError(
            f"The parameters are NaN/Inf after step {step}: stopping. "
            f"{kept}; lower the learning rate."
        )


def labels_message(num_classes):
    """The constant message of a batch whose labels are not in [0, num_classes)."""
    return (
        f"A batch of the training stream holds labels that are not class indices in "
        f"[0, num_classes={num_classes}) (num_classes from the model's output width): "
        "nothing of that batch, nor of its logical step, was released. Fix or drop those "
        "rows of the stream (check them with tfdp.validation.validate_labels), or give "
        "the model as many outputs as classes."
    )


TARGETS_MESSAGE = (
    "A batch of the training stream holds targets that are NaN or inf: nothing of that "
    "batch, nor of its logical step, was released. Fix or drop those rows of the stream "
    "(check them with tfdp.validation.validate_targets)."
)


def checked_labels(labels, num_classes):
    """`labels`, once a traced check found them all in [0, num_classes).

    Args:
        labels: tensor `[B, ...]`. Integer labels, or floats holding whole
            numbers.
        num_classes: int. The number of classes.

    Returns:
        `labels`, depending on the check, so that nothing computed from
        them (the clipped sum, the release) runs before it passes.

    Raises:
        tf.errors.InvalidArgumentError: when the step runs, with
            `labels_message`, and no value of the batch.
    """
    values = tf.convert_to_tensor(labels)
    if values.dtype.is_floating:
        ok = tf.logical_and(tf.math.is_finite(values), tf.equal(tf.floor(values), values))
        ok = tf.logical_and(ok, tf.logical_and(values >= 0, values < num_classes))
    else:
        ok = tf.logical_and(values >= 0, values < tf.cast(num_classes, values.dtype))
    check = tf.debugging.Assert(tf.reduce_all(ok), [labels_message(num_classes)])
    with tf.control_dependencies([check]):
        return tf.identity(values)


def checked_targets(targets):
    """`targets`, once a traced check found them all finite (float targets).

    Args:
        targets: tensor `[B, ...]`.

    Returns:
        `targets`, depending on the check.

    Raises:
        tf.errors.InvalidArgumentError: when the step runs, with
            `TARGETS_MESSAGE`, and no value of the batch.
    """
    values = tf.convert_to_tensor(targets)
    if not values.dtype.is_floating:
        return values
    check = tf.debugging.Assert(tf.reduce_all(tf.math.is_finite(values)), [TARGETS_MESSAGE])
    with tf.control_dependencies([check]):
        return tf.identity(values)


def nonfinite_units(norms, sample_weight=None, group_size=1):
    """The privacy units of a batch whose gradient norm is NaN/Inf (dropped by the clipping).

    `clip_coefficients` gives them a zero coefficient, so they contribute
    nothing; this counts them, for a figure not covered by ε. Padding
    (weight 0) is not counted; a group of rows is one unit, real if any of
    its rows is.

    Args:
        norms: float tensor `[U]`. One norm per unit, as `clipped_grad_sum`
            returns them.
        sample_weight: float tensor `[U * group_size]` or None. The rows'
            weights; None: every row is real.
        group_size: int. Rows per unit.

    Returns:
        A float32 scalar tensor.
    """
    norms = tf.cast(tf.reshape(norms, [-1]), tf.float32)
    dropped = tf.cast(tf.logical_not(tf.math.is_finite(norms)), tf.float32)
    if sample_weight is None:
        return tf.reduce_sum(dropped)
    real = tf.cast(tf.reshape(sample_weight, [-1]) > 0, tf.float32)
    if group_size > 1:
        real = tf.reduce_max(tf.reshape(real, [-1, group_size]), 1)
    return tf.reduce_sum(real * dropped)
