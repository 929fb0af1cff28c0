"""Stateless seeds for the samplers, derived from the secret sampling key."""

# Salts keep the random streams of the Poisson mask, the permutation and the
# augmentations independent of each other.
SALT_POISSON = 0x5EED0001
SALT_SHUFFLE = 0x5EED0002
SALT_AUGMENT = 0x5EED0003
# The banded sampler's split of the examples into groups, and the groups' labels.
SALT_BAND_GROUPS = 0x5EED0005
SALT_BAND_LABELS = 0x5EED0006


def fold(base_key, salt, *data):
    """A stateless seed `[2]` int64 derived from `base_key` `[2]`, a salt and `data`."""
    import tensorflow as tf

    key = tf.random.experimental.stateless_fold_in(
        tf.cast(base_key, tf.int64), tf.constant(salt, tf.int64)
    )
    for d in data:
        key = tf.random.experimental.stateless_fold_in(key, tf.cast(d, tf.int64))
    return key
