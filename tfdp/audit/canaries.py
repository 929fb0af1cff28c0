"""Canaries for the one-run audit: out-of-distribution images, random labels.

Each canary is an image of i.i.d. uniform pixels in [0, 1] with its own
uniformly random label. Such an image is far from the data, so nothing but
its own gradient teaches the model its label: without noise the model
memorises it and its loss drops; with enough noise it stays near chance.

Every canary is included in the training set independently with probability
1/2 (`draw_inclusion`). The included ones are appended to the training data
and are sampled by the Poisson sampler exactly like every other example.
"""

import numpy as np

# Salts keep the canary streams independent of each other and of the run seed.
_SALT_IMAGES = 0xCA7A01
_SALT_INCLUSION = 0xCA7A02


def make_canaries(num_canaries, image_shape, num_classes, seed=0):
    """Returns `(images, labels)`: float32 `[m, *image_shape]`, int32 `[m]`."""
    if int(num_canaries) != num_canaries or num_canaries < 1:
        raise ValueError(
            f"`num_canaries` must be a positive integer. Received: {num_canaries!r}"
        )
    rng = np.random.default_rng([_SALT_IMAGES, int(seed)])
    images = rng.uniform(0.0, 1.0, size=(int(num_canaries), *image_shape)).astype(np.float32)
    labels = rng.integers(0, num_classes, size=int(num_canaries)).astype(np.int32)
    return images, labels


def draw_inclusion(num_canaries, seed=0):
    """Bool `[m]`: canary j is in the training set, independently w.p. 1/2."""
    rng = np.random.default_rng([_SALT_INCLUSION, int(seed)])
    return rng.random(int(num_canaries)) < 0.5
