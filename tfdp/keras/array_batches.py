"""The physical batches `DPModel.fit` trains on when it is given arrays.

The logical steps are numbered globally from the optimizer's step count when
the dataset is iterated (at an epoch's start; so a later epoch, a later `fit`
call or a resumed run draws new steps, and global seeds such as
`keras.utils.set_random_seed` play no part). Step `s` is the sampler's
`step_indices(sampling_key, s)`: for Poisson, each example independently
with probability q, padded with weight-0 examples to whole physical batches;
for Poisson sampling of users, each drawn user's block of
`max_examples_per_user` rows (their chosen examples, weight k / c, then
weight-0 padding); for shuffle, the B examples at positions
`[(s mod S)·B, (s mod S + 1)·B)` of pass `s // S`'s secret permutation, or of
the arrays' own order with `ordered=True`. Either way a step lies inside one
pass and holds no example twice. The sampler cuts each step into physical
batches (`Sampler.index_batches`, as for the trainer's pipeline); the last
carries `last=True`, on which the optimizer releases the step.

Under a multi-worker strategy each worker builds its share of every step:
the sampler's host split (`Sampler.with_hosts`: unit i of a step goes to
host i mod W, every host padded to the same number of physical batches of
P / W), so that all workers end each logical step together.
"""

import tensorflow as tf


def step_batches(x, y, sample_weight, sampler, sampling_key, *, ordered, first_step,
                 steps_per_epoch, input_context=None):
    """One epoch of `(x, y, weights, last)` physical batches.

    Args:
        x: array or tensor `[N, ...]`. The inputs.
        y: array or tensor `[N, ...]`. The targets.
        sample_weight: array `[N]` or None. Scales each example's loss.
        sampler: `tfdp.samplers.Sampler`. Draws each step; its physical
            batch size is the batch size.
        sampling_key: int64 `[2]`. The secret sampling sub-key.
        ordered: bool. Shuffle sampler only: the arrays' order instead of a
            secret permutation per pass.
        first_step: int64 variable. The epoch's first global step, read each
            time the dataset is iterated (set at the epoch's start).
        steps_per_epoch: int or None. Logical steps per iteration of the
            dataset; None: without end (`fit` then counts the logical steps
            of each epoch).
        input_context: `tf.distribute.InputContext` or None. This worker's
            pipeline of several (its share of each physical batch, P / W
            rows). Defaults to `None`: all of each batch.

    Returns:
        A `tf.data.Dataset` of `(x, y, weights, last)`: weights float32 `[P]`
        (0 for padding), `last` a bool scalar.
    """
    x = tf.convert_to_tensor(x)
    y = tf.convert_to_tensor(y)
    weights_of = None if sample_weight is None else tf.constant(sample_weight, tf.float32)
    host, hosts = 0, 1
    if input_context is not None and input_context.num_input_pipelines > 1:
        host, hosts = input_context.input_pipeline_id, input_context.num_input_pipelines
        sampler = sampler.with_hosts(hosts, sampler.physical_batch_size // hosts)

    def epoch_steps(_):
        start = first_step.read_value()
        if steps_per_epoch is None:
            return tf.data.Dataset.range(start, tf.int64.max)
        return tf.data.Dataset.range(start, start + steps_per_epoch)

    def gather(batch):
        # Padding (-1) reads example 0 with weight 0: it contributes nothing.
        # Every batch is P rows here (no granule): keep the static batch size.
        size = [sampler.physical_batch_size]
        safe = tf.ensure_shape(tf.maximum(batch["indices"], 0), size)
        weights = tf.ensure_shape(batch["weights"], size)
        if weights_of is not None:
            weights = weights * tf.gather(weights_of, safe)
        return tf.gather(x, safe), tf.gather(y, safe), weights, batch["last"]

    # The first step is read when the dataset is iterated, not when it is built.
    steps = tf.data.Dataset.range(1).flat_map(epoch_steps)
    ds = sampler.index_batches(sampling_key, steps, host, ordered=ordered)
    ds = ds.map(gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)
