"""Input pipelines for DP-SGD: sources, samplers and preprocessing."""

from tfdp.data.catalog import CATALOG
from tfdp.data.catalog import catalog_entry
from tfdp.data.pipeline import DecodeStats
from tfdp.data.pipeline import make_eval_pipeline
from tfdp.data.pipeline import make_train_pipeline
from tfdp.data.pipeline import train_sampler
from tfdp.data.preprocessing import cifar_eval_preprocess
from tfdp.data.preprocessing import cifar_train_preprocess
from tfdp.data.preprocessing import imagenet_eval_preprocess
from tfdp.data.preprocessing import imagenet_train_preprocess
from tfdp.data.sources import ArraySource
from tfdp.data.sources import DatasetInfo
from tfdp.data.sources import RandomAccessSource
from tfdp.data.sources import StreamingSource
from tfdp.data.sources import load_offline
from tfdp.data.sources import load_tfds

__all__ = [
    "CATALOG",
    "catalog_entry",
    "ArraySource",
    "DatasetInfo",
    "DecodeStats",
    "RandomAccessSource",
    "StreamingSource",
    "cifar_eval_preprocess",
    "cifar_train_preprocess",
    "imagenet_eval_preprocess",
    "imagenet_train_preprocess",
    "load_offline",
    "load_tfds",
    "make_eval_pipeline",
    "make_train_pipeline",
    "train_sampler",
]
