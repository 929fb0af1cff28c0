"""Augmentation multiplicity (De et al. 2022): K augmentations per example.

Each example's gradient is averaged over K random augmentations *before*
clipping, so the sensitivity is still C while the clipped signal is less
noisy. The augmentation runs on the device, on the already-preprocessed
physical batch, from a stateless seed (reproducible on resume).
"""

import tensorflow as tf


def flip_and_translate(images, seed, max_shift=4):
    """Random horizontal flip and a random translation of up to `max_shift` px.

    Args:
        images: tensor [N, H, W, C].
        seed: tensor [2]. Stateless seed.
        max_shift: int. Zero-padded shift per axis. Defaults to 4 (the CIFAR
            pad-4 crop).
    """
    n = tf.shape(images)[0]
    h, w = images.shape[1], images.shape[2]
    flip_seed, shift_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    flip = tf.random.stateless_uniform([n], flip_seed) < 0.5
    images = tf.where(flip[:, None, None, None], tf.reverse(images, [2]), images)
    if not max_shift:
        return images
    pad = [[0, 0], [max_shift, max_shift], [max_shift, max_shift], [0, 0]]
    padded = tf.pad(images, pad)
    offsets = tf.random.stateless_uniform(
        [n, 2], shift_seed, minval=0, maxval=2 * max_shift + 1, dtype=tf.int32
    )
    rows = offsets[:, :1] + tf.range(h)[None]
    cols = offsets[:, 1:] + tf.range(w)[None]
    cropped = tf.gather(padded, rows, axis=1, batch_dims=1)
    return tf.gather(cropped, cols, axis=2, batch_dims=1)


def repeat_and_augment(x, y, weights, k, seed, augment_fn=flip_and_translate):
    """Rows i·K … i·K+K-1 become K augmentations of example i."""
    x_rows = augment_fn(tf.repeat(x, k, axis=0), seed)
    return x_rows, tf.repeat(y, k, axis=0), tf.repeat(weights, k, axis=0)
