"""`ArraySource`: examples held in memory as numpy arrays, read by `tf.gather`.

The source of `npz:` data, of folders and TFRecords small enough for memory
(encoded bytes, or decoded once by `decode_in_memory`), of the offline
datasets and of the small tfds datasets. It follows `tfdp.data.data_source.DataSource`.
"""

import logging

import numpy as np
import tensorflow as tf

from tfdp import validation
from tfdp.data import data_source
from tfdp.data import decode_guard
from tfdp.data import preprocessing


class ArraySource:
    """An in-memory source of numpy images and integer labels.

    Random access happens inside the tf.data graph with `tf.gather` on a
    constant tensor, so the arrays should fit in memory well below the 2 GB
    GraphDef limit (MNIST, CIFAR, ...).

    Args:
        images: np.ndarray. `[N, H, W, C]` images, any numeric dtype (uint8
            images are scaled to [0, 1] by the default preprocessing), or a
            `[N]` object/bytes array of encoded JPEG/PNG images.
        labels: np.ndarray. `[N]` integer labels.
        info: `DatasetInfo`, optional. Metadata. Defaults to `None`.
        user_ids: np.ndarray, optional. `[N]` integers or names (numbered
            0 … N_u − 1 in their sorted order; checked by
            `tfdp.validation.validate_user_ids`): the user who contributed
            each example, for user-level privacy
            (`PrivacyConfig.privacy_unit = 'user'`) and splits by user. Defaults to
            `None` (no users).
    """

    random_access = True

    def __init__(self, images, labels, info=None, user_ids=None):
        images = np.asarray(images)
        labels = np.asarray(labels)
        if images.shape[0] != labels.shape[0]:
            raise ValueError(
                "`images` and `labels` must have the same length. Received: "
                f"images.shape={images.shape}, labels.shape={labels.shape}"
            )
        if user_ids is not None:
            # The rule of every route (Keras `fit(user_ids=...)` too).
            user_ids = validation.validate_user_ids(user_ids, labels.shape[0])
            if user_ids.dtype.kind != "i":  # Names: numbered in their sorted order.
                user_ids = np.unique(user_ids, return_inverse=True)[1].astype(np.int64)
        self.user_ids = user_ids
        if images.shape[0] == 0:
            raise ValueError(
                f"A source needs at least one example. Received: images.shape={images.shape}"
            )
        self.images = images
        self.labels = labels.astype(np.int32)
        self.info = info
        self._images_t = None
        self._labels_t = None

    def __len__(self):
        return int(self.labels.shape[0])

    @property
    def size(self):
        return len(self)

    @property
    def encoded(self):
        return self.images.ndim == 1

    # Traced as written (no autograph): tf.data would convert these for
    # every pipeline, at 20-50 ms each.
    @tf.autograph.experimental.do_not_convert
    def _tensors(self):
        # Created lazily and once, so all pipelines built from this source
        # share one copy of the data.
        if self._images_t is None:
            images = self.images
            if self.encoded:
                images = images.astype(object)
            # init_scope makes eager tensors even when first called while a
            # tf.data function is being traced.
            with tf.init_scope():
                self._images_t = tf.constant(images)
                self._labels_t = tf.constant(self.labels)
        return self._images_t, self._labels_t

    def subset(self, indices):
        """The examples `indices`, as a new source of the same class."""
        subset = type(self)(self.images[indices], self.labels[indices], self.info)
        if self.user_ids is not None:
            subset.user_ids = self.user_ids[indices]
        return subset

    @tf.autograph.experimental.do_not_convert
    def fetch(self, index):
        """Returns `(image, label)` of example `index` (scalar int64 tensor)."""
        images, labels = self._tensors()
        return tf.gather(images, index), tf.gather(labels, index)

    @tf.autograph.experimental.do_not_convert
    def fetch_batch(self, indices):
        """Returns `(images, labels)` of examples `indices` (int64 `[n]` tensor)."""
        return self.fetch(indices)

    def as_dataset(self, *, shuffle=False, seed=0, input_context=None):
        """Returns a dataset of `(image, label)` in index order."""
        del shuffle, seed  # Index order; the samplers do their own shuffling.
        return data_source.indexed_dataset(self, input_context)

    def record_sizes(self):
        """Bytes of each example: an encoded image's length, or a row's bytes."""
        if self.encoded:
            return np.array([len(image) for image in self.images], np.int64)
        return np.full(len(self), self.images[0].nbytes, np.int64)

    def record(self, index):
        """The input bytes of example `index`: its encoded image, or its row's raw bytes."""
        image = self.images[index]
        return bytes(image) if self.encoded else np.ascontiguousarray(image).tobytes()

    def records(self):
        """Every example's input bytes, in index order."""
        return data_source.random_access_records(self)


def decode_in_memory(encoded, info, decode_fn=None):
    """Decodes `[N]` encoded images to `[N, H, W, C]` uint8.

    When some image fails to decode, returns the encoded array unchanged:
    the pipelines then decode per example and skip (weight 0) and count the
    undecodable ones, which keeps the loader from aborting on one bad file.

    Args:
        encoded: np.ndarray. `[N]` encoded images.
        info: `DatasetInfo`. `image_shape` is the decoded shape.
        decode_fn: callable, optional. `fn(encoded) -> uint8 [H, W, C]`,
            e.g. a decode and resize. Defaults to `None` (plain decode).
    """
    shape = tuple(info.image_shape)
    if not shape or any(d is None for d in shape):
        return encoded  # Variable sizes: decoded per example by the pipelines.
    channels = shape[-1]

    def decode(image, seed):
        del seed
        image = decode_fn(image) if decode_fn else preprocessing.decode(image, channels)
        return tf.ensure_shape(image, shape)

    ds = tf.data.Dataset.from_tensor_slices(encoded.astype(object))
    ds = ds.map(
        lambda image: (image, 0, 1.0, False, tf.zeros([2], tf.int64)),
    )
    ds = decode_guard.guarded_map(
        ds,
        decode,
        lambda: decode_guard.find_substitute(
            tf.data.Dataset.from_tensor_slices(
                (encoded.astype(object), np.zeros(len(encoded), np.int32))
            ),
            decode,
        ),
    )
    decoded, ok = [], []
    for images, _, weights, _, _ in ds.batch(4096).as_numpy_iterator():
        decoded.append(images)
        ok.append(weights > 0)
    ok = np.concatenate(ok)
    if not ok.all():
        logging.getLogger(__name__).warning(
            "%d of %d images of %s do not decode; keeping the split encoded so the "
            "pipelines skip (weight 0) and count them.", int((~ok).sum()), len(ok), info.name
        )
        return encoded
    return np.concatenate(decoded)
