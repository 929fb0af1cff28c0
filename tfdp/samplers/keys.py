"""Stateless seeds for the samplers, derived from the secret sampling key."""

# Salts keep the random streams of the Poisson mask, the permutation and the
# augmentations independent of each other.
SALT_POISSON = 0x5EED0001
SALT_SHUFFLE = 0x5EED0002
SALT_AUGMENT = 0x5EED0003
# The banded samplers' groups of the privacy units.
SALT_BAND_GROUPS = 0x5EED0005


def fold(base_key, salt, *data):
    """A stateless seed `[2]` int64 derived from `base_key` `[2]`, a salt and `data`."""
    import tensorflow as tf

    key = tf.random.experimental.stateless_fold_in(
        tf.cast(base_key, tf.int64), tf.constant(salt, tf.int64)
    )
    for d in data:
        key = tf.random.experimental.stateless_fold_in(key, tf.cast(d, tf.int64))
    return key
