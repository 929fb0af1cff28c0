"""The probe of a `DPModel` subclass's own `train_step`, run once before its first update.

A subclass may change the batch before it calls `super().train_step(...)`
(or `tfdp.keras.private_update`): augment it, reweight it. Per-example
clipping bounds one example's contribution only if each example still
reaches the private update in one privacy unit and alone: MixUp or CutMix
across the batch, a batch normalised by its own statistics, or the batch
concatenated with an augmented copy, void the guarantee.

`probe_train_step` replays the subclass's `train_step`, as written, on
synthetic batches shaped like the one it is traced with (never the training
data), and stops each replay where the batch enters the private update
(`intercept`, which `private_update` calls first): nothing is clipped,
accumulated or released, and the model's variables are put back. As the
layer probe does (`tfdp.dp.model_probe`), it replays the step on a first
batch and on batches whose rows in the sets of `changed_row_sets` changed,
from the typical value ranges of the inputs, with the random state held
fixed within a trial (every replay is traced anew with the trial's graph
seed; generators, seed generators, numpy and Python are restored) and
varied between trials. Then, row by row, what reached the update (x, y,
sample_weight):

- a row that moved when no single example (privacy unit) moved, but
  several did, depends on several examples: mixing;
- an example whose rows reached more than one clipping unit (the
  optimizer's `clipping_groups`) would be clipped, and counted, more than
  once.

Either is refused with a `ValueError` naming the `train_step`, before its
first update. Per-example transforms (a flip of each row by its own random
draw, scaling x, reweighting each row by itself) pass, as does a permutation
of the rows.
"""

import contextlib
import threading
import weakref

import keras
import numpy as np
import tensorflow as tf

from tfdp.dp import layer_trace
from tfdp.dp import model_probe
from tfdp.dp import probe_batches
from tfdp.dp import random_state
from tfdp.dp import sensitivity

_local = threading.local()
# The probes each model ran: under a strategy every replica traces the train
# step, and one probe serves them.
_PROBED = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class _Reached(BaseException):
    """Stops a replay where the batch enters the private update, with what reached it.

    A `BaseException`: a `train_step` that catches `Exception` around its
    call of `super().train_step` does not swallow it.
    """

    def __init__(self, data, group):
        super().__init__()
        self.data, self.group = data, group


def intercept(optimizer, x, y, sample_weight, batch_size=None):
    """During a replay of `probe_train_step`, stops the step here with its batch.

    `private_update` calls it before it reads anything of the batch.
    Outside a replay it does nothing.

    Args:
        optimizer: `DPOptimizer`. Its `clipping_groups` give the clipping
            units of the batch.
        x: tensor. The inputs that reached the update.
        y: tensor or None. Their targets.
        sample_weight: tensor or None. Their weights.
        batch_size: int or None. The `fit` batch size.
    """
    if not getattr(_local, "replaying", False):
        return
    _, group = optimizer.clipping_groups(x, batch_size)
    raise _Reached((x, y, sample_weight), int(group))


@contextlib.contextmanager
def stepping():
    """Marks a call of a probed `train_step` on this thread (`outermost` is then False)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def outermost():
    """Whether a probed `train_step` called now is the outermost one, not in a replay."""
    return not getattr(_local, "replaying", False) and not getattr(_local, "depth", 0)


def probe_train_step(model, train_step, data, *, rows, group=1, marks_last=False):
    """Refuses a `train_step` that mixes examples before the private update (see above).

    Runs once per model, class and batch signature, eagerly (also while the
    train step is traced, on a helper thread), before the step's first
    update.

    Args:
        model: `tfdp.DPModel`. The model whose subclass defines `train_step`.
        train_step: the subclass's `train_step` function (unbound).
        data: the batch the step is called with (possibly symbolic): only
            its structure, shapes and dtypes are read.
        rows: int or None. The physical batch size, where `data`'s batch
            dimension is unknown. At least `model_probe.MIN_PROBE_ROWS`
            privacy units are probed.
        group: int. Rows of one privacy unit in the batch (a user's block).
            Defaults to 1.
        marks_last: bool. The batch is `(x, y, sample_weight, last)` (the
            array routes), else Keras' `(x, y, sample_weight)` or a prefix.
            Defaults to False.

    Raises:
        ValueError: naming the `train_step`, when what it hands to the private
            update mixes examples, or holds one example in several clipping
            units, or when the step draws random values the probe cannot
            hold fixed.
    """
    specs = tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape, t.dtype) if tf.is_tensor(t) or isinstance(
            t, np.ndarray) else t, data)
    flat = tf.nest.flatten(specs)
    if not flat or not isinstance(flat[0], tf.TensorSpec) or not flat[0].shape.rank:
        return  # Not a single input tensor: the private update refuses it.
    x_spec = flat[0]
    rows = int(x_spec.shape[0] or rows or 0)
    units = max(rows // group, model_probe.MIN_PROBE_ROWS)
    key = (type(model), repr(specs), units, group, marks_last)
    with _LOCK:
        probed = _PROBED.setdefault(model, set())
        if key in probed:
            return
        model_probe.run_eagerly(_probe, model, train_step, specs, units, group, marks_last)
        probed.add(key)


def _name(model, train_step):
    return f"{type(model).__qualname__}.{train_step.__name__}"


def _batches(model, specs, units, group, marks_last):
    """The probe's batches: `[(first, changed)]` per value range, and the changed sets.

    `changed(set)` is the batch with the rows of that set's privacy units
    changed (inputs, targets and weights).
    """
    rows = units * group
    if marks_last:
        x_spec, y_spec, w_spec, last_spec = specs
    else:
        x_spec, y_spec, w_spec = keras.utils.unpack_x_y_sample_weight(specs)
    inner = getattr(model, "model", model)
    x_shape = tuple(8 if d is None else int(d) for d in x_spec.shape[1:])
    y = y_other = None
    if isinstance(y_spec, tf.TensorSpec):
        y_shape = tuple(8 if d is None else int(d) for d in y_spec.shape[1:])
        _, y = sensitivity.synthetic_batch(inner, rows, x_shape, x_spec.dtype, y_shape,
                                           y_spec.dtype)
        if y_spec.dtype.is_integer:
            classes = max(int(tf.reduce_max(y)) + 1, 2)
            y_other = tf.math.floormod(y + 1, tf.cast(classes, y.dtype))
        else:
            y_other = tf.cast(1.0, y.dtype) - y
    w = w_other = None
    if isinstance(w_spec, tf.TensorSpec):
        w_shape = [rows] + [1] * (w_spec.shape.rank - 1) if w_spec.shape.rank else []
        w = tf.ones(w_shape, w_spec.dtype)
        w_other = tf.fill(w_shape, tf.cast(0.5, w_spec.dtype))
    sets = np.repeat(probe_batches.changed_row_sets(units), group, axis=1)

    def pack(x_value, y_value, w_value):
        if marks_last:
            return (x_value, y_value, w_value,
                    tf.zeros(last_spec.shape, last_spec.dtype)
                    if isinstance(last_spec, tf.TensorSpec) else last_spec)
        if not isinstance(specs, tuple):
            return x_value
        return (x_value, y_value, w_value)[:len(specs)]

    def pick(changed, other, same):
        if same is None:
            return None
        mask = tf.reshape(tf.constant(changed), [rows] + [1] * (same.shape.rank - 1))
        return tf.where(mask, other, same)

    batches = []
    for value_range in probe_batches.probe_value_ranges(x_spec.dtype):
        x, x_other = probe_batches.probe_inputs(inner, x_shape, x_spec.dtype, rows,
                                              value_range=value_range)

        def changed_batch(changed, x=x, x_other=x_other):
            return pack(pick(changed, x_other, x), pick(changed, y_other, y),
                        pick(changed, w_other, w))

        batches.append((pack(x, y, w), changed_batch))
    return batches, sets


# Eager Python throughout: AutoGraph, which converts what a traced train step
# calls, would turn its comparisons into graph ops.
@tf.autograph.experimental.do_not_convert
def _probe(model, train_step, specs, units, group, marks_last):
    name = _name(model, train_step)
    batches, sets = _batches(model, specs, units, group, marks_last)
    randomness = random_state.RandomState(model)
    metrics = [(v, v.numpy()) for v in model.metrics_variables]
    outputs = {"group": None}

    def replay(batch, seed, start):
        """The (x, y, sample_weight) that reached the update, as numpy, or None."""
        randomness.restore(start)

        def step(data):
            # The graph's own seed: TensorFlow's random ops draw alike in
            # every replay of a trial.
            tf.random.set_seed(seed)
            _local.replaying = True
            try:
                train_step(model, data)
            except _Reached as reached:
                outputs["group"] = reached.group
                return reached.data
            finally:
                _local.replaying = False
            return None

        # Traced anew each time, so that every replay draws alike.
        reached = tf.function(step, autograph=False)(batch)
        if reached is None:
            return None
        return tf.nest.map_structure(lambda t: None if t is None else np.asarray(t), reached)

    try:
        first, changed_batch = batches[0]
        start = randomness.initial
        base = replay(first, 0, start)
        following = randomness.snapshot()
        if not _same(base, replay(first, 0, start)):
            raise ValueError(
                f"{name} draws random values that the training probe cannot hold fixed "
                "between two replays of the same batch (it draws them from none of: "
                "TensorFlow's random ops, `keras.random` with or without a "
                "SeedGenerator, a tf.random.Generator held by the model or a layer, "
                "numpy's or Python's global generator), so whether it mixes examples "
                "cannot be checked. Draw them from one of those. "
                f"Received: train_step={name}")
        draws = not _same(base, replay(first, 1, following))
        trials = max(len(batches), model_probe.RANDOM_TRIALS if draws else 1)
        for trial in range(trials):
            first, changed_batch = batches[trial % len(batches)]
            if trial:
                base = replay(first, trial, start)
                following = randomness.snapshot()
            moved = []
            for changed in sets:
                result = replay(changed_batch(changed), trial, start)
                moved.append(_moved_rows(base, result))
            if base is not None or any(m is not None for m in moved):
                _refuse(name, moved, sets[:, ::group], outputs["group"])
            start = following
    finally:
        randomness.restore()
        for v, value in metrics:
            v.assign(value)


def _same(a, b):
    moved = _moved_rows(a, b)
    return moved is not False and (moved is None or not np.any(moved))


def _moved_rows(base, result):
    """Which rows of what reached the update moved: bool `[rows]`, None if none reached.

    False when the two differ in structure or shape (the rows that reach
    the update depend on the values).
    """
    if base is None and result is None:
        return None
    if base is None or result is None:
        return False
    flat_a, flat_b = tf.nest.flatten(base), tf.nest.flatten(result)
    if len(flat_a) != len(flat_b):
        return False
    moved = None
    for a, b in zip(flat_a, flat_b):
        if a is None and b is None:
            continue
        if a is None or b is None or a.shape != b.shape:
            return False
        if a.ndim == 0:
            continue
        a = a.reshape(a.shape[0], -1).astype(np.float64)
        b = b.reshape(b.shape[0], -1).astype(np.float64)
        if moved is None:
            moved = np.zeros([a.shape[0]], bool)
        elif moved.shape[0] != a.shape[0]:
            return False
        scale = max(float(np.max(np.abs(a), initial=0.0)), 1e-6)
        moved |= np.max(np.abs(a - b), axis=1, initial=0.0) > layer_trace.TOLERANCE * scale
    return moved


def _refuse(name, moved, codes, clip_group):
    """Raises when a row depends on several units, or a unit reaches several clipping units.

    Args:
        name: str. The train step, for the error.
        moved: list, per changed set, of `_moved_rows`' result.
        codes: bool `[sets, units]`: which privacy units each set changed.
        clip_group: int or None. Rows per clipping unit of what reached.
    """
    if any(m is False or m is None for m in moved):
        raise ValueError(
            f"{name} hands the private update a batch whose rows, or whether it reaches "
            "the update at all, depend on the values of other examples of the batch "
            "(their number or shape changed when some examples changed). Per-example "
            "clipping cannot bound that. Transform each example by itself. "
            f"Received: train_step={name}")
    signature = np.stack(moved)  # [sets, rows]: the sets that moved each row.
    # A row depends on unit u alone when it moved only with sets holding u.
    alone = ~np.any(signature.T[:, None, :] & ~codes.T[None, :, :], axis=2)  # [rows, units]
    moving = np.any(signature, axis=0)
    if np.any(moving & ~np.any(alone, axis=1)):
        raise ValueError(
            f"{name} mixes examples before the private update: what it hands to the "
            "update (x, y or sample_weight) for one example changes when other examples "
            "of the batch change (e.g. MixUp or CutMix across the batch, or the batch "
            "normalised by its own statistics). Per-example clipping then bounds no "
            "example's contribution, so training would not be differentially private. "
            "Augment each example by itself: inside the model with per-example random "
            "layers, or in `train_step` row by row (docs/KERAS.md, \"Augmentation\"). "
            f"Received: train_step={name}")
    # The unit whose every set moved the row: the example it carries.
    exact = np.all(signature.T[:, None, :] == codes.T[None, :, :], axis=2) & moving[:, None]
    clip_units = np.arange(signature.shape[1]) // max(int(clip_group or 1), 1)
    for unit in range(codes.shape[1]):
        if len(set(clip_units[exact[:, unit]])) > 1:
            raise ValueError(
                f"{name} hands one example to the private update in more than one "
                "clipping unit (e.g. the batch concatenated with an augmented copy of "
                "itself): each copy is clipped to C, so one example could move the "
                "update by more than C, and training would not be differentially "
                "private. Hand each example over once (several augmentations of one "
                "example: docs/KERAS.md, \"Augmentation\"). "
                f"Received: train_step={name}")
