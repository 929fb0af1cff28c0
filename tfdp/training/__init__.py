"""Reusable parts of the trainer (`tfdp.train`): its configs and its stages.

The configs group the trainer's gin bindings by the stage that reads them;
they import no TensorFlow, so `--help` and the gin checks stay fast.
"""

from tfdp.training.data_config import DataConfig
from tfdp.training.model_config import ModelConfig
from tfdp.training.optimization_config import OptimizationConfig
from tfdp.training.privacy_config import PrivacyConfig
from tfdp.training.run_config import RunConfig

# In the order `python -m tfdp.train --help` lists them.
TRAINER_CONFIGS = (DataConfig, ModelConfig, PrivacyConfig, OptimizationConfig, RunConfig)
