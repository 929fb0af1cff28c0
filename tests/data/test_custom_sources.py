"""Your own images: `folder:`, `tfrecord:` and `npz:` through `tfdp.data.load_dataset`.

The images are real files (JPEG and PNG, gray, RGB and RGBA, mixed sizes,
corrupt ones) whose pixel (0, 0) holds the example id, so the tests can see
which examples the Poisson pipeline produced.
"""

import os

import numpy as np
import tensorflow as tf

from tests.data import image_files
from tfdp import data
from tfdp.data import preprocessing
from tfdp.data import tfrecord


def _ids(dataset):
    """The example ids (pixel (0, 0), uint8) of the real examples of a pipeline."""
    ids = []
    for batch in dataset:
        images, weights = batch[0].numpy(), batch[2].numpy()
        ids.extend(np.round(images[weights > 0][:, 0, 0, 0] * 255).astype(int).tolist())
    return ids


def _poisson_ids(splits, steps=40, seed=0):
    """Ids of every example of `steps` Poisson steps at q = 1/2, and the skip count."""
    n = len(splits.train)
    ds = data.make_train_pipeline(
        splits.train, sampler="poisson", physical_batch_size=8, logical_batch_size=n // 2,
        num_steps=steps, seed=seed, preprocess_fn=splits.eval_preprocess,
    )
    return _ids(ds), ds.decode_stats.value()


def _exact(image_size):
    # Nearest-neighbour resizing keeps pixel (0, 0) (the id) exact.
    def preprocess(image):
        image = preprocessing.decode(image, 3)
        image = tf.image.resize(image, [image_size, image_size], method="nearest")
        image = tf.cast(image, tf.float32) / 255.0
        image.set_shape([image_size, image_size, 3])
        return image

    return preprocess


class FolderTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.root = self.create_tempdir().full_path
        self.next_id = image_files.write_folder(
            os.path.join(self.root, "train"), {"cat": 30, "dog": 25, "emu": 20}, corrupt=1
        )
        image_files.write_folder(
            os.path.join(self.root, "test"), {"cat": 4, "dog": 4, "emu": 4}, start_id=self.next_id
        )

    def test_counts_per_class_layout_and_mixed_images(self):
        for in_memory_max_bytes, kind in ((2**30, data.ArraySource), (0, data.FileSource)):
            splits = data.load_dataset(
                f"folder:{self.root}", image_size=10, in_memory_max_bytes=in_memory_max_bytes
            )
            self.assertIs(type(splits.train), kind)
            self.assertEqual(splits.info.num_classes, 3)
            self.assertEqual(splits.info.image_shape, (10, 10, 3))
            # The corrupt file (of "cat") is dropped when the folder is loaded.
            self.assertEqual(splits.class_counts(), [30, 25, 20])
            self.assertEqual(splits.class_counts("test"), [4, 4, 4])
            self.assertEqual(splits.undecodable_dropped, {"train": 1, "test": 0})
            self.assertIsNone(splits.validation)
            # Gray, RGBA, RGB JPEG and PNG of four sizes all come out 10x10x3.
            ds = data.make_eval_pipeline(splits.train, 16, preprocess_fn=splits.eval_preprocess)
            shapes = {tuple(batch[0].shape[1:]) for batch in ds}
            self.assertEqual(shapes, {(10, 10, 3)})
            self.assertEqual(ds.decode_stats.value(), 0)

    def test_poisson_batches_index_every_example_and_never_meet_the_corrupt_one(self):
        for in_memory_max_bytes in (2**30, 0):
            # Random crops keep the images encoded: `_exact` then reads each id.
            splits = data.load_dataset(
                f"folder:{self.root}", in_memory_max_bytes=in_memory_max_bytes,
                image_size=12, preprocessing="crop",
            )
            self.assertTrue(splits.train.encoded)
            splits.eval_preprocess = _exact(12)
            ids, skipped = _poisson_ids(splits)
            # 40 steps at q = 1/2 miss a given example with probability 2^-40.
            self.assertEqual(set(ids), set(range(75)))
            self.assertEqual(skipped, 0)

    def test_without_test_folder_a_stratified_split(self):
        root = self.create_tempdir().full_path
        image_files.write_folder(root, {"a": 20, "b": 10})  # Class folders, no train/.
        splits = data.load_dataset(f"folder:{root}", test_fraction=0.2, seed=1)
        self.assertEqual(splits.class_counts(), [16, 8])
        self.assertEqual(splits.class_counts("test"), [4, 2])
        self.assertEqual(splits.info.image_shape, (12, 16, 3))  # The first image's.
        # Small and all decodable: decoded and resized into memory once.
        self.assertEqual(splits.train.images.shape, (24, 12, 16, 3))
        self.assertEqual(splits.train.images.dtype, np.uint8)
        first = splits.train.images[0]
        self.assertEqual(first[0, 0, 0], 0)  # Example 0 (its id), PNG pixels kept exactly.

    def test_validation_folder_is_the_test_set_without_test_folder(self):
        root = self.create_tempdir().full_path
        image_files.write_folder(os.path.join(root, "train"), {"a": 6, "b": 6})
        image_files.write_folder(os.path.join(root, "validation"), {"a": 2, "b": 3}, start_id=50)
        splits = data.load_dataset(f"folder:{root}", image_size=8)
        self.assertEqual(len(splits.test), 5)
        self.assertIsNone(splits.validation)
        self.assertIn("validation/ is the test set", splits.notes)

    def test_errors(self):
        root = self.create_tempdir().full_path
        image_files.write_folder(os.path.join(root, "train"), {"a": 3, "b": 3})
        os.makedirs(os.path.join(root, "train", "empty"))
        with self.assertRaisesRegex(ValueError, r"Class folder .*empty' has no image files"):
            data.load_dataset(f"folder:{root}")
        single = self.create_tempdir().full_path
        image_files.write_folder(os.path.join(single, "train"), {"only": 3})
        with self.assertRaisesRegex(ValueError, "at least two classes.*'only'"):
            data.load_dataset(f"folder:{single}")
        extra = self.create_tempdir().full_path
        image_files.write_folder(os.path.join(extra, "train"), {"a": 3, "b": 3})
        image_files.write_folder(os.path.join(extra, "test"), {"a": 1, "c": 1}, start_id=9)
        with self.assertRaisesRegex(ValueError, r"does not have. Received: \['c'\]"):
            data.load_dataset(f"folder:{extra}")
        with self.assertRaisesRegex(ValueError, "Image folder not found"):
            data.load_dataset("folder:/nonexistent/images")
        with self.assertRaisesRegex(ValueError, "preprocessing"):
            data.load_dataset(f"folder:{self.root}", preprocessing="zoom")
        with self.assertRaisesRegex(ValueError, "square RGB"):
            data.load_dataset(f"folder:{self.root}", preprocessing="crop", channels=1,
                              image_size=8)


class TFRecordTest(tf.test.TestCase):

    def _write(self, labels, corrupt=()):
        directory = self.create_tempdir().full_path
        image_files.write_tfrecords(os.path.join(directory, "train"), labels, corrupt=corrupt)
        return directory

    def test_in_memory_and_converted_agree_and_cover_every_example(self):
        labels = np.arange(60) % 3
        directory = self._write(labels, corrupt=(7,))
        pattern = f"tfrecord:{directory}/train-*"
        small = data.load_dataset(pattern)
        self.assertIsInstance(small.train, data.ArraySource)
        large = data.load_dataset(pattern, in_memory_max_bytes=0)
        self.assertIsInstance(large.train, data.ArrayRecordSource)
        self.assertTrue(os.path.isdir(os.path.join(directory, ".tfdp_cache")))
        for splits in (small, large):
            self.assertEqual(splits.info.num_classes, 3)
            # Example 7 (label 1) does not decode and is dropped; no test files:
            # a stratified 0.2 of the other 59 is the test set.
            self.assertEqual(splits.undecodable_dropped, {"train": 1})
            self.assertEqual(
                np.add(splits.class_counts(), splits.class_counts("test")).tolist(),
                [20, 19, 20])
            self.assertEqual(len(splits.test), 12)
        self.assertAllEqual(small.train.labels, large.train.labels)
        for splits in (small, large):
            splits.eval_preprocess = _exact(12)
            ids, skipped = _poisson_ids(splits)
            test_ids = set(
                int(i) for i in _ids(data.make_eval_pipeline(splits.test, 4, _exact(12))))
            self.assertNotIn(7, test_ids)
            self.assertEqual(set(ids), set(range(60)) - test_ids - {7})
            self.assertEqual(skipped, 0)

    def test_test_files_beside_train_files_and_cache_reuse(self):
        directory = self._write(np.arange(20) % 2)
        image_files.write_tfrecords(os.path.join(directory, "test"), np.arange(6) % 2)
        cache = self.create_tempdir().full_path
        first = data.load_dataset(f"tfrecord:{directory}/train-*", in_memory_max_bytes=0,
                                  cache_dir=cache)
        self.assertEqual((len(first.train), len(first.test)), (20, 6))
        self.assertIn("test: test files", first.notes)
        again = data.load_dataset(f"tfrecord:{directory}/train-*", in_memory_max_bytes=0,
                                  cache_dir=cache)
        self.assertEqual(again.train.conversion_stats["records_read"], 0)
        self.assertTrue(again.train.conversion_stats["cached"])

    def test_errors(self):
        directory = self._write([0, 1, 5, 1])
        with self.assertRaises(ValueError) as raised:
            data.load_dataset(f"tfrecord:{directory}/train-*", num_classes=3)
        # The engine's label rule: counted, never shown (labels are private).
        self.assertRegex(str(raised.exception), r"load_dataset.num_classes.*`train labels` must "
                         r"be class indices.*num_classes=3\): 1 of 4 rows are not \(0 below 0, "
                         r"1 at or above 3")
        self.assertNotIn("5", str(raised.exception).splitlines()[0])  # Gin adds a line.
        with self.assertRaisesRegex(ValueError, r"bytes feature 'img'.*Received: features of"):
            data.load_dataset(f"tfrecord:{directory}/train-*", image_key="img")
        with self.assertRaisesRegex(ValueError, "No TFRecord files match"):
            data.load_dataset(f"tfrecord:{directory}/nothing-*")
        single = self._write([2, 2, 2])
        with self.assertRaises(ValueError) as raised:
            data.load_dataset(f"tfrecord:{single}/train-*")
        self.assertRegex(str(raised.exception),
                         "at least two classes.*Received: 3 training labels, all of 1 class")
        self.assertNotIn("2", str(raised.exception).splitlines()[0])

    def test_conversion_work_is_linear_in_the_examples(self):
        # A few thousand images: the conversion reads and writes each record
        # once, and Poisson sampling reads exactly the sampled records.
        work = {}
        for n in (300, 3000):
            directory = self._write(np.arange(n) % 10)
            files = tfrecord.match_files(f"{directory}/train-*")
            path, labels, _, stats = tfrecord.convert(
                files, os.path.join(directory, "cache"), image_key="image", label_key="label"
            )
            self.assertEqual(len(labels), n)
            source = data.ArrayRecordSource(path, labels, data.DatasetInfo("t", 10, (12, 12, 3)))
            ds = data.make_train_pipeline(
                source, sampler="poisson", physical_batch_size=64, logical_batch_size=n // 10,
                num_steps=5, seed=0,
            )
            sampled = sum(int(batch[2].numpy().sum()) for batch in ds)
            # Fetch reads sampled examples plus the example-0 stand-ins of padding
            # and up to one stand-in scan (_SUBSTITUTE_SCAN) for the skip logic.
            padding = sum(int((1 - batch[2].numpy()).sum()) for batch in ds)
            self.assertLessEqual(source.reads, 2 * (sampled + padding) + 64 + 64)
            self.assertGreaterEqual(source.reads, sampled)
            work[n] = (stats["records_read"], stats["records_written"], sampled)
        self.assertEqual(work[300][:2], (300, 300))
        self.assertEqual(work[3000][:2], (3000, 3000))
        # Ten times the data, ten times the work (sampled: ~10x at the same q).
        self.assertBetween(work[3000][2] / work[300][2], 7.0, 13.0)


class NpzTest(tf.test.TestCase):

    def _write(self, **arrays):
        path = os.path.join(self.create_tempdir().full_path, "arrays.npz")
        np.savez(path, **arrays)
        return path

    def test_train_and_test_arrays_and_poisson_coverage(self):
        n = 90
        images = np.zeros((n, 6, 6), np.uint8)
        images[:, 0, 0] = np.arange(n)  # The id, as in the image files.
        labels = np.arange(n) % 3
        path = self._write(x_train=images, y_train=labels, x_test=images[:9], y_test=labels[:9])
        splits = data.load_dataset(f"npz:{path}")
        self.assertEqual(splits.info.image_shape, (6, 6, 1))
        self.assertEqual(splits.class_counts(), [30, 30, 30])
        self.assertEqual(len(splits.test), 9)
        ds = data.make_train_pipeline(
            splits.train, sampler="poisson", physical_batch_size=8, logical_batch_size=45,
            num_steps=40, seed=0,
        )
        self.assertEqual(set(_ids(ds)), set(range(n)))
        self.assertEqual(ds.decode_stats.value(), 0)
        resized = data.load_dataset(f"npz:{path}", image_size=4, channels=1)
        self.assertEqual(resized.info.image_shape, (4, 4, 1))
        self.assertEqual(resized.eval_preprocess(tf.constant(images[0][..., None])).shape, (4, 4, 1))

    def test_images_and_labels_keys_and_errors(self):
        images = np.zeros((10, 4, 4, 3), np.float32)
        images[:, 0, 0, 0] = np.arange(10) / 10  # Distinct: copies are refused.
        path = self._write(images=images, labels=np.arange(10) % 2)
        splits = data.load_dataset(f"npz:{path}", test_fraction=0.2)
        self.assertEqual((len(splits.train), len(splits.test)), (8, 2))
        bad = self._write(x_train=np.zeros((4, 4, 4)), y_train=np.array([0, 1, -1, 1]))
        with self.assertRaisesRegex(ValueError, r"1 of 4 rows are not \(1 below 0, 0 at or "
                                                r"above 2.*Received: train labels with 1 bad rows"):
            data.load_dataset(f"npz:{bad}")
        with self.assertRaisesRegex(ValueError, r"x_train and y_train.*Received: keys \['a'\]"):
            data.load_dataset(f"npz:{self._write(a=np.zeros(3))}")
        test_out_of_range = self._write(
            x_train=np.zeros((4, 4, 4)), y_train=np.array([0, 1, 0, 1]),
            x_test=np.zeros((1, 4, 4)), y_test=np.array([2]))
        with self.assertRaisesRegex(ValueError, r"`test labels` must be class indices.*1 of 1 "
                                                r"rows are not \(0 below 0, 1 at or above 2"):
            data.load_dataset(f"npz:{test_out_of_range}")
        with self.assertRaisesRegex(ValueError, "Name the data after 'npz:'"):
            data.load_dataset("npz:")
