"""What `DPModel.fit` checks and prepares of its inputs before fixing its route.

Arrays: their targets (`TargetRule`: labels in range, finite targets of the
output's shape), user ids and validation split (by user under user-level
privacy), and their exact copies (`tfdp.data.duplicates`). Streams: one
finite pass per epoch, its batch size, no more than N examples in a pass,
and each batch's targets checked in the train step (`TargetRule.in_graph`).
"""

import warnings

import keras
import numpy as np
import tensorflow as tf
from keras.src.trainers.data_adapters import array_slicing

from tfdp import privacy
from tfdp import validation
from tfdp.data import duplicates
from tfdp.dp import release_checks
from tfdp.dp import user_groups
from tfdp.keras import privacy_account


def is_array(x):
    """Whether `fit` got arrays (a numpy array or a tensor with a batch axis)."""
    return isinstance(x, np.ndarray) or bool(tf.is_tensor(x) and x.shape.rank)


def prepare_arrays(x, y, sample_weight, *, user_ids, by_user, class_weight,
                   validation_split, validation_data, duplicates_policy="refuse"):
    """The training arrays of `fit`, checked, with the validation split made.

    Args:
        x, y, sample_weight: `fit`'s arrays.
        user_ids: array `[n]` or None. Each example's user.
        by_user: bool. Under `privacy_unit="user"`.
        class_weight: must be None (use `sample_weight`).
        validation_split: float. Held out from the end: the last examples,
            or under users the last users with all their rows
            (`tfdp.dp.user_groups.split_last_users`).
        validation_data: `fit`'s, or None.
        duplicates_policy: str. `fit`'s `duplicates`: "refuse" (the
            default) or "keep" (`tfdp.data.duplicates`).

    Returns:
        `(x, y, sample_weight, ids, dataset_size, validation_data, kept)`:
        `ids` the compact user of each kept row (None for examples), N in
        privacy units, and `kept` the `tfdp.data.duplicates.KeptCopies` of
        the rows under `duplicates="keep"` (None without copies).

    Raises:
        ValueError: for `class_weight`, missing targets, bad user ids, or
            exact copies of a row (`tfdp.data.duplicates.check_rows`).
    """
    if class_weight is not None:
        raise ValueError(
            "A private model's fit on arrays takes `sample_weight`, not "
            f"`class_weight`. Received: class_weight={class_weight!r}"
        )
    if y is None:
        raise ValueError("A private model's fit on arrays needs targets. Received: y=None")
    ids = None
    if by_user and user_ids is not None:
        ids, _ = user_groups.compact_user_ids(user_ids, len(x))
    if validation_split and validation_data is None:
        if ids is None:
            (x, y, sample_weight), validation_data = array_slicing.train_validation_split(
                (x, y, sample_weight), validation_split=validation_split)
        else:
            # By user, so that no user is on both sides.
            kept, held = user_groups.split_last_users(ids, validation_split)
            validation_data = take_rows((x, y, sample_weight), held)
            x, y, sample_weight = take_rows((x, y, sample_weight), kept)
            ids = ids[kept]
    dataset_size = len(x)
    if ids is not None:
        ids, dataset_size = user_groups.compact_user_ids(ids)
    # One example twice would be a group of two; refused before any step.
    kept = duplicates.check_rows(x, where="fit's x", user_ids=ids, sample_weight=sample_weight,
                                 policy=duplicates_policy)
    return x, y, sample_weight, ids, dataset_size, validation_data, kept


def check_stream_route(x, *, replicas_synchronise, replicas, jit_compile):
    """Refuses a stream where tfdp cannot train on one (see `DPModel.fit`)."""
    if replicas_synchronise:
        raise ValueError(
            "Under a tf.distribute strategy a private model's fit takes arrays "
            "(numpy arrays or tensors), which tfdp batches and splits over the "
            "replicas itself; give `fit(x, y, batch_size=...)` arrays instead of "
            f"a stream. Received: x of type {type(x).__name__} with {replicas} replicas"
        )
    if jit_compile:
        # Each batch's rows are hashed on the host before its release
        # (`PrivacyAccount.count_copies`), which XLA cannot compile.
        raise ValueError(
            "A private model's fit on a stream compares each batch's rows with the "
            "pass's earlier rows on the host, which XLA cannot compile: compile with "
            "jit_compile=False (the default), or give arrays. Received: jit_compile=True "
            f"and x of type {type(x).__name__}"
        )


def check_stream_pass(dataset, dataset_size):
    """Refuses a `tf.data.Dataset` whose pass holds more than N examples (eager).

    Counts one pass (rows of the first input tensor; rows of weight 0 are
    not examples) before any update, so that a stream that repeats its
    examples (`.repeat(2).shuffle(...).batch(...)`) is refused before its
    first update. Where the cardinality and a static batch size already
    bound the pass by N, nothing is read; else this runs the input pipeline
    once, without the model. The train step counts every epoch again
    (`PrivacyAccount.check_pass`), for streams whose passes differ.

    Args:
        dataset: `tf.data.Dataset`. Batches `x`, `(x, y)` or `(x, y, w)`.
        dataset_size: int. N.

    Raises:
        ValueError: when one pass holds more than N examples.
    """
    cardinality = int(dataset.cardinality())
    dims = [s.shape[0] for s in tf.nest.flatten(dataset.element_spec)
            if isinstance(s, tf.TensorSpec) and s.shape.rank]
    if cardinality >= 0 and dims and dims[0] is not None and cardinality * dims[0] <= dataset_size:
        return

    def add(total, element):
        x, _, w = keras.utils.unpack_x_y_sample_weight(element)
        if w is not None:
            return total + tf.math.count_nonzero(tf.reshape(w, [-1]), dtype=tf.int64)
        return total + tf.shape(tf.nest.flatten(x)[0], out_type=tf.int64)[0]

    count = int(dataset.reduce(tf.constant(0, tf.int64), add))
    if count > dataset_size:
        raise ValueError(privacy_account.too_many_examples_error(
            count, dataset_size, "Nothing was trained."))


def stream_batch_size(x, batch_size):
    """The physical batch size of a streamed input, or None if unknown.

    A `tf.data.Dataset`'s static batch dimension, else its first batch's
    (the iterator is re-created by `fit`); `batch_size` for other inputs.
    """
    if not isinstance(x, tf.data.Dataset):
        return batch_size
    if x.cardinality() == tf.data.INFINITE_CARDINALITY:
        # Keras' epochs would then not be passes: a logical step could span
        # two and hold an example twice, and the passes would be miscounted.
        raise ValueError(
            "A private model's fit needs one pass over the data per epoch: give "
            "a finite dataset (no `.repeat()`), or arrays. Received: a dataset "
            "of infinite cardinality"
        )
    dims = [s.shape[0] for s in tf.nest.flatten(x.element_spec)
            if isinstance(s, tf.TensorSpec) and s.shape.rank]
    if dims and dims[0] is not None:
        return int(dims[0])
    for element in x.take(1):
        return int(tf.shape(tf.nest.flatten(element)[0])[0])
    return None


def take_rows(arrays, rows):
    """The rows `rows` of each array (numpy or tensor) of `arrays`; None stays None."""
    return tuple(None if a is None else tf.gather(a, rows) if tf.is_tensor(a)
                 else np.take(np.asarray(a), rows, axis=0) for a in arrays)


class TargetRule:
    """What `fit` asks of the targets, from the compiled loss and the model's output.

    - A sparse loss (its name holds "sparse", e.g.
      `SparseCategoricalCrossentropy`): class indices in [0, the output's
      width) (`tfdp.validation.validate_labels`).
    - Keras' other built-in losses: finite targets with the output's row
      shape (`tfdp.validation.validate_targets`; `[n]` matches an output
      row of `(1,)`).
    - Any other loss: finite targets, shape not checked (a custom loss may
      take targets of its own shape).

    Args:
        sparse: bool. Targets are class indices.
        output_shape: tuple or None. One example's output (no batch axis);
            None where the model cannot tell it without data.
        builtin: bool. The loss is one of Keras' own.
    """

    def __init__(self, sparse, output_shape, builtin):
        self.sparse = bool(sparse)
        self.output_shape = None if output_shape is None else tuple(output_shape)
        self.builtin = bool(builtin)

    @classmethod
    def of(cls, model, loss_fn, x):
        """The rule for `model` (the inner model) compiled with `loss_fn`, given inputs `x`.

        Args:
            model: `keras.Model`. The model `fit` trains.
            loss_fn: the per-example loss (`tfdp.keras.per_example_loss_fn`),
                named after the compiled loss.
            x: array, tensor or None. A batch of inputs (for its shape and
                dtype only, where the model is not built).
        """
        name = str(getattr(loss_fn, "__name__", "") or "")
        try:
            keras.losses.get(name)
            builtin = True
        except (ValueError, TypeError):
            builtin = False
        return cls("sparse" in name.lower(), _output_shape(model, x), builtin)

    @property
    def num_classes(self):
        """The output's width, for a sparse loss; None where unknown."""
        if not self.sparse or not self.output_shape or self.output_shape[-1] is None:
            return None
        return int(self.output_shape[-1])

    def check(self, y, name="y"):
        """Refuses bad targets of arrays before any step (eager; messages without values).

        Raises:
            ValueError: from `tfdp.validation.validate_labels` or
                `validate_targets`.
        """
        if self.sparse:
            if self.num_classes is not None:
                validation.validate_labels(y, self.num_classes, name=name)
            return
        row_shape = self.output_shape if self.builtin else None
        if row_shape is not None and None in row_shape:
            row_shape = None
        validation.validate_targets(y, row_shape, name=name)

    def in_graph(self, y):
        """`y`, depending on the traced twin of `check` (a stream's batch).

        The assertion's message is a constant (`tfdp.dp.release_checks`):
        it carries no value of the batch.
        """
        if self.sparse:
            if self.num_classes is None:
                return y
            return release_checks.checked_labels(y, self.num_classes)
        return release_checks.checked_targets(y)


def _output_shape(model, x):
    """One example's output shape (no batch axis), or None where it is unknown."""
    outputs = getattr(model, "outputs", None) if model.built else None
    try:
        if outputs and len(outputs) == 1:
            return tuple(outputs[0].shape[1:])
        if x is None:
            return None
        shape = tuple(x.shape[1:])
        dtype = getattr(x, "dtype", "float32")
        spec = model.compute_output_spec(keras.KerasTensor((None,) + shape, dtype=str(
            keras.backend.standardize_dtype(dtype))))
        if isinstance(spec, keras.KerasTensor):
            return tuple(spec.shape[1:])
    except Exception:  # noqa: BLE001 — a model that cannot say: not checked.
        return None
    return None


def warn_kept_copies(optimizer, kept, where, steps=None):
    """Warns, under `fit(duplicates="keep")`, of the copies kept and their group's ε.

    Args:
        optimizer: `tfdp.DPOptimizer`. Its route is set.
        kept: `tfdp.data.duplicates.KeptCopies` or None (nothing to say).
        where: str. What held the copies.
        steps: int or None. The planned steps (arrays, before training);
            None: the steps accounted so far (a stream, after training).
    """
    if kept is None:
        return
    ledger = optimizer.ledger(steps=steps)
    claim = privacy.copies_claim(ledger, kept.largest_group, ledger.steps)
    when = "planned" if steps is not None else "so far"
    warnings.warn(f"{kept.describe(where)} {when.capitalize()}: "
                  f"{privacy.describe_copies_claim(claim)}.", UserWarning, stacklevel=3)
