"""Writes real image files (JPEG, PNG, gray, RGBA, mixed sizes) for the data tests.

Every image encodes its example id: its top-left pixel holds `id % 256`
(PNGs are lossless; JPEGs are flat gray, which JPEG keeps exactly), so a
test can tell which examples a pipeline produced.
"""

import os

import numpy as np
import tensorflow as tf

# (height, width, channels, format) cycled over the examples.
MIXED = ((12, 16, 3, "png"), (20, 14, 1, "png"), (16, 16, 4, "png"), (18, 22, 3, "jpg"))
CORRUPT = b"\xff\xd8\xff\xe0 this is not a complete jpeg"


def encode(example_id, height, width, channels, fmt, rng):
    """Encoded bytes of one image whose pixel (0, 0) is `example_id % 256`."""
    image = rng.integers(0, 256, size=(height, width, channels)).astype(np.uint8)
    image[0, 0, :] = example_id % 256
    if channels == 4:
        image[..., 3] = 255
    if fmt == "jpg":
        # A flat gray JPEG decodes exactly, so the id survives the lossy format.
        image[...] = example_id % 256
        return tf.io.encode_jpeg(image, quality=95).numpy()
    return tf.io.encode_png(image).numpy()


def write_folder(directory, counts, start_id=0, shapes=MIXED, corrupt=0, seed=0):
    """Writes `directory/<class>/<id>.<fmt>` files.

    Args:
        directory: str. Created if needed.
        counts: dict. Class name -> number of images.
        start_id: int. First example id. Defaults to `0`.
        shapes: tuple. `(height, width, channels, format)` cycled over the
            images. Defaults to `MIXED`.
        corrupt: int. Extra undecodable `.jpg` files in the first class.
            Defaults to `0`.
        seed: int. Seed of the pixels. Defaults to `0`.

    Returns:
        The next unused example id.
    """
    rng = np.random.default_rng(seed + start_id)
    example_id = start_id
    for name, count in counts.items():
        os.makedirs(os.path.join(directory, name), exist_ok=True)
        for _ in range(count):
            height, width, channels, fmt = shapes[example_id % len(shapes)]
            path = os.path.join(directory, name, f"{example_id:06d}.{fmt}")
            with open(path, "wb") as f:
                f.write(encode(example_id, height, width, channels, fmt, rng))
            example_id += 1
    first = next(iter(counts))
    for k in range(corrupt):
        with open(os.path.join(directory, first, f"corrupt_{k}.jpg"), "wb") as f:
            f.write(CORRUPT + b" %d" % k)  # Distinct: exact duplicates are dropped.
    return example_id


def write_tfrecords(pattern_prefix, labels, num_shards=2, shape=(12, 12, 3), corrupt=(),
                    image_key="image", label_key="label", user_ids=None, user_key="user"):
    """Writes `<prefix>-0000k-of-0000n` TFRecord shards of PNG examples.

    Example i has label `labels[i]` and id i (in pixel (0, 0)); examples in
    `corrupt` hold undecodable bytes. With `user_ids`, each example also has
    the int64 feature `user_key`.
    """
    rng = np.random.default_rng(len(labels))
    writers = [
        tf.io.TFRecordWriter(f"{pattern_prefix}-{k:05d}-of-{num_shards:05d}")
        for k in range(num_shards)
    ]
    for i, label in enumerate(labels):
        image = CORRUPT if i in corrupt else encode(i, *shape, "png", rng)
        feature = {
            image_key: tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
            label_key: tf.train.Feature(int64_list=tf.train.Int64List(value=[int(label)])),
        }
        if user_ids is not None:
            feature[user_key] = tf.train.Feature(
                int64_list=tf.train.Int64List(value=[int(user_ids[i])]))
        example = tf.train.Example(features=tf.train.Features(feature=feature))
        writers[i % num_shards].write(example.SerializeToString())
    for writer in writers:
        writer.close()
