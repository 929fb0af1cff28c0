"""Stops that keep a run from releasing a broken step, with one-line reasons."""

import tensorflow as tf


def kept_checkpoint(ckpt):
    """Where the last good state is, for the NaN/Inf stop messages."""
    if ckpt.latest:
        return f"The last good checkpoint is kept: {ckpt.latest}"
    return f"No checkpoint was written yet (none in {ckpt.directory}); a rerun starts over"


def check_parameters_are_finite(variables, step, ckpt):
    """Stops when a parameter is NaN/Inf, before it is checkpointed or evaluated.

    The stop looks at the parameters only. They are the noisy mechanism's
    output, so whether they are finite reveals nothing that epsilon does not
    cover. A stop on the training examples themselves (say, when every
    example of a step had a non-finite gradient) would be a release of
    private data without noise; there is none: the clipping drops each
    non-finite example (its contribution is zero, which keeps the
    sensitivity bound) and the step is applied with its noise, whatever
    the examples were.

    Args:
        variables: list of `tf.Variable`. The model's trainable variables.
        step: int. The step just applied.
        ckpt: `RunCheckpoint`. Named in the message.
    """
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in variables])
    if not bool(finite):
        raise FloatingPointError(
            f"The parameters are NaN/Inf after step {step}: stopping. "
            f"{kept_checkpoint(ckpt)}; lower the learning rate."
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
