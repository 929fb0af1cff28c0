"""Throughput of the ImageNet-style training input pipeline.

Run `python -m tfdp.data.benchmark` to measure images/s on ImageNet-shaped
mock JPEGs (375x500) decoded, random-resized-cropped to 224 and flipped.
"""

import argparse
import time

import numpy as np
import tensorflow as tf

from tfdp import samplers
from tfdp.data import pipeline
from tfdp.data import preprocessing
from tfdp.data import sources


def benchmark_pipeline(dataset, num_batches, warmup_batches=2):
    """Measures the throughput of a dataset of batches.

    Args:
        dataset: `tf.data.Dataset`. Elements are tuples whose first entry is
            a batch of images.
        num_batches: int. Batches to time after the warm-up.
        warmup_batches: int. Batches consumed before timing starts (pipeline
            start-up, autotuning). Defaults to `2`.

    Returns:
        Images per second, a float.
    """
    if num_batches < 1:
        raise ValueError(f"`num_batches` must be positive. Received: num_batches={num_batches}")
    iterator = iter(dataset)
    for _ in range(warmup_batches):
        next(iterator)
    images = 0
    start = time.perf_counter()
    for _ in range(num_batches):
        batch = next(iterator)
        images += int(batch[0].shape[0])
    return images / (time.perf_counter() - start)


def mock_jpeg_source(num_images=256, height=375, width=500, seed=0, quality=90):
    """An `ArraySource` of encoded JPEGs shaped like ImageNet photos.

    Images are smooth random fields plus mild noise, so their JPEG size and
    decode cost resemble photographs rather than white noise.

    Args:
        num_images: int. Distinct images. Defaults to `256`.
        height: int. Image height. Defaults to `375`.
        width: int. Image width. Defaults to `500`.
        seed: int. Seed of the pixels. Defaults to `0`.
        quality: int. JPEG quality. Defaults to `90`.
    """
    rng = np.random.default_rng(seed)
    encoded = []
    for _ in range(num_images):
        coarse = rng.uniform(0, 255, size=(1, height // 8, width // 8, 3)).astype(np.float32)
        image = tf.image.resize(coarse, [height, width], method="bicubic")[0]
        image += rng.normal(0, 6, size=(height, width, 3)).astype(np.float32)
        image = tf.cast(tf.clip_by_value(image, 0, 255), tf.uint8)
        encoded.append(tf.io.encode_jpeg(image, quality=quality).numpy())
    labels = rng.integers(0, 1000, size=num_images)
    info = sources.DatasetInfo(name="mock_imagenet", num_classes=1000, image_shape=(None, None, 3))
    return sources.ArraySource(np.array(encoded, dtype=object), labels, info)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--num_batches", type=int, default=20)
    parser.add_argument("--num_images", type=int, default=256)
    parser.add_argument("--sampler", default="shuffle", choices=samplers.names())
    args = parser.parse_args(argv)

    source = mock_jpeg_source(args.num_images)
    ds = pipeline.make_train_pipeline(
        source,
        sampler=args.sampler,
        physical_batch_size=args.batch_size,
        logical_batch_size=args.batch_size,
        num_steps=10**6,
        seed=0,
        preprocess_fn=preprocessing.imagenet_train_preprocess(),
    )
    rate = benchmark_pipeline(ds, args.num_batches)
    print(
        f"ImageNet-style train pipeline ({args.sampler}, batch {args.batch_size}, "
        f"375x500 JPEG -> 224): {rate:.1f} images/s"
    )
    return rate


if __name__ == "__main__":
    main()
