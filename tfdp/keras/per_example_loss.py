"""`per_example_loss_fn`: a compiled Keras loss as one loss per example."""

import keras
import tensorflow as tf


def per_example_loss_fn(loss, loss_weights=None):
    """Turns a compiled Keras loss into `(y_true, y_pred) -> [B]` losses.

    - A string is resolved with `keras.losses.get` (as `compile` does).
    - A `keras.losses.Loss` object is evaluated through its `call` method,
      which returns unreduced values whatever its `reduction` (for the
      built-in losses, `LossFunctionWrapper.call` applies the wrapped
      function with the object's own arguments, e.g. `from_logits`).
    - A plain function must return one value per example.

    Values with extra axes (e.g. per time step) are averaged over them.

    Args:
        loss: the `loss` given to `compile`. A single loss (or a list/dict
            with exactly one).
        loss_weights: optional scalar (or one-element list/dict) weight.

    Returns:
        A function `(y_true, y_pred) -> float32 [B]`.
    """
    loss = _single(loss, "loss")
    weight = _single(loss_weights, "loss_weights")
    weight = 1.0 if weight is None else float(weight)
    if loss is None:
        raise ValueError(
            "A private model must be compiled with a `loss`. Received: loss=None"
        )
    if isinstance(loss, (str, dict)):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        loss_object = loss

        def fn(y_true, y_pred):
            dtype = loss_object.dtype
            return loss_object.call(
                keras.ops.convert_to_tensor(y_true, dtype=dtype),
                keras.ops.convert_to_tensor(y_pred, dtype=dtype),
            )

    elif callable(loss):
        fn = loss
    else:
        raise ValueError(f"Unsupported loss for a private model. Received: loss={loss!r}")

    def per_example(y_true, y_pred):
        values = tf.cast(fn(y_true, y_pred), tf.float32)
        if values.shape.rank is not None and values.shape.rank > 1:
            values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
        values = tf.reshape(values, [-1])
        return values * weight if weight != 1.0 else values

    # Errors about the loss (e.g. the training probe's) name the user's loss.
    per_example.__name__ = (getattr(loss, "name", None) or getattr(loss, "__name__", None)
                            or type(loss).__name__)
    return per_example


def _single(value, what):
    if isinstance(value, dict) and not (what == "loss" and "class_name" in value):
        values = list(value.values())
    elif isinstance(value, (list, tuple)):
        values = list(value)
    else:
        return value
    if len(values) != 1:
        raise NotImplementedError(
            "Private models support a single output and a single loss. "
            f"Received: {what}={value!r}"
        )
    return values[0]
