"""User ids per example: `npz:`, `folder:` (users.csv), `tfrecord:` (a feature) and
in-memory arrays, splits by user, user batches."""

import os

import numpy as np
import tensorflow as tf

from tests.data import image_files
from tfdp import data
from tfdp import samplers
from tfdp.data import folder
from tfdp.data import sources
from tfdp.data import splits
from tfdp.data import validation


def _arrays(n=60, users=12, seed=0):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 255, size=(n, 4, 4, 1)).astype("uint8")
    labels = np.arange(n) % 3
    user_ids = rng.integers(0, users, size=n) * 7 + 100  # Not compact ids.
    return images, labels, user_ids


class UserIdsTest(tf.test.TestCase):

    def _write(self, **arrays):
        path = os.path.join(self.create_tempdir().full_path, "arrays.npz")
        np.savez(path, **arrays)
        return path

    def test_npz_user_ids_and_test_split_by_user(self):
        images, labels, user_ids = _arrays()
        path = self._write(x_train=images, y_train=labels, user_ids=user_ids)
        loaded = data.load_dataset(f"npz:{path}", test_fraction=0.25, seed=3)
        train, test = loaded.train, loaded.test
        self.assertEqual(len(train) + len(test), len(labels))
        self.assertEmpty(set(train.user_ids) & set(test.user_ids))
        self.assertIn("of the users", loaded.notes)
        # Each kept example keeps its own user.
        by_image = {img.tobytes(): u for img, u in zip(images, user_ids)}
        for img, u in zip(train.images, train.user_ids):
            self.assertEqual(by_image[img.tobytes()], u)

    def _folder_with_users(self, layout_train=True):
        root = self.create_tempdir().full_path
        train_dir = os.path.join(root, "train") if layout_train else root
        image_files.write_folder(train_dir, {"cat": 12, "dog": 12},
                                 shapes=((8, 8, 3, "png"),))
        rows = []
        for i, path in enumerate(sorted(
                os.path.join(c, f) for c in ("cat", "dog")
                for f in os.listdir(os.path.join(train_dir, c)))):
            rel = os.path.join("train", path) if layout_train else path
            rows.append((rel, f"patient-{i % 6}"))
        return root, rows

    def _write_csv(self, root, rows, header="path,user"):
        with open(os.path.join(root, "users.csv"), "w") as f:
            f.write(header + "\n" + "".join(f"{p},{u}\n" for p, u in rows))

    def test_folder_users_csv_and_test_split_by_user(self):
        for layout_train in (True, False):
            with self.subTest(layout_train=layout_train):
                root, rows = self._folder_with_users(layout_train)
                self._write_csv(root, rows)
                loaded = data.load_dataset(f"folder:{root}", test_fraction=0.34, seed=0)
                self.assertIn("users from users.csv", loaded.notes)
                train, test = loaded.train, loaded.test
                self.assertEqual(len(train) + len(test), 24)
                self.assertEmpty(set(train.user_ids) & set(test.user_ids))
                self.assertLen(set(train.user_ids) | set(test.user_ids), 6)
                # Each image keeps its patient: the rows cycle patients 0..5 in
                # sorted path order, and the labels are cat (0) then dog (1).
                found = folder.load_folder(root, in_memory_max_bytes=2**30)
                self.assertAllEqual(found["train"].user_ids, np.arange(24) % 6)
                by_index = folder.load_folder(root, in_memory_max_bytes=0)["train"]
                self.assertIsInstance(by_index, folder.FileSource)
                self.assertAllEqual(by_index.subset(np.arange(5, 10)).user_ids,
                                    np.arange(5, 10) % 6)

    def test_folder_users_csv_errors(self):
        root, rows = self._folder_with_users()
        self._write_csv(root, rows[1:])
        with self.assertRaisesRegex(ValueError, r"does not list 1 of the 24 training images"):
            data.load_dataset(f"folder:{root}")
        self._write_csv(root, rows + [("train/cat/nope.png", "x")])
        with self.assertRaisesRegex(ValueError, r"lists 1 files that do not exist.*nope\.png"):
            data.load_dataset(f"folder:{root}")
        self._write_csv(root, rows, header="file,patient")
        with self.assertRaisesRegex(ValueError, "must start with the header line 'path,user'"):
            data.load_dataset(f"folder:{root}")

    def test_tfrecord_user_feature_in_memory_and_converted(self):
        directory = self.create_tempdir().full_path
        labels = np.arange(30) % 3
        users = (np.arange(30) // 3) * 5
        image_files.write_tfrecords(os.path.join(directory, "train"), labels, user_ids=users)
        for in_memory_max_bytes in (2**30, 0):
            with self.subTest(in_memory_max_bytes=in_memory_max_bytes):
                loaded = data.load_dataset(
                    f"tfrecord:{directory}/train-*", user_key="user", test_fraction=0.3,
                    in_memory_max_bytes=in_memory_max_bytes,
                    cache_dir=self.create_tempdir().full_path)
                self.assertIn("users from feature 'user'", loaded.notes)
                self.assertEmpty(set(loaded.train.user_ids) & set(loaded.test.user_ids))
                self.assertEqual(set(loaded.train.user_ids) | set(loaded.test.user_ids),
                                 set(users))
        # Without the key nothing is read as users; a missing feature is named.
        self.assertIsNone(data.load_dataset(f"tfrecord:{directory}/train-*").train.user_ids)
        with self.assertRaisesRegex(ValueError, "int64 user feature 'patient'"):
            data.load_dataset(f"tfrecord:{directory}/train-*", user_key="patient")

    def test_validation_split_by_user(self):
        images, labels, user_ids = _arrays()
        source = sources.ArraySource(images, labels, user_ids=user_ids)
        train, held = validation.split_validation(source, 0.3, seed=1)
        self.assertEmpty(set(train.user_ids) & set(held.user_ids))
        self.assertEqual(len(set(held.user_ids)), int(np.ceil(0.3 * len(set(user_ids)))))
        # Without users: stratified by label, as before.
        plain_train, _ = validation.split_validation(sources.ArraySource(images, labels), 0.3, 1)
        self.assertIsNone(plain_train.user_ids)

    def test_bad_user_ids_are_refused(self):
        images, labels, _ = _arrays()
        with self.assertRaisesRegex(ValueError, "one user per example"):
            data.load_dataset(f"npz:{self._write(x_train=images, y_train=labels, user_ids=np.zeros(3, 'int64'))}")
        with self.assertRaisesRegex(ValueError, "`user_ids` must be .*: 1 of"):
            sources.ArraySource(images, labels, user_ids=np.r_[np.nan, np.zeros(len(labels) - 1)])
        # Names are numbered in their sorted order; whole floats are integers.
        named = sources.ArraySource(images, labels, user_ids=[f"u{i % 3}" for i in range(len(labels))])
        self.assertEqual(named.user_ids.tolist()[:4], [0, 1, 2, 0])
        floats = sources.ArraySource(images, labels, user_ids=np.ones(len(labels), "float32"))
        self.assertEqual(floats.user_ids.dtype, np.int64)
        with self.assertRaisesRegex(ValueError, "both parts need"):
            splits.user_split(np.zeros(5, "int64"), 0.5, 0)

    def test_user_batches_through_the_pipeline(self):
        images, labels, user_ids = _arrays(n=40, users=8)
        ids = np.unique(user_ids, return_inverse=True)[1]
        # Image i encodes its index, so each batch row names its example.
        images = np.arange(40, dtype="uint8").reshape(40, 1, 1, 1) * np.ones((1, 2, 2, 1), "uint8")
        source = sources.ArraySource(images, labels, user_ids=ids)
        k = 3
        sampler = samplers.make_sampler(
            "user_poisson", dataset_size=int(ids.max()) + 1, logical_batch_size=4,
            physical_batch_size=6, user_ids=ids, max_examples_per_user=k)
        for granule in (None, 3):
            ds = data.make_train_pipeline(
                source, sampler=sampler, num_steps=4, seed=0, sampling_key=[1, 2],
                pad_granule=granule, preprocess_fn=lambda image: tf.cast(image, tf.float32))
            users_seen = 0
            rows = []
            for batch_images, _, weights, _ in ds:
                weights = weights.numpy()
                self.assertEqual(len(weights) % k, 0)
                index = batch_images.numpy()[:, 0, 0, 0].astype(int)
                rows.append((index, weights))
                for block in range(len(weights) // k):
                    w = weights[block * k:(block + 1) * k]
                    real = w > 0
                    if not real.any():
                        continue
                    users_seen += 1
                    c = int(real.sum())
                    self.assertAllClose(w, np.where(np.arange(k) < c, k / c, 0.0))
                    self.assertLen(set(ids[index[block * k:block * k + c]]), 1)
            self.assertGreater(users_seen, 4)
            # The same draws at any granule: only the padding differs.
            if granule is None:
                full = rows
            else:
                real_full = np.concatenate([i[w > 0] for i, w in full])
                real_fine = np.concatenate([i[w > 0] for i, w in rows])
                self.assertAllEqual(real_full, real_fine)


if __name__ == "__main__":
    tf.test.main()
