"""Seeds of the training augmentations.

Which examples form each logical step is the sampler's business
(`tfdp.samplers`): its batches come from the run's secret sampling key. The
augmentations need no secrecy and come from the public `--seed`.
"""

import tensorflow as tf

from tfdp.samplers import keys


def augment_seeds(seed, step, host, count):
    """Per-element stateless seeds `[count, 2]` for the augmentations of a step.

    Args:
        seed: int. The run's public seed.
        step: int64 scalar tensor. The logical step.
        host: int. The input pipeline.
        count: int32 scalar. Elements of this host's share of the step.
    """
    key = keys.fold(tf.stack([tf.cast(seed, tf.int64), tf.constant(0, tf.int64)]),
                    keys.SALT_AUGMENT, step, host)
    return tf.random.stateless_uniform(
        [count, 2], seed=key, minval=None, maxval=None, dtype=tf.int64
    )
