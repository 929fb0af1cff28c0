"""Dataset names that are not quite right get an error that says what was meant."""

import os
import re

import numpy as np
import tensorflow as tf

from tests.data import image_files
from tfdp import data
from tfdp.data import sources


class DatasetNameTest(tf.test.TestCase):

    def test_a_path_without_its_prefix_gets_did_you_mean(self):
        root = self.create_tempdir().full_path
        image_files.write_folder(root, {"a": 2, "b": 2})
        npz = os.path.join(root, "arrays.npz")
        np.savez(npz, x=np.zeros((4, 2, 2), "uint8"), y=np.arange(4) % 2)
        for given, meant in ((root, f"folder:{root}"), (npz, f"npz:{npz}"),
                             ("/data/shards/train-*", "tfrecord:/data/shards/train-*")):
            with self.assertRaisesRegex(ValueError, re.escape(f"did you mean {meant!r}")):
                data.load_dataset(given)

    def test_npz_saved_as_x_and_y(self):
        path = os.path.join(self.create_tempdir().full_path, "xy.npz")
        np.savez(path, x=np.arange(30 * 16, dtype="uint16").reshape(30, 4, 4) % 251,
                 y=np.arange(30) % 3)
        loaded = data.load_dataset(f"npz:{path}")
        self.assertEqual(len(loaded.train) + len(loaded.test), 30)
        self.assertIn("arrays x/y", loaded.notes)

    def test_unknown_name_lists_known_names_and_prefixes(self):
        for name in ("imagenet 2012", "no_such_dataset_xyz"):
            with self.assertRaisesRegex(ValueError, r"expected one of \[.*'cifar10'.*\].*'npz:"):
                data.load_dataset(name)

    def test_preparation_status_of_an_unprepared_tfds_dataset(self):
        prepared, message = sources.tfds_preparation_status(
            "cifar10", data_dir=self.create_tempdir().full_path)
        self.assertFalse(prepared)
        self.assertIn("tfds build cifar10", message)
