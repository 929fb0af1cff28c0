"""Throughput of the ImageNet-style training input pipeline.

Run `python -m tfdp.data.benchmark` to measure images/s on ImageNet-shaped
mock JPEGs (375x500) decoded, random-resized-cropped to 224 and flipped.

`python -m tfdp.data.benchmark --compare_routes` writes the same JPEGs as a
folder of class subfolders and as a tfds array_record dataset, and measures
the Poisson training pipeline at 224 px on three routes over the same
images: the folder read by index (`folder:` data too large for memory),
the folder in memory, and tfds random access.
"""

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import tensorflow as tf

from tfdp import samplers
from tfdp.data import datasets
from tfdp.data import preprocessing
from tfdp.data import sources
from tfdp.data import train_pipeline


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


def mock_jpegs(num_images=256, height=375, width=500, seed=0, quality=90):
    """Encoded JPEGs shaped like ImageNet photos, as a list of bytes.

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
    return encoded


def mock_jpeg_source(num_images=256, height=375, width=500, seed=0, quality=90):
    """An `ArraySource` of `mock_jpegs` (same arguments), random labels of 1000 classes."""
    encoded = mock_jpegs(num_images, height, width, seed, quality)
    labels = np.random.default_rng(seed).integers(0, 1000, size=num_images)
    info = sources.DatasetInfo(name="mock_imagenet", num_classes=1000, image_shape=(None, None, 3))
    return sources.ArraySource(np.array(encoded, dtype=object), labels, info)


def write_jpeg_folder(directory, num_images=256, num_classes=8, seed=0):
    """Writes `mock_jpegs` as `directory/train/class_k/i.jpg`; returns `(paths, labels)`."""
    paths, labels = [], []
    for i, encoded in enumerate(mock_jpegs(num_images, seed=seed)):
        label = i % num_classes
        folder_path = os.path.join(directory, "train", f"class_{label}")
        os.makedirs(folder_path, exist_ok=True)
        paths.append(os.path.join(folder_path, f"{i:06d}.jpg"))
        labels.append(label)
        with open(paths[-1], "wb") as f:
            f.write(encoded)
    return paths, labels


def tfds_array_record_from_files(paths, labels, num_classes, data_dir):
    """The files as a prepared tfds dataset (array_record), bytes unchanged.

    Returns:
        A `RandomAccessSource` over its train split.
    """
    import tensorflow_datasets as tfds

    class BenchmarkImages(tfds.core.GeneratorBasedBuilder):
        """The benchmark's JPEG files as a tfds dataset."""

        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(encoding_format="jpeg"),
                "label": tfds.features.ClassLabel(num_classes=num_classes),
            }))

        def _split_generators(self, dl_manager):
            del dl_manager
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i, (path, label) in enumerate(zip(paths, labels)):
                yield i, {"image": path, "label": label}

    builder = BenchmarkImages(data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare()
    info = sources.DatasetInfo("benchmark_images", num_classes, (None, None, 3))
    data_source = builder.as_data_source(
        split="train", decoders={"image": tfds.decode.SkipDecoding()}
    )
    return sources.RandomAccessSource(data_source, info)


def compare_routes(num_images=256, batch_size=64, num_batches=8, rounds=3, directory=None):
    """Images/s of the Poisson pipeline at 224 px on the same JPEGs, per route.

    Routes: `folder (file index)`, `folder (in memory)` and `tfds
    (array_record)`. They are measured in turns, `rounds` times, and the
    median is reported, so that a change of machine load hits every route.

    Args:
        num_images: int. JPEGs written. Defaults to `256`.
        batch_size: int. Logical and physical batch. Defaults to `64`.
        num_batches: int. Timed batches per measurement. Defaults to `8`.
        rounds: int. Measurements per route. Defaults to `3`.
        directory: str, optional. Where the files go. Defaults to `None`
            (a temporary directory, removed afterwards).

    Returns:
        `{route: images per second}`.
    """
    if directory is None:
        with tempfile.TemporaryDirectory(prefix="tfdp_benchmark_") as scratch:
            return compare_routes(num_images, batch_size, num_batches, rounds, scratch)
    paths, labels = write_jpeg_folder(directory, num_images)
    routes = {}
    for name, max_bytes in (("folder (file index)", 0), ("folder (in memory)", 2**40)):
        routes[name] = datasets.load_dataset(
            # "crop" keeps in-memory images encoded, so every route decodes JPEGs.
            f"folder:{directory}", image_size=224, preprocessing="crop", test_fraction=0.1,
            in_memory_max_bytes=max_bytes,
        ).train
    routes["tfds (array_record)"] = tfds_array_record_from_files(
        paths, labels, max(labels) + 1, os.path.join(directory, "tfds")
    )
    rates = {name: [] for name in routes}
    for _ in range(rounds):
        for name, source in routes.items():
            ds = train_pipeline.make_train_pipeline(
                source, sampler="poisson", physical_batch_size=batch_size,
                logical_batch_size=batch_size, num_steps=10**6, seed=0,
                preprocess_fn=preprocessing.imagenet_train_preprocess(),
            )
            rates[name].append(benchmark_pipeline(ds, num_batches))
    return {name: statistics.median(values) for name, values in rates.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--num_batches", type=int, default=20)
    parser.add_argument("--num_images", type=int, default=256)
    parser.add_argument("--sampler", default="shuffle", choices=samplers.names())
    parser.add_argument("--compare_routes", action="store_true",
                        help="Folder (file index, in memory) vs tfds array_record, Poisson.")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.compare_routes:
        rates = compare_routes(args.num_images, args.batch_size, args.num_batches, args.rounds)
        for name, rate in rates.items():
            print(f"{name:22s} poisson, batch {args.batch_size}, 375x500 JPEG -> 224: "
                  f"{rate:.1f} images/s")
        return rates

    source = mock_jpeg_source(args.num_images)
    ds = train_pipeline.make_train_pipeline(
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
