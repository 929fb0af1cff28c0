"""Stops that keep a run from releasing a broken step, with one-line reasons."""

import tensorflow as tf


def kept_checkpoint(ckpt):
    """Where the last good state is, for the NaN/Inf stop messages."""
    if ckpt.latest:
        return f"The last good checkpoint is kept: {ckpt.latest}"
    return f"No checkpoint was written yet (none in {ckpt.directory}); a rerun starts over"


def check_step_is_finite(step_fn, step, ckpt, counted_before):
    """Stops when every example of a logical step had a non-finite gradient.

    Single non-finite examples are dropped by the clipping (their
    contribution is zeroed, which keeps the sensitivity bound) and counted.
    `counted_before` holds the (examples, nonfinite) counters as they were
    before this step; returns them as they are now.
    """
    counts = (float(step_fn.stats["examples"].numpy()), float(step_fn.stats["nonfinite"].numpy()))
    examples, nonfinite = counts[0] - counted_before[0], counts[1] - counted_before[1]
    if examples > 0 and nonfinite >= examples:
        raise FloatingPointError(
            f"Every example of step {step + 1} had a NaN/Inf loss or gradient: stopping "
            f"before applying it. {kept_checkpoint(ckpt)}; "
            "lower the learning rate or check the input data."
        )
    return counts


def check_loss_is_finite(loss, step, ckpt, which):
    """Stops when an evaluation loss is NaN/Inf."""
    import math

    if not math.isfinite(loss):
        raise FloatingPointError(
            f"The {which} loss is {loss} at step {step}: stopping. {kept_checkpoint(ckpt)}; "
            "lower the learning rate or check the input data."
        )


def out_of_memory_as_error(logical_steps, physical_batch_size, logical_batch_size):
    """Re-raises an accelerator OOM during the steps as one line naming the fix."""
    try:
        yield from logical_steps
    except tf.errors.ResourceExhaustedError:
        raise MemoryError(
            f"Out of accelerator memory at physical batch {physical_batch_size}. Lower "
            "train.physical_batch_size: virtual steps keep the logical batch "
            f"({logical_batch_size}) and so the privacy guarantee unchanged."
        ) from None
