"""Gaussian noise for the summed clipped gradients, from stateless seeds.

The seed of logical step s is (run_seed, s): reproducible from the run's seed,
different every step, and identical on every replica that asks for it, so that
noise added after the cross-replica sum is drawn exactly once.
"""

import tensorflow as tf


def step_seed(run_seed, step):
    """The stateless seed [2] (int64) of one logical step."""
    return tf.stack([tf.cast(run_seed, tf.int64), tf.cast(step, tf.int64)])


def gaussian_noise(grads, stddev, seed):
    """Independent N(0, stddev²) noise shaped like each tensor in `grads`."""
    seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), len(grads))
    return [
        tf.random.stateless_normal(tf.shape(g), seeds[i], stddev=tf.cast(stddev, g.dtype), dtype=g.dtype)
        for i, g in enumerate(grads)
    ]


def add_noise(grads, *, l2_norm_clip, noise_multiplier, seed):
    """grads + N(0, (σ·C)²) per coordinate.

    Args:
        grads: list of tensors. Summed clipped gradients of one logical step.
        l2_norm_clip: float. The clipping bound C.
        noise_multiplier: float. σ; the noise std is σ·C.
        seed: tensor [2]. The step's stateless seed (see `step_seed`).
    """
    if isinstance(noise_multiplier, (int, float)) and noise_multiplier == 0:
        return list(grads)
    stddev = tf.cast(noise_multiplier, tf.float32) * tf.cast(l2_norm_clip, tf.float32)
    noise = gaussian_noise(grads, stddev, seed)
    return [g + n for g, n in zip(grads, noise)]
