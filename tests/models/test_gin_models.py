"""Every gin/models file parses and names a registered model builder."""

import glob
import os

import gin
import tensorflow as tf

from tfdp import models  # noqa: F401 (registers the builders)
from tfdp import train  # noqa: F401 (registers ModelConfig.model_fn)

_FILES = sorted(glob.glob(os.path.join(
    os.path.dirname(__file__), os.pardir, os.pardir, "gin", "models", "*.gin")))


class GinModelsTest(tf.test.TestCase):

    def test_each_file_binds_a_tfdp_model_builder(self):
        self.assertIn("vit_s16.gin", {os.path.basename(p) for p in _FILES})
        for path in _FILES:
            with self.subTest(os.path.basename(path)):
                try:
                    # The macro that pretrained.gin leaves to the including file.
                    gin.parse_config_files_and_bindings([path], ["PRETRAINED_WEIGHTS = None"])
                    with gin.unlock_config():
                        model_fn = gin.query_parameter("ModelConfig.model_fn")
                finally:
                    gin.clear_config()
                self.assertTrue(model_fn.selector.startswith("tfdp.models."), model_fn.selector)
