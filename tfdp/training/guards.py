"""Stops that keep a run from releasing a broken step, with one-line reasons.

Also what a run releases outside ε before its first step: the model's
adapted state (`check_adapted_state`), listed, not refused.
"""

import time

import numpy as np
import tensorflow as tf

from tfdp import dp
from tfdp.dp import adapted_state
from tfdp.dp import release_checks
from tfdp.dp import sensitivity
from tfdp.training import evaluation
from tfdp.training import reporting


def kept_checkpoint(ckpt):
    """Where the last good state is, for the NaN/Inf stop messages."""
    if ckpt.latest:
        return f"The last good checkpoint is kept: {ckpt.latest}"
    return f"No checkpoint was written yet (none in {ckpt.directory}); a rerun starts over"


def check_parameters_are_finite(variables, step, ckpt):
    """Stops when a parameter is NaN/Inf, before it is checkpointed or evaluated.

    The engine's check (`tfdp.dp.release_checks.check_parameters_are_finite`,
    which Keras `fit` runs too), naming the run's last good checkpoint.

    Args:
        variables: list of `tf.Variable`. The model's trainable variables.
        step: int. The step just applied.
        ckpt: `RunCheckpoint`. Named in the message.

    Raises:
        FloatingPointError: when a parameter is NaN/Inf.
    """
    release_checks.check_parameters_are_finite(variables, step, kept_checkpoint(ckpt))


def out_of_memory_as_error(logical_steps, physical_batch_size, logical_batch_size):
    """Re-raises an accelerator OOM during the steps as one line naming the fix."""
    try:
        yield from logical_steps
    except tf.errors.ResourceExhaustedError:
        raise MemoryError(
            f"Out of accelerator memory at physical batch {physical_batch_size}. Lower "
            "RunConfig.physical_batch_size: virtual steps keep the logical batch "
            f"({logical_batch_size}) and so the privacy guarantee unchanged."
        ) from None


def check_adapted_state(model):
    """Logs the state `model` holds before training that ε does not cover; its records.

    Adapted preprocessing statistics and loaded buffers (a frozen
    BatchNorm's moving statistics) not declared public
    (`tfdp.dp.adapted_state`): the released model holds them exactly.
    Listed, not refused: they may have come from public data.

    Args:
        model: keras.Model.

    Returns:
        list of dict: `summary.json`'s `not_covered_by_epsilon.adapted_state`
        (empty when there is none).
    """
    found = adapted_state.find_adapted_state(model)
    if found:
        for line in adapted_state.describe_adapted_state(found).splitlines():
            reporting.log(line)
    return adapted_state.as_records(found)


def preprocessed_range(preprocess, image_shape):
    """The public range of the model's training inputs: the preprocessing's output for
    a black and a white image.

    Computed from the preprocessing alone, never from the data: a uint8
    image of zeros and one of 255s of `image_shape` go through
    `preprocess`, and the least and greatest output of each channel bound
    the range (e.g. a mean/std normalisation's). The default preprocessing
    scales to [0, 1], which the probe always draws from.

    Args:
        preprocess: `fn(image, seed)` or `fn(image)`, or None (the default).
        image_shape: tuple. `[H, W, C]` of the images.

    Returns:
        `(low, high)`, one value per channel each, or None (the default, or
        a preprocessing that does not take a decoded image).
    """
    if preprocess is None:
        return None
    outputs = []
    for value in (0, 255):
        image = tf.fill(tuple(image_shape), tf.constant(value, tf.uint8))
        try:
            try:
                out = preprocess(image, tf.zeros([2], tf.int64))
            except TypeError:  # A deterministic `fn(image)`.
                out = preprocess(image)
        except (TypeError, ValueError, tf.errors.OpError):
            return None
        out = np.asarray(out, np.float64)
        outputs.append(out.reshape(-1, out.shape[-1]))
    both = np.concatenate(outputs)
    return tuple(both.min(axis=0)), tuple(both.max(axis=0))


def check_sensitivity(model, info, examples, *, l2_norm_clip, method, weight_decay,
                      augmentation_multiplicity, input_range=None, clipping="standard",
                      clipping_gamma=0.01):
    """The training probe (`tfdp.dp.sensitivity.probe_training`), logged; its figure.

    On a batch of `examples` distinct random images (no training data), with
    the loss of training: refuses a layer or the loss when they mix
    examples, or when one example (one group of `augmentation_multiplicity`
    rows: a user under `privacy_unit="user"`) moves the clipped sum by more
    than C·(1 + 1e-4). The layers are probed on batches of the standard
    normal, the typical ranges of image data, and `input_range`.

    Args:
        model: keras.Model.
        info: `tfdp.data.DatasetInfo` (or anything with `image_shape` and
            `num_classes`).
        examples: int. Examples (groups) of the probe's batch: each
            replica's batch in training.
        l2_norm_clip: float. C, the mechanism's.
        method: str. The clipping method (`tfdp.dp.resolve_method`).
        weight_decay: float. In-loss L2.
        augmentation_multiplicity: int. Rows per group.
        input_range: `(low, high)` or None. The public range of the model's
            inputs (`preprocessed_range`). Defaults to None.
        clipping: str. The contract's rule, "standard" or "automatic".
        clipping_gamma: float. γ of "automatic".
    """
    start = time.time()
    k = int(augmentation_multiplicity)
    batch = sensitivity.synthetic_batch(
        model, examples, info.image_shape, "float32", num_classes=info.num_classes,
        augmentation_multiplicity=k)
    # Resolved after the probe, which probes the layers (with `input_range`)
    # first; the method's own probe then reuses that report.
    figure = sensitivity.probe_training(
        model, evaluation.per_example_loss, batch, l2_norm_clip, method,
        input_ranges=[input_range] if input_range is not None else None,
        weight_decay=weight_decay, augmentation_multiplicity=k, clipping=clipping,
        clipping_gamma=clipping_gamma)
    resolved = dp.resolve_method(model, method, batch[0])
    reporting.log(
        f"sensitivity probe: largest leave-one-out contribution {figure:.6f}·C "
        f"(method={resolved}, physical batch of {int(batch[0].shape[0]) // k}, "
        f"{sensitivity.LEAVE_OUT} left out; {time.time() - start:.1f}s)")
    return figure


def probe_settings(engine, *, method, weight_decay, augmentation_multiplicity, group_size):
    """`check_sensitivity`'s keyword arguments for a run; None without an engine.

    The engine's (`tfdp.engine.DPEngine.probe_settings`): the probe leaves
    one privacy unit out, the K augmentations of an example or the k rows of
    a user.
    """
    if engine is None:
        return None
    return engine.probe_settings(method=method, weight_decay=weight_decay,
                                 augmentation_multiplicity=augmentation_multiplicity,
                                 group_size=group_size)


def check_before_training(model, info, batching, settings, preprocess=None):
    """The checks of a private run before its first step; the adapted state's records.

    Logs the state the model holds that ε does not cover
    (`check_adapted_state`), and probes the sensitivity at the batch each
    replica trains on (`check_sensitivity`), also on the range of the
    training preprocessing's outputs (`preprocessed_range`).

    Args:
        model: keras.Model.
        info: `tfdp.data.DatasetInfo`.
        batching: `tfdp.training.run_contract.Batching`.
        settings: dict or None. `probe_settings`; None (a non-private run)
            checks nothing.
        preprocess: the training preprocessing `fn(image, seed)`, or None
            (the default). Defaults to None.

    Returns:
        `check_adapted_state`'s records, or None for a non-private run.
    """
    if settings is None:
        return None
    adapted = check_adapted_state(model)
    check_sensitivity(model, info, batching.replica_batch_size // batching.group_size,
                      input_range=preprocessed_range(preprocess, info.image_shape), **settings)
    return adapted
