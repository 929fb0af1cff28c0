"""Bad inputs give clear errors (or a skip and a count), not tracebacks.

The rows of docs/ROBUSTNESS.md that tests/test_train.py does not cover:
C < 0, delta <= 0, delta >= 1/N, shuffle with P not dividing B, an
unprepared tfds dataset, a BatchNormalization model, an init checkpoint of
another architecture, an unknown strategy, corrupt images through the
trainer, non-finite training examples (no stop: a stop would reveal them),
and the one-line `error:` form of gin-wrapped errors on the CLI.
Most run in-process (`tfdp.config.parse` + `tfdp.train.train`) and fail
before any training step; so does a gin-configured model that mixes
examples only on non-negative images (the training probe refuses it).
"""

import json
import math
import os
import subprocess
import sys
import warnings

import gin
import keras
import numpy as np
import tensorflow as tf

from tfdp import config
from tfdp import data
from tfdp import train as train_lib
from tfdp import training

QUICK = [
    "DataConfig.dataset = 'digits'",
    "OptimizationConfig.epochs = 1",
    "OptimizationConfig.logical_batch_size = 128",
    "RunConfig.physical_batch_size = 64",
    "RunConfig.export_model = False",
    "RunConfig.log_every_steps = 100",
    "PrivacyConfig.noise_multiplier = 1.0",  # No calibration: faster.
    "PrivacyConfig.target_epsilon = None",
]


@gin.configurable(module="tests")
def batchnorm_model(num_classes, input_shape):
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv2D(4, 3),
        keras.layers.BatchNormalization(),
        keras.layers.Flatten(),
        keras.layers.Dense(num_classes),
    ])


@gin.configurable(module="tests")
def overflowing_model(num_classes, input_shape):
    """Finite on images in [0, 1]; every loss is NaN on images of 1000 (exp overflows)."""
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Flatten(),
        keras.layers.Activation("exponential"),
        keras.layers.Dense(num_classes),
    ])


@gin.configurable(module="tests")
def centres_non_negative_model(num_classes, input_shape):
    """Subtracts the batch mean from the images, only when they are all >= 0 (they are)."""
    from tests.dp.test_training_probe import CentresNonNegative

    return keras.Sequential([
        keras.Input(input_shape),
        CentresNonNegative(name="centres_non_negative"),
        keras.layers.Flatten(),
        keras.layers.Dense(num_classes),
    ])


class BadInputsTest(tf.test.TestCase):

    def _train(self, *bindings, workdir=None):
        config.parse(["mnist_default.gin"], QUICK + list(bindings))
        return train_lib.train(workdir or self.create_tempdir().full_path)

    def test_invalid_hyperparameters(self):
        cases = {
            "PrivacyConfig.l2_norm_clip = -1.0": "l2_norm_clip",
            "PrivacyConfig.delta = 0.0": "delta`? must be in",
            "PrivacyConfig.delta = -1e-5": "delta`? must be in",
            "PrivacyConfig.target_epsilon = 0.0": "target_epsilon must be > 0",
            "OptimizationConfig.epochs = 0": "epochs must be > 0",
            "RunConfig.physical_batch_size = -1": "physical_batch_size must be an integer >= 1",
            "OptimizationConfig.lr_schedule = 'linear'": "lr_schedule",
            "OptimizationConfig.logical_batch_size = 0": "logical_batch_size must be",
            "DataConfig.augmentation_multiplicity = 0": "augmentation_multiplicity must be",
            "ModelConfig.freeze_sub_blocks = -1": "freeze_sub_blocks must be",
            "RunConfig.log_every_steps = 0": "log_every_steps must be",
            "PrivacyConfig.privacy_unit = 'user'": "needs max_examples_per_user",
        }
        for binding, needle in cases.items():
            with self.subTest(binding):
                with self.assertRaisesRegex(ValueError, needle):
                    self._train(binding)

    def test_shuffle_physical_batch_must_divide_logical(self):
        with self.assertRaisesRegex(ValueError, "must divide"):
            self._train("PrivacyConfig.sampler = 'shuffle'", "RunConfig.physical_batch_size = 48")

    def test_unprepared_tfds_dataset(self):
        empty = self.create_tempdir().full_path
        with self.assertRaisesRegex(ValueError, "not prepared.*tfds build cifar10"):
            self._train("DataConfig.dataset = 'cifar10'", f"DataConfig.data_dir = '{empty}'")

    def test_batchnorm_model_is_refused(self):
        with self.assertRaisesRegex(ValueError, "BatchNormalization.*replace_batchnorm"):
            self._train("ModelConfig.model_fn = @tests.batchnorm_model")

    def test_mixing_on_non_negative_images_is_refused(self):
        # The digits are in [0, 1], where the layer mixes; the probe draws
        # batches from that range too, so it is refused before any step.
        workdir = self.create_tempdir().full_path
        with self.assertRaisesRegex(ValueError, "Layer 'centres_non_negative' mixes examples"):
            self._train("ModelConfig.model_fn = @tests.centres_non_negative_model",
                        workdir=workdir)
        self.assertFalse(os.path.exists(os.path.join(workdir, "summary.json")))

    def test_init_checkpoint_of_another_architecture(self):
        path = os.path.join(self.create_tempdir().full_path, "other.keras")
        keras.Sequential([
            keras.Input((8, 8, 1)), keras.layers.Flatten(),
            keras.layers.Dense(7, name="d1"), keras.layers.Dense(10, name="head_dense"),
        ]).save(path)
        with self.assertRaisesRegex(ValueError, r"(?s)mismatch.*conv1: missing from the source"):
            self._train(f"ModelConfig.init_checkpoint = '{path}'")
        with self.assertRaisesRegex(ValueError, "not found"):
            self._train(f"ModelConfig.init_checkpoint = '{path[:-6]}_missing.keras'")

    def test_train_bindings_name_their_config(self):
        # In a file (every moved binding of it) and among the bindings.
        path = os.path.join(self.create_tempdir().full_path, "old.gin")
        with open(path, "w") as f:
            f.write("include 'mnist_default.gin'\ntrain.dataset = 'digits'\n"
                    "train.noise_multiplier = 1.0\n")
        with self.assertRaisesRegex(
                ValueError, r"^Bad gin configuration in .*old\.gin: train\.dataset moved to "
                            r"DataConfig\.dataset, train\.noise_multiplier moved to "
                            r"PrivacyConfig\.noise_multiplier \(.*\)\. Received: train\.dataset$"):
            config.parse([path], [])
        with self.assertRaisesRegex(ValueError, r"train\.strategy moved to RunConfig\.strategy"):
            config.parse(["mnist_default.gin"], QUICK + ["train.strategy = 'mirrored'"])

    def test_configs_can_be_passed_in_python(self):
        config.parse(["mnist_default.gin"], QUICK)
        privacy = training.PrivacyConfig(l2_norm_clip=0.5, noise_multiplier=1.0)
        self.assertEqual(privacy.dpsgd_config.l2_norm_clip, 0.5)
        self.assertIsNone(training.PrivacyConfig(private=False).dpsgd_config)
        with self.assertRaisesRegex(ValueError, "for private training"):
            training.PrivacyConfig(private=False, privacy_unit="user")
        with self.assertRaisesRegex(ValueError, "draws users by Poisson sampling"):
            training.PrivacyConfig(sampler="shuffle", privacy_unit="user",
                                   max_examples_per_user=2, noise_multiplier=1.0)
        with self.assertRaisesRegex(ValueError, "Unknown strategy.*'bogus'"):
            train_lib.train(self.create_tempdir().full_path,
                            run_config=training.RunConfig(strategy="bogus"))

    def test_unknown_strategy(self):
        config.parse(["mnist_default.gin"], QUICK)
        with self.assertRaisesRegex(ValueError, "Unknown strategy.*'bogus'"):
            train_lib.train(self.create_tempdir().full_path, strategy_name="bogus")

    def test_delta_above_one_over_n_warns(self):
        # The ledger warns when it is created; the missing init checkpoint
        # then stops the run before any training.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with self.assertRaisesRegex(ValueError, "not found"):
                self._train("PrivacyConfig.delta = 0.01",
                            "ModelConfig.init_checkpoint = '/nonexistent.keras'")
        messages = [str(w.message) for w in caught]
        self.assertTrue(any("is >= 1/dataset_size" in m for m in messages), messages)

    def test_corrupt_images_are_skipped_counted_and_logged(self):
        train_src, test_src, _ = data.load_offline("digits")
        info = data.DatasetInfo("digits_jpeg", 10, (8, 8, 3))

        def encode(source, corrupt):
            images = (np.repeat(source.images, 3, -1) * 255).astype(np.uint8)
            encoded = [tf.io.encode_jpeg(image).numpy() for image in images]
            for i in corrupt:
                encoded[i] = encoded[i][: len(encoded[i]) // 2] if i % 2 else b""
            return data.ArraySource(np.array(encoded, dtype=object), source.labels, info)

        corrupt_train = list(range(0, 1437, 7))  # 206 of 1437: some in every step.
        sources = data.DatasetSplits(
            encode(train_src, corrupt_train), None, encode(test_src, [1, 2, 3]), info)
        original = data.load_dataset
        data.load_dataset = lambda *args, **kwargs: sources
        workdir = self.create_tempdir().full_path
        try:
            with _Capture() as out:
                summary = self._train(workdir=workdir)
        finally:
            data.load_dataset = original
        self.assertEqual(summary["steps"], 12)
        skipped = summary["not_covered_by_epsilon"]["skipped_undecodable_train"]
        # ~ q * 206 per step over 12 steps (q = 128/1437): well away from 0 and 206.
        self.assertGreater(skipped, 50)
        self.assertLess(skipped, 206 * 2)
        self.assertRegex(out.text, rf"not covered by epsilon\): skipped {skipped} undecodable "
                                   "training images so far")
        self.assertIn("skipped 3 undecodable test images in this evaluation", out.text)
        with open(os.path.join(workdir, "summary.json")) as f:
            self.assertEqual(json.load(f)["not_covered_by_epsilon"]["skipped_undecodable_train"], skipped)

    def test_non_finite_examples_never_stop_the_run_and_an_insecure_seed_is_not_private(self):
        # Every training example has a NaN loss: each is dropped by the
        # clipping and each step applies its noise alone. A stop here would
        # reveal the examples without noise, so there is none; the parameters
        # stay finite.
        train_src, test_src, info = data.load_offline("digits")
        overflowing = np.full_like(train_src.images, 1000.0)
        sources = data.DatasetSplits(data.ArraySource(overflowing, train_src.labels, info),
                                     None, test_src, info)
        original = data.load_dataset
        data.load_dataset = lambda *args, **kwargs: sources
        try:
            with _Capture() as out:
                summary = self._train("PrivacyConfig.insecure_reproducible_seed = 7",
                                      "ModelConfig.model_fn = @tests.overflowing_model",
                                      "RunConfig.log_every_steps = 6")
        finally:
            data.load_dataset = original
        self.assertEqual(summary["steps"], 12)
        self.assertRegex(out.text, r"not covered by epsilon\): \d+ examples had non-finite "
                                   "gradients and were dropped")
        self.assertTrue(math.isfinite(summary["test_accuracy"]))
        final = [line for line in out.text.splitlines() if line.startswith("final:")]
        self.assertNotEmpty(final)
        for line in final:  # Every final line with an epsilon says it does not hold.
            self.assertRegex(line, r"^final: NOT PRIVATE \(insecure_reproducible_seed=7: "
                                   r"epsilon does not hold .*\) .*epsilon=")
        self.assertRegex(final[-1], r"\) test_accuracy=[0-9.]+ epsilon=")

    def test_cli_error_lines_drop_gin_call_suffix_and_probe_noise(self):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        result = subprocess.run(
            [sys.executable, "-m", "tfdp.train", *(f"--gin_param={b}" for b in QUICK),
             "--gin_param=PrivacyConfig.l2_norm_clip = -1.0",
             f"--workdir={self.create_tempdir().full_path}"],
            capture_output=True, text=True, env=env, timeout=300,
        )
        self.assertEqual(result.returncode, 2, result.stderr[-2000:])
        self.assertNotIn("Traceback", result.stderr)
        self.assertNotIn("In call to configurable", result.stderr)
        self.assertNotIn("Path not found", result.stderr)  # gin's include probe.
        self.assertIn(
            "error: l2_norm_clip must be > 0. Received: l2_norm_clip=-1.0\n", result.stderr
        )


class _Capture:
    """Captures what the trainer prints (`_log` writes to stdout)."""

    def __enter__(self):
        import contextlib
        import io

        self._buffer = io.StringIO()
        self._redirect = contextlib.redirect_stdout(self._buffer)
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc):
        self._redirect.__exit__(*exc)
        self.text = self._buffer.getvalue()
        sys.stdout.write(self.text)
        return False


if __name__ == "__main__":
    tf.test.main()
