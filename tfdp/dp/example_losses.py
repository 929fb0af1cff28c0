"""What every clipping method differentiates: the batch's weighted per-example losses.

`clipping.clipped_grad_sum` turns its arguments into an `ExampleBatch` (row
weights and per-example masks, with augmentation multiplicity folded in) and
a `WeightDecay` (the in-loss L2 term, clipped with the gradient); each
method then differentiates `per_example_losses` and the decay's penalty.
"""

import tensorflow as tf


class WeightDecay:
    """The in-loss L2 term `0.5 * coefficient * Σ‖w‖²` over `variables`.

    Args:
        coefficient: float. The weight decay; 0 for none.
        variables: list of variables to decay (ignored when `coefficient`
            is 0).
    """

    def __init__(self, coefficient, variables):
        self.coefficient = float(coefficient)
        self.ids = {id(v) for v in variables} if self.coefficient else set()
        self.variables = list(variables) if self.coefficient else []

    def applies(self, variable):
        """Whether `variable` is decayed."""
        return id(variable) in self.ids

    def penalty(self):
        """The term, a scalar (0.0 without decayed variables)."""
        if not self.variables:
            return 0.0
        return 0.5 * self.coefficient * tf.add_n(
            [tf.reduce_sum(tf.square(v)) for v in self.variables]
        )


class ExampleBatch:
    """Row weights (loss scale, 1/K folded in) and per-example masks.

    Args:
        sample_weight: float tensor `[rows]`. Each row's loss scale; 0 for
            padding.
        k: int. Rows per example (augmentation multiplicity).
    """

    def __init__(self, sample_weight, k):
        self.k = k
        self.row_weights = sample_weight / float(k)
        real_rows = tf.cast(sample_weight > 0, tf.float32)
        self.mask = tf.reduce_max(tf.reshape(real_rows, [-1, k]), 1) if k > 1 else real_rows


def per_example_losses(model, loss_fn, x, y, weights, training):
    """The rows' losses `loss_fn(y, model(x))`, as float32, times `weights`.

    Args:
        model: keras.Model.
        loss_fn: callable. `(y_true, y_pred) -> [rows]` losses.
        x: tensor. Inputs, batch first.
        y: tensor. Targets, batch first.
        weights: float tensor `[rows]`. Row weights (`ExampleBatch.row_weights`).
        training: bool. Passed to the model call.

    Returns:
        float32 tensor `[rows]`.
    """
    predictions = model(x, training=training)
    losses = tf.reshape(loss_fn(y, predictions), [-1])
    return tf.cast(losses, tf.float32) * weights
