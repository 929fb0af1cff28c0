"""Undecodable images are found once at load time, named in the notes and dropped.

`load_dataset` decodes every encoded image of `folder:` and `tfrecord:` data
once (`tfdp.data.image_check`); the pipelines then never meet a bad one. The
pipelines' own weight-0 guard, for data that cannot be checked up front, is
tested in test_corrupt_images.py.
"""

import contextlib
import os
import struct
import tempfile

import numpy as np
import tensorflow as tf

from tests.data import image_files
from tfdp import data
from tfdp.data import image_check

RGB_8 = ((8, 8, 3, "png"),)


@contextlib.contextmanager
def _stderr_fd(into):
    """What is written to file descriptor 2 inside the block, appended to `into` (a list)."""
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            into.append(captured.read().decode(errors="replace"))


def _weights_and_skips(source, preprocess):
    ds = data.make_eval_pipeline(source, 8, preprocess_fn=preprocess)
    weights = np.concatenate([batch[2].numpy() for batch in ds])
    return weights[: len(source)], ds.decode_stats.value()


def _bmp(height, width):
    """An uncompressed 24-bit BMP, which `tf.io.decode_image` refuses to give 1 channel."""
    row = (width * 3 + 3) // 4 * 4
    pixels = b"".join(bytes(range(width * 3)).ljust(row, b"\0") for _ in range(height))
    header = struct.pack("<2sIHHI", b"BM", 54 + len(pixels), 0, 0, 54)
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, len(pixels), 2835, 2835,
                       0, 0)
    return header + info + pixels


class FolderBadFilesTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.root = self.create_tempdir().full_path
        next_id = image_files.write_folder(os.path.join(self.root, "train"),
                                           {"cat": 12, "dog": 10}, shapes=RGB_8, corrupt=2)
        next_id = image_files.write_folder(os.path.join(self.root, "test"), {"cat": 3, "dog": 3},
                                           start_id=next_id, shapes=RGB_8, corrupt=1)
        image_files.write_folder(os.path.join(self.root, "validation"), {"cat": 3, "dog": 3},
                                 start_id=next_id, shapes=RGB_8, corrupt=1)

    def test_named_once_dropped_from_every_split_and_counted(self):
        bad = [os.path.join(self.root, split, "cat", f"corrupt_{k}.jpg")
               for split, k in (("train", 0), ("train", 1), ("test", 0), ("validation", 0))]
        for in_memory_max_bytes in (2**30, 0):
            stderr = []
            with _stderr_fd(stderr):
                splits = data.load_dataset(f"folder:{self.root}",
                                           in_memory_max_bytes=in_memory_max_bytes)
            self.assertEqual(splits.undecodable_dropped, {"train": 2, "test": 1, "validation": 1})
            self.assertEqual(splits.undecodable_files, bad)
            self.assertEqual((len(splits.train), len(splits.test), len(splits.validation)),
                             (22, 6, 6))
            self.assertEqual(splits.class_counts(), [12, 10])
            # One line, with each file relative to the folder.
            self.assertEqual(splits.notes.count("undecodable"), 1)
            self.assertIn(
                "; dropped 4 undecodable image file(s) of 38 (train 2, test 1, validation 1): "
                "train/cat/corrupt_0.jpg, train/cat/corrupt_1.jpg, test/cat/corrupt_0.jpg, "
                "validation/cat/corrupt_0.jpg", splits.notes)
            # The decoders' own messages for the bad files stay off stderr.
            for message in ("JPEG", "jpeg", "Input file read error", "Invalid"):
                self.assertNotIn(message, stderr[0])
            # Nothing undecodable reaches a pipeline: every example has weight 1.
            for source in (splits.train, splits.test, splits.validation):
                weights, skipped = _weights_and_skips(source, splits.eval_preprocess)
                self.assertAllEqual(weights, np.ones(len(source)))
                self.assertEqual(skipped, 0)
            ds = data.make_train_pipeline(
                splits.train, sampler="poisson", physical_batch_size=8, logical_batch_size=11,
                num_steps=6, seed=0, preprocess_fn=splits.train_preprocess)
            self.assertGreater(sum(float(batch[2].numpy().sum()) for batch in ds), 0)
            self.assertEqual(ds.decode_stats.value(), 0)
        # A small folder is decoded into memory once in spite of its bad files,
        # so training reads whole decoded batches.
        self.assertFalse(data.load_dataset(f"folder:{self.root}").train.encoded)

    def test_the_decoders_do_print_for_a_bad_file(self):
        # Without the check's hold-back, decoding the same file writes to stderr:
        # the assertion above on stderr can fail.
        with open(os.path.join(self.root, "train", "cat", "corrupt_0.jpg"), "rb") as f:
            corrupt = f.read()
        stderr = []
        with _stderr_fd(stderr):
            decoded = list(tf.data.Dataset.from_tensors(corrupt)
                           .map(lambda image: tf.io.decode_image(image, channels=3))
                           .ignore_errors())
        self.assertEmpty(decoded)
        self.assertNotEqual(stderr[0].strip(), "")

    def test_a_held_out_test_split_comes_after_the_drop(self):
        root = self.create_tempdir().full_path
        image_files.write_folder(root, {"a": 10, "b": 10}, shapes=RGB_8, corrupt=7)
        splits = data.load_dataset(f"folder:{root}", test_fraction=0.2, seed=0)
        # The bad files were training data as given; train and test are the 20 good ones.
        self.assertEqual(splits.undecodable_dropped, {"train": 7})
        self.assertEqual((len(splits.train), len(splits.test)), (16, 4))
        self.assertLen(splits.undecodable_files, 7)
        self.assertIn("; dropped 7 undecodable image file(s) of 27: a/corrupt_0.jpg, "
                      "a/corrupt_1.jpg, a/corrupt_2.jpg, a/corrupt_3.jpg, a/corrupt_4.jpg "
                      "and 2 more;", splits.notes)
        for source in (splits.train, splits.test):
            self.assertEqual(_weights_and_skips(source, splits.eval_preprocess)[1], 0)

    def test_a_split_with_no_decodable_image_is_an_error(self):
        root = self.create_tempdir().full_path
        image_files.write_folder(os.path.join(root, "train"), {"a": 3, "b": 3}, shapes=RGB_8)
        os.makedirs(os.path.join(root, "test", "a"))
        for k in range(2):
            with open(os.path.join(root, "test", "a", f"{k}.jpg"), "wb") as f:
                f.write(image_files.CORRUPT + b"%d" % k)
        with self.assertRaisesRegex(ValueError, r"None of the test images decodes.*Received: 2 "):
            data.load_dataset(f"folder:{root}")

    def test_clean_folder_has_nothing_dropped(self):
        root = self.create_tempdir().full_path
        image_files.write_folder(root, {"a": 5, "b": 5}, shapes=RGB_8)
        splits = data.load_dataset(f"folder:{root}")
        self.assertEqual(splits.undecodable_dropped, {"train": 0})
        self.assertEqual(splits.undecodable_files, [])
        self.assertNotIn("undecodable", splits.notes)
        self.assertNotIn("images:", splits.notes)  # All 8x8 RGB: nothing converted.


class ConversionNoteTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        self.root = self.create_tempdir().full_path
        # 12x16 RGB, 20x14 gray, 16x16 RGBA PNGs and 18x22 RGB JPEGs, two of each.
        image_files.write_folder(self.root, {"a": 4, "b": 4})

    def test_one_line_for_converted_and_resized_images(self):
        splits = data.load_dataset(f"folder:{self.root}", test_fraction=0.25)
        self.assertEqual(splits.info.image_shape, (12, 16, 3))  # The first image's.
        self.assertIn("; images: 4 of 8 converted to RGB (2 grayscale, 2 RGBA, alpha dropped), "
                      "6 of 8 resized to 12x16", splits.notes)
        self.assertEqual(splits.notes.count("images:"), 1)
        gray = data.load_dataset(f"folder:{self.root}", channels=1, image_size=16)
        self.assertIn("; images: 6 of 8 converted to grayscale (4 RGB, 2 RGBA, alpha dropped), "
                      "6 of 8 resized to 16x16", gray.notes)

    def test_random_crops_resize_every_image_and_say_nothing_of_it(self):
        splits = data.load_dataset(f"folder:{self.root}", image_size=8, preprocessing="crop")
        self.assertIn("; images: 4 of 8 converted to RGB (2 grayscale, 2 RGBA, alpha dropped)",
                      splits.notes)
        self.assertNotIn("resized", splits.notes)

    def test_an_image_that_cannot_be_converted_is_dropped(self):
        # BMP decodes to 3 channels but not to 1: with gray input it is undecodable.
        root = self.create_tempdir().full_path
        image_files.write_folder(root, {"a": 4, "b": 4}, shapes=((6, 6, 1, "png"),))
        with open(os.path.join(root, "a", "photo.bmp"), "wb") as f:
            f.write(_bmp(6, 6))
        gray = data.load_dataset(f"folder:{root}")
        self.assertEqual(gray.info.image_shape, (6, 6, 1))
        self.assertEqual(gray.undecodable_files, [os.path.join(root, "a", "photo.bmp")])
        self.assertIn("dropped 1 undecodable image file(s) of 9: a/photo.bmp", gray.notes)
        for source in (gray.train, gray.test):
            self.assertEqual(_weights_and_skips(source, gray.eval_preprocess)[1], 0)
        rgb = data.load_dataset(f"folder:{root}", channels=3)
        self.assertEqual(rgb.undecodable_dropped, {"train": 0})
        self.assertIn("images: 8 of 9 converted to RGB (8 grayscale)", rgb.notes)


class TFRecordBadRecordsTest(tf.test.TestCase):

    def test_records_named_by_number_and_dropped(self):
        directory = self.create_tempdir().full_path
        image_files.write_tfrecords(os.path.join(directory, "train"), np.arange(30) % 3,
                                    corrupt=(7, 20))
        image_files.write_tfrecords(os.path.join(directory, "test"), np.arange(6) % 3,
                                    corrupt=(4,))
        pattern = os.path.join(directory, "train-*")
        shard = os.path.join(directory, "{}-0000{}-of-00002").format
        for in_memory_max_bytes in (2**30, 0):
            splits = data.load_dataset(f"tfrecord:{pattern}",
                                       in_memory_max_bytes=in_memory_max_bytes)
            self.assertEqual(splits.undecodable_dropped, {"train": 2, "test": 1})
            # Example i is in shard i % 2: example 20 is record 10 of the first shard,
            # 7 is record 3 of the second; test example 4 is record 2 of its first.
            self.assertEqual(splits.undecodable_files, [
                f"record 10 of {shard('train', 0)}", f"record 3 of {shard('train', 1)}",
                f"record 2 of {shard('test', 0)}"])
            self.assertIn("; dropped 3 undecodable image(s) of 36 (train 2, test 1): record 10 "
                          "of train-00000-of-00002, record 3 of train-00001-of-00002, record 2 "
                          "of test-00000-of-00002", splits.notes)
            self.assertEqual((len(splits.train), len(splits.test)), (28, 5))
            # Labels 7 % 3 = 1 and 20 % 3 = 2 are gone.
            self.assertEqual(splits.class_counts(), [10, 9, 9])
            for source in (splits.train, splits.test):
                self.assertEqual(_weights_and_skips(source, splits.eval_preprocess)[1], 0)


class HoldBackTest(tf.test.TestCase):

    def test_decoder_lines_are_dropped_and_other_lines_kept(self):
        stderr = []
        with _stderr_fd(stderr):
            with image_check.decoder_messages_held_back():
                os.write(2, b"Premature end of JPEG file\n")
                os.write(2, b"E0000 00:00:1796294606.209579    2393 jpeg_mem.cc:331] Premature "
                            b"end of JPEG data. Stopped at line 0/16\n\n")
                os.write(2, b"W0000 00:00:1796294606.309579    2393 png_io.cc:88] PNG warning\n")
                os.write(2, b"W0000 00:00:1796294606.409579    2393 threadpool.cc:12] other\n")
        self.assertEqual(stderr[0], "W0000 00:00:1796294606.409579    2393 threadpool.cc:12] "
                                    "other\n")


if __name__ == "__main__":
    tf.test.main()
