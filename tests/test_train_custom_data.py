"""`python -m tfdp.train` on your own images: folder, TFRecord and `.npz` routes.

Each test writes real files into a temporary folder, trains a few private
steps from the command line and checks the counts per class, the
validation split (held out of N), the skipped-file count and the epsilon
(recomputed from the logged sigma, q = B / N and steps). A test set held out
of the training data is labelled as not covered by epsilon; a separate one
is not.
"""

import pytest
import json
import os
import re
import shutil

import numpy as np
import tensorflow as tf

from tests.data import image_files
from tests.test_train import run_train
from tfdp import privacy

COMMON = [
    "--gin_param=load_dataset.image_size = 16",
    "--gin_param=OptimizationConfig.epochs = 2",
    "--gin_param=BATCH = 32",
    "--gin_param=RunConfig.log_every_steps = 100",
    "--gin_param=RunConfig.export_model = False",
]
DATASET_LINE = re.compile(r"^dataset=\S+ N=(?P<n>\d+) sampler=poisson q=(?P<q>[0-9.]+) ", re.M)
PRIVACY_LINE = re.compile(r"^privacy: sigma=(?P<sigma>[0-9.]+) ", re.M)
# The test accuracy is on this line unless the test set was held out of the training data.
FINAL_EPSILON = re.compile(
    r"^final: (?:test_accuracy=[0-9.]+ )?epsilon=(?P<eps>[0-9.]+) .*steps=(?P<steps>\d+)$", re.M)


def _tensorboard_tags(workdir):
    events = tf.io.gfile.glob(os.path.join(workdir, "tensorboard", "events.*"))
    return {value.tag for path in events for event in tf.compat.v1.train.summary_iterator(path)
            for value in event.summary.value}


class TrainOnYourImagesTest(tf.test.TestCase):

    def _train(self, dataset, *extra):
        workdir = self.create_tempdir().full_path
        result = run_train(f"--gin_param=DataConfig.dataset = '{dataset}'", *COMMON, *extra,
                           workdir=workdir)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
        return result.stdout, summary, workdir

    def _check_epsilon(self, out, summary, n):
        """The reported epsilon is that of the logged sigma at q = 32 / N."""
        dataset_line = DATASET_LINE.search(out)
        self.assertEqual(int(dataset_line["n"]), n)
        self.assertAlmostEqual(float(dataset_line["q"]), 32 / n, places=5)
        sigma = float(PRIVACY_LINE.search(out)["sigma"])
        final = FINAL_EPSILON.search(out)
        self.assertEqual(int(final["steps"]), summary["steps"])
        expected = privacy.epsilon(sigma, summary["steps"], 1e-5, sampling_rate=32 / n)
        self.assertAllClose(summary["epsilon"], expected, rtol=1e-3)
        self.assertAllClose(float(final["eps"]), summary["epsilon"], rtol=1e-3)
        self.assertLessEqual(summary["epsilon"], 8.0 + 1e-6)

    @pytest.mark.slow  # 12-20 s of a whole run or a memory measurement (CI runs it).
    def test_folder_with_a_separate_test_set_duplicates_corrupt_files_and_validation(self):
        root = self.create_tempdir().full_path
        next_id = image_files.write_folder(
            os.path.join(root, "train"), {"cat": 40, "dog": 30, "emu": 30}, corrupt=3
        )
        test_dir = self.create_tempdir().full_path
        image_files.write_folder(test_dir, {"cat": 5, "dog": 5, "emu": 5}, start_id=next_id)
        # Copies of training files: two in the training data, one in the test set.
        dog = os.path.join(root, "train", "dog")
        original = os.path.join(dog, sorted(os.listdir(dog))[0])
        for copy in (os.path.join(dog, "zz_copy1.png"), os.path.join(dog, "zz_copy2.png"),
                     os.path.join(test_dir, "dog", "zz_copy.png")):
            shutil.copy(original, copy)
        out, summary, workdir = self._train(
            f"folder:{root}", "--gin_param=DataConfig.validation_fraction = 0.2",
            f"--gin_param=DataConfig.test_dataset = 'folder:{test_dir}'",
        )
        # 100 files after the 3 corrupt ones (in "cat") and the 2 copies are
        # dropped; a stratified 0.2 (20) is held out of N.
        self.assertIn("dropped 3 undecodable image file(s) of 121 (train 3): "
                      "train/cat/corrupt_0.jpg, train/cat/corrupt_1.jpg, "
                      "train/cat/corrupt_2.jpg", out)
        self.assertIn("train examples per class [32, 24, 24], exact duplicates dropped "
                      "train=2, test=1", out)
        self.assertEqual(summary["not_covered_by_epsilon"]["duplicates_dropped_train"], 2)
        self.assertEqual(summary["not_covered_by_epsilon"]["duplicates_dropped_test"], 1)
        # Exact counts of the private data: labelled, never beside epsilon.
        self.assertIn("data: train N=80 validation=20 test=15 classes=3 input=(16, 16, 3) "
                      "| not covered by epsilon: these exact counts, ", out)
        not_covered = summary["not_covered_by_epsilon"]
        self.assertEqual((not_covered["dataset_size"], not_covered["validation_size"]), (80, 20))
        for key in ("dataset_size", "validation_size", "data_preparation", "train_examples"):
            self.assertNotIn(key, summary)
        self.assertIn("Not covered: the counts and figures under not_covered_by_epsilon",
                      summary["privacy_guarantee"])
        self._check_epsilon(out, summary, 80)
        # Found once, up front: the training pipeline never meets them.
        preparation = not_covered["data_preparation"]
        self.assertEqual(preparation["undecodable_dropped"]["train"], 3)
        self.assertEqual((preparation["train_examples"], preparation["test_examples"]), (80, 15))
        self.assertEqual(summary["not_covered_by_epsilon"]["skipped_undecodable_train"], 0)
        self.assertNotIn("undecodable training images so far", out)
        # Validation is reported apart from the test set: console, summary, TensorBoard.
        self.assertRegex(out, r"epoch .* test_acc=.* \| non-DP: val_acc=[0-9.]+ ")
        self.assertRegex(out, r"final: validation_accuracy=[0-9.]+ \(N=20, held out")
        self.assertBetween(summary["not_covered_by_epsilon"]["validation_accuracy"], 0.0, 1.0)
        tags = _tensorboard_tags(workdir)
        self.assertContainsSubset({"non_dp/validation_accuracy", "test/accuracy"}, tags)
        self.assertNotIn("non_dp/test_accuracy", tags)
        # The separate test set is not labelled; the held-out validation examples are.
        self.assertRegex(out, r"(?m)^final: test_accuracy=[0-9.]+ epsilon=")
        self.assertBetween(summary["test_accuracy"], 0.0, 1.0)
        self.assertNotIn("test_accuracy", summary["not_covered_by_epsilon"])
        self.assertEqual(summary["held_out_not_protected"], {"validation": 20})
        self.assertIn("data: WARNING: the 20 validation examples held out of the training data "
                      "are NOT protected by epsilon", out)

    @pytest.mark.slow
    def test_tfrecord_converted_to_array_record(self):
        directory = self.create_tempdir().full_path
        labels = np.arange(90) % 3
        image_files.write_tfrecords(os.path.join(directory, "train"), labels, corrupt=(4, 5))
        image_files.write_tfrecords(os.path.join(directory, "test"), np.arange(12) % 3)
        cache = self.create_tempdir().full_path
        out, summary, _ = self._train(
            f"tfrecord:{directory}/train-*",
            "--gin_param=load_dataset.in_memory_max_bytes = 0",
            f"--gin_param=load_dataset.cache_dir = '{cache}'",
        )
        self.assertRegex(out, r"random access via .*images\.array_record \(converted\)")
        self.assertIn("train examples per class [30, 29, 29]", out)
        self.assertIn("test=12 classes=3", out)
        self._check_epsilon(out, summary, 88)
        self.assertEqual(
            summary["not_covered_by_epsilon"]["data_preparation"]["undecodable_dropped"]["train"],
            2)
        self.assertEqual(summary["not_covered_by_epsilon"]["skipped_undecodable_train"], 0)
        self.assertNotIn("validation_accuracy", summary["not_covered_by_epsilon"])

    @pytest.mark.slow  # A whole run (CI runs it).
    def test_npz_copies_kept_as_distinct_records(self):
        path = os.path.join(self.create_tempdir().full_path, "arrays.npz")
        rng = np.random.default_rng(0)
        x = rng.integers(0, 256, (80, 16, 16), dtype=np.uint8)
        x[70:] = x[0]  # One content, 11 rows: 10 copies of row 0.
        x_test = rng.integers(0, 256, (20, 16, 16), dtype=np.uint8)
        np.savez(path, x_train=x, y_train=np.arange(80) % 4, x_test=x_test,
                 y_test=np.arange(20) % 4)
        refused = run_train(f"--gin_param=DataConfig.dataset = 'npz:{path}'", *COMMON,
                            workdir=self.create_tempdir().full_path)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("10 rows are exact duplicates", refused.stderr + refused.stdout)
        self.assertIn("duplicates='keep'", refused.stderr + refused.stdout)
        out, summary, _ = self._train(f"npz:{path}", "--gin_param=DataConfig.duplicates = 'keep'")
        self._check_epsilon(out, summary, 80)
        self.assertIn("training data: kept 10 rows that repeat another row's content among 80 "
                      "(duplicates='keep'; the largest group holds 11 identical rows)", out)
        self.assertRegex(out, r"planned: were the largest group of 11 identical rows one "
                              r"record, its guarantee would be (no finite epsilon|epsilon=)")
        kept = summary["not_covered_by_epsilon"]["duplicates_kept"]
        self.assertEqual((kept["copies"], kept["rows"], kept["largest_group"]), (10, 80, 11))
        self.assertFalse(kept["covered_by_epsilon"])
        self.assertGreater(kept["group_epsilon"], summary["epsilon"])

    @pytest.mark.slow
    def test_npz_arrays(self):
        path = os.path.join(self.create_tempdir().full_path, "arrays.npz")
        rng = np.random.default_rng(0)
        np.savez(path, x_train=rng.integers(0, 256, (80, 16, 16), dtype=np.uint8),
                 y_train=np.arange(80) % 4)
        out, summary, workdir = self._train(f"npz:{path}",
                                            "--gin_param=DataConfig.validation_fraction = 0.1")
        # No x_test: a stratified 0.2 is the test set (16), then 0.1 of the rest (7).
        self.assertIn("data: train N=57 validation=7 test=16 classes=4 input=(16, 16, 1)", out)
        self._check_epsilon(out, summary, 57)
        self.assertEqual(summary["not_covered_by_epsilon"]["skipped_undecodable_train"], 0)
        # The held-out test examples are private: labelled in the first lines, every
        # epoch line, TensorBoard, summary.json and the final lines.
        self.assertIn("data: WARNING: the 16 test and 7 validation examples held out of the "
                      "training data are NOT protected by epsilon", out)
        self.assertRegex(out, r"(?m)^epoch .*: epsilon=.* \| non-DP: "
                              r"test_acc=[0-9.]+ test_loss=[0-9.]+ val_acc=")
        self.assertNotRegex(out, r"(?m)^epoch [^|]*test_acc=")
        self.assertRegex(out, r"(?m)^final: test_accuracy=[0-9.]+ \(N=16, held out from "
                              r"training, not covered by epsilon\)$")
        self.assertRegex(out, r"(?m)^final: epsilon=")
        self.assertNotIn("test_accuracy", summary)
        self.assertBetween(summary["not_covered_by_epsilon"]["test_accuracy"], 0.0, 1.0)
        self.assertEqual(summary["held_out_not_protected"], {"test": 16, "validation": 7})
        self.assertIn("16 test and 7 validation examples held out of the training data are NOT "
                      "protected", summary["privacy_guarantee"])
        tags = _tensorboard_tags(workdir)
        self.assertIn("non_dp/test_accuracy", tags)
        self.assertNotIn("test/accuracy", tags)
