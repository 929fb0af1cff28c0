"""Which test sets are held out of the training data, `test_dataset`, and exact duplicates.

A test or validation set held out of the examples given as training data is
private data evaluated without noise: `DatasetSplits` says so, for the
trainer to label. A separate test set holds nothing out. Exact duplicate
files are dropped, within the training data and from the held-out splits;
`npz:` and `tfrecord:` training data with exact duplicates is refused.
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
        # same bytes under another label, which is the same example too.
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
                self.assertEqual(splits.duplicates_dropped, {"train": 3, "test": 1})
                # 8 + 2 copies + 1 relabelled in "a", 8 in "b": the copies go;
                # of the relabelled pair the first (in "a") is kept.
                self.assertEqual(splits.class_counts(), [9, 7])
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


class RefusedCopiesTest(tf.test.TestCase):
    """Arrays and records are taken as given: copies are refused, with their count."""

    def _npz(self, **arrays):
        path = os.path.join(self.create_tempdir().full_path, "arrays.npz")
        np.savez(path, **arrays)
        return path

    def _images(self, n):
        images = np.zeros((n, 4, 4), np.uint8)
        images[:, 0, 0] = np.arange(n)  # Distinct rows.
        return images

    def test_npz_with_copies_is_refused(self):
        images = self._images(12)
        images[9:] = images[:3]  # Three copies; two of them under another label.
        labels = np.arange(12) % 2
        with self.assertRaisesRegex(ValueError, r"npz:.*3 rows are exact duplicates.*"
                                    r"Deduplicate the data.*Received: 3 duplicate rows among 12"):
            data.load_dataset(f"npz:{self._npz(x_train=images, y_train=labels)}")
        distinct = self._npz(x_train=self._images(12), y_train=labels)
        splits = data.load_dataset(f"npz:{distinct}")
        self.assertLen(splits.train, 12 - len(splits.test))

    def test_copies_of_one_user_are_that_users_data(self):
        images = self._images(12)
        images[10:] = images[:2]
        users = np.arange(12) // 2  # Rows 10, 11 (user 5) copy rows 0, 1 (user 0).
        path = self._npz(x_train=images, y_train=np.arange(12) % 2, user_ids=users)
        for unit in ("example", "user"):
            with self.assertRaisesRegex(ValueError, "2 rows are exact duplicates"):
                data.load_dataset(f"npz:{path}", privacy_unit=unit)
        users[10:] = 0  # The copies held by the user of the originals.
        path = self._npz(x_train=images, y_train=np.arange(12) % 2, user_ids=users)
        with self.assertRaisesRegex(ValueError, "2 rows are exact duplicates"):
            data.load_dataset(f"npz:{path}")
        splits = data.load_dataset(f"npz:{path}", privacy_unit="user")
        self.assertLen(splits.train, 12 - len(splits.test))

    def test_tfrecord_with_copies_is_refused(self):
        directory = self.create_tempdir().full_path
        prefix = os.path.join(directory, "train")
        image_files.write_tfrecords(prefix, np.arange(8) % 2, num_shards=1)
        records = list(tf.data.TFRecordDataset(f"{prefix}-00000-of-00001"))
        with tf.io.TFRecordWriter(os.path.join(directory, "train-copy")) as writer:
            writer.write(records[3].numpy())
        for in_memory_max_bytes in (2**30, 0):  # In memory, and converted to ArrayRecord.
            with self.subTest(in_memory_max_bytes=in_memory_max_bytes):
                with self.assertRaisesRegex(ValueError, r"tfrecord:.*1 rows are exact "
                                            r"duplicates.*Received: 1 duplicate rows among 9"):
                    data.load_dataset(f"tfrecord:{prefix}*",
                                      in_memory_max_bytes=in_memory_max_bytes)

    def test_the_digest_counts_copies_by_user(self):
        rows = np.array([[1, 2], [3, 4], [1, 2], [1, 2]], np.float32)
        duplicates.check_rows(rows[:2], where="x")
        with self.assertRaisesRegex(ValueError, "2 rows are exact duplicates"):
            duplicates.check_rows(rows, where="x")
        duplicates.check_rows(rows, where="x", user_ids=[0, 1, 0, 0])
        with self.assertRaisesRegex(ValueError, "1 rows are exact duplicates"):
            duplicates.check_rows(rows, where="x", user_ids=[0, 1, 0, 2])
        duplicates.check_rows(rows, where="x", sample_weight=[1, 1, 0, 0])


class KeptCopiesTest(tf.test.TestCase):
    """`duplicates="keep"`: distinct records that share their content are trained on,
    counted, and reported with their largest group."""

    def test_the_counter_finds_the_largest_group(self):
        rows = np.array([[1], [2], [1], [1], [2], [3]], np.float32)
        kept = duplicates.check_rows(rows, where="x", policy="keep")
        self.assertEqual((kept.copies, kept.rows, kept.largest_group), (3, 6, 3))
        self.assertIsNone(duplicates.check_rows(rows[[0, 1, 5]], where="x", policy="keep"))
        # By user: a user's own copies are not copies; a group counts users.
        kept = duplicates.check_rows(rows, where="x", policy="keep",
                                     user_ids=[0, 1, 0, 2, 1, 3])
        self.assertEqual((kept.copies, kept.largest_group), (1, 2))
        self.assertFalse(kept.to_dict()["covered_by_epsilon"])
        with self.assertRaisesRegex(ValueError, "duplicates must be one of.*Received: "
                                    "duplicates='drop'"):
            duplicates.check_rows(rows, where="x", policy="drop")

    def test_npz_and_folder_copies_are_kept_and_counted(self):
        images = RefusedCopiesTest._images(None, 12)
        images[9:] = images[:3]
        path = os.path.join(self.create_tempdir().full_path, "arrays.npz")
        np.savez(path, x_train=images, y_train=np.arange(12) % 2)
        splits = data.load_dataset(f"npz:{path}", duplicates="keep", test_fraction=0.25)
        self.assertEqual((splits.duplicates_kept.copies, splits.duplicates_kept.largest_group),
                         (3, 2))
        self.assertLen(splits.train, 9)  # Nothing dropped: 12 less the test quarter.
        # A folder's copied files are kept too: 3 copies of one image, and
        # one image under both labels.
        root = DuplicatesTest._folder_with_copies(self)
        splits = data.load_dataset(f"folder:{root}", duplicates="keep")
        self.assertEqual(splits.duplicates_dropped, {})
        self.assertEqual((splits.duplicates_kept.copies, splits.duplicates_kept.largest_group),
                         (3, 3))
        self.assertEqual(splits.class_counts(), [11, 8])
        with self.assertRaisesRegex(ValueError, "duplicates must be one of"):
            data.load_dataset(f"npz:{path}", duplicates="yes")


if __name__ == "__main__":
    tf.test.main()
