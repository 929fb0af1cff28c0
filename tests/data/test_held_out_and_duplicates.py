"""Which test sets are held out of the training data, `test_dataset`, and exact duplicates.

A test or validation set held out of the examples given as training data is
private data evaluated without noise: `DatasetSplits` says so, for the
trainer to label. A separate test set holds nothing out. Exact duplicate
files are dropped, within the training data and from the held-out splits.
"""

import os
import shutil

import numpy as np
import tensorflow as tf

from tests.data import image_files
from tfdp import data
from tfdp.data import duplicates


class HeldOutTest(tf.test.TestCase):

    def test_which_splits_are_held_out_of_the_training_data(self):
        root = self.create_tempdir().full_path
        image_files.write_folder(root, {"a": 10, "b": 10})
        carved = data.load_dataset(f"folder:{root}", test_fraction=0.2, validation_fraction=0.25)
        self.assertTrue(carved.test_held_out)
        self.assertTrue(carved.validation_held_out)
        self.assertEqual((len(carved.train), len(carved.test), len(carved.validation)),
                         (12, 4, 4))
        # The catalog's datasets have a fixed public test split.
        offline = data.load_dataset("digits")
        self.assertFalse(offline.test_held_out)
        self.assertFalse(offline.validation_held_out)

    def test_a_separate_test_set_holds_nothing_out(self):
        root = self.create_tempdir().full_path
        next_id = image_files.write_folder(root, {"a": 10, "b": 10})
        test_dir = self.create_tempdir().full_path
        image_files.write_folder(test_dir, {"a": 3, "b": 2}, start_id=next_id)
        splits = data.load_dataset(f"folder:{root}", test_dataset=f"folder:{test_dir}")
        self.assertFalse(splits.test_held_out)
        self.assertEqual((len(splits.train), len(splits.test)), (20, 5))
        self.assertEqual(splits.class_counts("test"), [3, 2])
        self.assertIn("test: test_dataset", splits.notes)

        npz = os.path.join(self.create_tempdir().full_path, "test.npz")
        rng = np.random.default_rng(0)
        np.savez(npz, images=rng.integers(0, 256, (6, 4, 4), dtype=np.uint8),
                 labels=np.arange(6) % 2)
        train_npz = os.path.join(self.create_tempdir().full_path, "train.npz")
        np.savez(train_npz, x_train=rng.integers(0, 256, (10, 4, 4), dtype=np.uint8),
                 y_train=np.arange(10) % 2)
        splits = data.load_dataset(f"npz:{train_npz}", test_dataset=f"npz:{npz}")
        self.assertFalse(splits.test_held_out)
        self.assertEqual((len(splits.train), len(splits.test)), (10, 6))

    def test_test_dataset_errors(self):
        root = self.create_tempdir().full_path
        image_files.write_folder(os.path.join(root, "train"), {"a": 3, "b": 3})
        image_files.write_folder(os.path.join(root, "test"), {"a": 1, "b": 1}, start_id=9)
        with self.assertRaisesRegex(ValueError, "has a test split of its own"):
            data.load_dataset(f"folder:{root}", test_dataset=f"folder:{root}/test")
        with self.assertRaisesRegex(ValueError, "use their own test split"):
            data.load_dataset("digits", test_dataset=f"folder:{root}/test")
        with self.assertRaisesRegex(ValueError, "takes the forms"):
            data.load_dataset(f"folder:{root}/train", test_dataset="cifar10")
        with self.assertRaisesRegex(ValueError, "Image folder not found"):
            data.load_dataset(f"folder:{root}/train", test_dataset="folder:/nonexistent")


class DuplicatesTest(tf.test.TestCase):

    def _folder_with_copies(self):
        root = self.create_tempdir().full_path
        next_id = image_files.write_folder(os.path.join(root, "train"), {"a": 8, "b": 8})
        image_files.write_folder(os.path.join(root, "test"), {"a": 3, "b": 3}, start_id=next_id)
        train_a = os.path.join(root, "train", "a")
        first = sorted(os.listdir(train_a))[0]
        # Two more copies of one training image, one in the test set; and the
        # same bytes under another label, which is another example.
        shutil.copy(os.path.join(train_a, first), os.path.join(train_a, "zz_copy1.png"))
        shutil.copy(os.path.join(train_a, first), os.path.join(train_a, "zz_copy2.png"))
        shutil.copy(os.path.join(train_a, first), os.path.join(root, "test", "b", "zz_copy.png"))
        other = sorted(os.listdir(os.path.join(root, "train", "b")))[0]
        shutil.copy(os.path.join(root, "train", "b", other),
                    os.path.join(train_a, "zz_relabelled.png"))
        return root

    def test_exact_duplicates_are_counted_and_dropped(self):
        root = self._folder_with_copies()
        for in_memory_max_bytes, kind in ((2**30, data.ArraySource), (0, data.FileSource)):
            with self.subTest(kind.__name__):
                splits = data.load_dataset(f"folder:{root}",
                                           in_memory_max_bytes=in_memory_max_bytes)
                self.assertIs(type(splits.train), kind)
                self.assertEqual(splits.duplicates_dropped, {"train": 2, "test": 1})
                # 8 + 2 copies + 1 relabelled in "a", 8 in "b": the copies go.
                self.assertEqual(splits.class_counts(), [9, 8])
                self.assertEqual(splits.class_counts("test"), [3, 3])

    def test_only_sizes_shared_by_examples_are_hashed(self):
        source = data.ArraySource(
            np.array([b"aaa", b"bbbb", b"aaa", b"cc"], dtype=object), np.array([0, 0, 0, 1]))
        test = data.ArraySource(np.array([b"cc", b"ddddd"], dtype=object), np.array([1, 0]))
        train, held_out, dropped = duplicates.drop_duplicates(
            source, {"test": test, "validation": None})
        self.assertEqual(dropped, {"train": 1, "test": 1})
        self.assertEqual(train.images.tolist(), [b"aaa", b"bbbb", b"cc"])
        self.assertEqual(held_out["test"].images.tolist(), [b"ddddd"])
        self.assertIsNone(held_out["validation"])
        with self.assertRaisesRegex(ValueError, "Every test example is also a training example"):
            duplicates.drop_duplicates(source, {"test": data.ArraySource(
                np.array([b"cc"], dtype=object), np.array([0]))})


if __name__ == "__main__":
    tf.test.main()
