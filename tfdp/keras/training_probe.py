"""The training probe of a private Keras model, run once before its first update.

`probe_before_training` runs `tfdp.dp.sensitivity.probe_training` on
synthetic rows shaped like the batch (never the training data), so that a
layer or a loss that mixes examples, state written from the data, or a
clipped sum that one privacy unit moves by more than C is refused before
anything is released.
"""

import threading
import weakref

import tensorflow as tf

from tfdp.dp import adapted_state
from tfdp.dp import model_probe
from tfdp.dp import sensitivity

# The probes each DPOptimizer ran (`probe_before_training`); under a
# strategy every replica traces the train step, and one probe serves them.
_PROBED = weakref.WeakKeyDictionary()
_PROBE_LOCK = threading.Lock()


def planned_batch_size(optimizer):
    route = optimizer.fit_route
    if route is None or not route.marks_last_batch:
        return None
    return route.sampler.physical_batch_size


def probe_before_training(model, optimizer, per_example_loss, x, y, group=1, *, rows, method):
    """Runs the training probe once per model, loss and batch size (see below).

    `tfdp.dp.sensitivity.probe_training` on distinct random examples (never
    the training data) shaped like `x` and `y`, with `rows` rows (the
    physical batch size; at least 4) and the compiled per-example loss:
    refuses a layer or a loss that mixes examples, or a clipped sum that
    one example moves by more than C·(1 + 1e-4). Runs eagerly, also while
    the train step is traced (on a helper thread), so that the refusal
    comes before any update. Cached on the optimizer.

    Args:
        model: keras.Model. The inner model.
        optimizer: `DPOptimizer`.
        per_example_loss: callable. `(y_true, y_pred) -> [B]`.
        x: tensor. A batch of inputs (symbolic while tracing).
        y: tensor. Its targets.
        group: int. Rows clipped together (`DPOptimizer.clipping_groups`).
        rows: int or None. The physical batch size.
        method: str. The resolved clipping method.
    """
    if y is None:
        return
    x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
    probe_shapes(model, optimizer, per_example_loss, tf.TensorSpec(x.shape[1:], x.dtype),
                 tf.TensorSpec(y.shape[1:], y.dtype), group, rows=rows, method=method)


def probe_shapes(model, optimizer, per_example_loss, example_spec, target_spec, group=1, *,
                 rows, method):
    """`probe_before_training` from one example's input and target specs, not a batch.

    For a route that sees no batch before it releases (the TF-Privacy
    custom loop, which is handed a loss vector): the probe batch is drawn
    from the specs alone, as `probe_before_training`'s from a batch.

    Args:
        model: keras.Model. The model trained.
        optimizer: `DPOptimizer`. Its `l2_norm_clip` and `weight_decay`.
        per_example_loss: callable. `(y_true, y_pred) -> [B]`.
        example_spec: `tf.TensorSpec`. One example's input (no batch axis).
        target_spec: `tf.TensorSpec`. One example's target (no batch axis).
        group: int. Rows clipped together. Defaults to 1.
        rows: int or None. The physical batch size.
        method: str. The resolved clipping method.

    Raises:
        ValueError: naming the layer or the loss that mixes examples or
            writes state from the batch, or the method that does not bound
            the model.
    """
    rows = max(int(rows or 0), model_probe.MIN_PROBE_ROWS)
    rows += (-rows) % group
    # Unknown dimensions (e.g. a sequence length) are probed at 8.
    x_shape = tuple(8 if d is None else int(d) for d in example_spec.shape)
    y_shape = tuple(8 if d is None else int(d) for d in target_spec.shape)
    x_dtype, y_dtype = tf.as_dtype(example_spec.dtype), tf.as_dtype(target_spec.dtype)
    clip = optimizer.mechanism_builder.clip_settings()
    key = (id(model), id(per_example_loss), rows, method, group, x_shape, x_dtype.name,
           y_shape, y_dtype.name, tuple(sorted(clip.items())), optimizer.weight_decay)
    def run():
        # Before the first update: state set before training (an adapted
        # Normalization's mean) is released as it is, not covered by ε.
        adapted_state.warn_adapted_state(model)
        batch = sensitivity.synthetic_batch(model, rows, x_shape, x_dtype, y_shape, y_dtype)
        sensitivity.probe_training(
            model, per_example_loss, batch, clip["l2_norm_clip"], method,
            weight_decay=optimizer.weight_decay, augmentation_multiplicity=group,
            clipping=clip["clipping"], clipping_gamma=clip["clipping_gamma"])

    with _PROBE_LOCK:
        probed = _PROBED.setdefault(optimizer, set())
        if key in probed:
            return
        model_probe.run_eagerly(run)
        probed.add(key)
