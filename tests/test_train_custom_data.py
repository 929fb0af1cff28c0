"""`python -m tfdp.train` on your own images: folder, TFRecord and `.npz` routes.

Each test writes real files into a temporary folder, trains a few private
steps from the command line and checks the counts per class, the
validation split (held out of N), the skipped-file count and the epsilon
(recomputed from the logged sigma, q = B / N and steps).
"""

import json
import os
import re

import numpy as np
import tensorflow as tf

from tests.data import image_files
from tests.test_train import FINAL
from tests.test_train import run_train
from tfdp import privacy

COMMON = [
    "--gin_param=load_dataset.image_size = 16",
    "--gin_param=train.epochs = 2",
    "--gin_param=BATCH = 32",
    "--gin_param=train.log_every_steps = 100",
    "--gin_param=train.export_model = False",
]
DATASET_LINE = re.compile(r"^dataset=\S+ N=(?P<n>\d+) sampler=poisson q=(?P<q>[0-9.]+) ", re.M)
PRIVACY_LINE = re.compile(r"^privacy: sigma=(?P<sigma>[0-9.]+) ", re.M)


class TrainOnYourImagesTest(tf.test.TestCase):

    def _train(self, dataset, *extra):
        workdir = self.create_tempdir().full_path
        result = run_train(f"--gin_param=train.dataset = '{dataset}'", *COMMON, *extra,
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
        final = FINAL.search(out)
        self.assertEqual(int(final["steps"]), summary["steps"])
        expected = privacy.epsilon(sigma, summary["steps"], 1e-5, sampling_rate=32 / n)
        self.assertAllClose(summary["epsilon"], expected, rtol=1e-3)
        self.assertAllClose(float(final["eps"]), summary["epsilon"], rtol=1e-3)
        self.assertLessEqual(summary["epsilon"], 8.0 + 1e-6)

    def test_folder_with_corrupt_files_and_a_validation_split(self):
        root = self.create_tempdir().full_path
        next_id = image_files.write_folder(
            os.path.join(root, "train"), {"cat": 40, "dog": 30, "emu": 30}, corrupt=3
        )
        image_files.write_folder(
            os.path.join(root, "test"), {"cat": 5, "dog": 5, "emu": 5}, start_id=next_id
        )
        out, summary, workdir = self._train(
            f"folder:{root}", "--gin_param=train.validation_fraction = 0.2"
        )
        # 103 files (3 corrupt, in "cat"); a stratified 0.2 (21) is held out of N.
        self.assertIn("train examples per class [34, 24, 24]", out)
        self.assertIn("data: train N=82 validation=21 test=15 classes=3 input=(16, 16, 3)", out)
        self.assertEqual((summary["dataset_size"], summary["validation_size"]), (82, 21))
        self._check_epsilon(out, summary, 82)
        skipped = summary["not_covered_by_epsilon"]["skipped_undecodable_train"]
        self.assertGreater(skipped, 0)
        self.assertIn(f"not covered by epsilon): skipped {skipped} undecodable training images", out)
        # Validation is reported apart from the test set: console, summary, TensorBoard.
        self.assertRegex(out, r"epoch .* test_acc=.* \| not covered by epsilon: val_acc=[0-9.]+ ")
        self.assertRegex(out, r"final: validation_accuracy=[0-9.]+ \(N=21, held out")
        self.assertBetween(summary["not_covered_by_epsilon"]["validation_accuracy"], 0.0, 1.0)
        events = tf.io.gfile.glob(os.path.join(workdir, "tensorboard", "events.*"))
        tags = {value.tag for path in events for event in tf.compat.v1.train.summary_iterator(path)
                for value in event.summary.value}
        self.assertContainsSubset({"non_dp/validation_accuracy", "test/accuracy"}, tags)

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
        self.assertIn("train examples per class [30, 30, 30]", out)
        self.assertIn("test=12 classes=3", out)
        self._check_epsilon(out, summary, 90)
        self.assertGreater(summary["not_covered_by_epsilon"]["skipped_undecodable_train"], 0)
        self.assertNotIn("validation_accuracy", summary["not_covered_by_epsilon"])

    def test_npz_arrays(self):
        path = os.path.join(self.create_tempdir().full_path, "arrays.npz")
        rng = np.random.default_rng(0)
        np.savez(path, x_train=rng.integers(0, 256, (80, 16, 16), dtype=np.uint8),
                 y_train=np.arange(80) % 4)
        out, summary, _ = self._train(f"npz:{path}", "--gin_param=train.validation_fraction = 0.1")
        # No x_test: a stratified 0.2 is the test set (16), then 0.1 of the rest (7).
        self.assertIn("data: train N=57 validation=7 test=16 classes=4 input=(16, 16, 1)", out)
        self._check_epsilon(out, summary, 57)
        self.assertEqual(summary["not_covered_by_epsilon"]["skipped_undecodable_train"], 0)
