"""Exact copies in tfds training data: refused with their count, in memory, by index and streamed.

A tiny tfds dataset is prepared offline in a temporary `data_dir`, once as
array_record files (random access) and once as TFRecord files (a stream):
`tfdp_test_copies` holds 3 copies of one training image (two of them under
the other label), `tfdp_test_distinct` none.
"""

import os
from unittest import mock

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
import pytest

from tests.test_train import run_train
from tfdp import data
from tfdp.data import tfds_loading
from tfdp.data import tfds_sources

_TRAIN, _COPIES = 24, 3


class _TinyImages(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """24 training and 6 test images of 8x8 gray noise, the last `COPIES` training ones copies of the first."""

    # tfds looks for a checksums file beside the builder's package, a search
    # that fails for `tests.data`; a module name of one part skips it.
    __module__ = "tfdp_test_builders"
    VERSION = tfds.core.Version("1.0.0")
    COPIES = 0

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(8, 8, 1)),
            "label": tfds.features.ClassLabel(num_classes=2)}))

    def _split_generators(self, dl_manager):
        del dl_manager  # Nothing to download.
        return {"train": self._generate_examples(_TRAIN, self.COPIES, seed=0),
                "test": self._generate_examples(6, 0, seed=1)}

    def _generate_examples(self, count, copies, seed):
        images = np.random.default_rng(seed).integers(0, 256, (count, 8, 8, 1), np.uint8)
        images[count - copies:] = images[0]  # Two of the copies under the other label.
        for i in range(count):
            yield i, {"image": images[i], "label": i % 2}


class TfdpTestCopies(_TinyImages):
    __module__ = "tfdp_test_builders"
    COPIES = _COPIES


class TfdpTestDistinct(_TinyImages):
    __module__ = "tfdp_test_builders"


def _prepare(data_dir, file_format):
    for builder in (TfdpTestCopies, TfdpTestDistinct):
        builder(data_dir=data_dir, file_format=file_format).download_and_prepare()


class TfdsDuplicatesTest(tf.test.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        root = tf.compat.v1.test.get_temp_dir()
        cls.dirs = {access: os.path.join(root, f"tfds_{file_format}")
                    for access, file_format in (("random_access", "array_record"),
                                                ("streaming", "tfrecord"))}
        for access, file_format in (("random_access", "array_record"),
                                    ("streaming", "tfrecord")):
            _prepare(cls.dirs[access], file_format)

    def _refused(self, config, data_dir):
        """The error `load_dataset` raises for `config`, or None."""
        try:
            data.load_dataset(f"tfdp_test_{config}", data_dir=data_dir)
        except ValueError as error:
            return str(error)
        return None

    def _check_refused(self, message):
        self.assertIsNotNone(message)
        self.assertRegex(
            message,
            r"(?s)tfds tfdp_test_copies \(training data\): 3 rows are exact duplicates.*"
            r"Nothing was trained.*Write the training split without its copies.*'npz:<file>'.*"
            r"Received: 3 duplicate rows among 24\b")

    def test_random_access_and_streamed_copies_are_refused_before_training(self):
        for access, data_dir in self.dirs.items():
            with self.subTest(access=access):
                self._check_refused(self._refused("copies", data_dir))
                splits = data.load_dataset("tfdp_test_distinct", data_dir=data_dir,
                                           validation_fraction=0.25)
                kind = (tfds_sources.RandomAccessSource if access == "random_access"
                        else tfds_sources.StreamingSource)
                train = splits.train if access == "streaming" else splits.train.source
                self.assertIsInstance(train, kind)
                self.assertEqual((len(splits.train), len(splits.validation)), (18, 6))
                sampler = "poisson" if access == "random_access" else "shuffle"
                batches = list(data.make_train_pipeline(
                    splits.train, sampler=sampler, physical_batch_size=4, logical_batch_size=4,
                    num_steps=2, seed=0))
                self.assertNotEmpty(batches)
                self.assertEqual(batches[0][0].shape[1:], (8, 8, 1))

    def test_in_memory_copies_are_refused(self):
        # Read like cifar10: the split loaded into memory and decoded once.
        small = tfds_loading.SMALL_TFDS + ("tfdp_test_copies", "tfdp_test_distinct")
        with mock.patch.object(tfds_loading, "SMALL_TFDS", small):
            self._check_refused(self._refused("copies", self.dirs["streaming"]))
            splits = data.load_dataset("tfdp_test_distinct", data_dir=self.dirs["streaming"])
        self.assertIsInstance(splits.train, data.ArraySource)
        self.assertEqual(splits.train.images.shape[1:], (8, 8, 1))
        self.assertEqual(len(splits.train), 24)

    @pytest.mark.slow  # 20-40 s on 2 cores: with the slow tests (CI runs them).
    def test_the_trainer_refuses_copies_and_trains_without(self):
        common = [f"--gin_param=DataConfig.data_dir = '{self.dirs['random_access']}'",
                  "--gin_param=OptimizationConfig.epochs = 1",
                  "--gin_param=OptimizationConfig.logical_batch_size = 8",
                  "--gin_param=RunConfig.physical_batch_size = 8",
                  "--gin_param=RunConfig.export_model = False"]
        refused = run_train("--gin_param=DataConfig.dataset = 'tfdp_test_copies'",
                            *common, workdir=self.create_tempdir().full_path)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("3 rows are exact duplicates", refused.stdout + refused.stderr)
        self.assertNotIn("step 1/", refused.stdout)
        trained = run_train("--gin_param=DataConfig.dataset = 'tfdp_test_distinct'",
                            *common, workdir=self.create_tempdir().full_path)
        self.assertEqual(trained.returncode, 0, trained.stderr[-3000:])
        self.assertRegex(trained.stdout, r"(?m)^dataset=tfdp_test_distinct N=24 ")
        self.assertRegex(trained.stdout, r"(?m)^final: .*epsilon=")


if __name__ == "__main__":
    tf.test.main()
