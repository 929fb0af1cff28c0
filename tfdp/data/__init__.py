"""Input pipelines for DP-SGD: sources, samplers and preprocessing."""

from tfdp.data.catalog import CATALOG
from tfdp.data.catalog import catalog_entry
from tfdp.data.datasets import DatasetSplits
from tfdp.data.datasets import load_dataset
from tfdp.data.folder import FileSource
from tfdp.data.decode_guard import DecodeStats
from tfdp.data.eval_pipeline import make_eval_pipeline
from tfdp.data.preprocessing import cifar_eval_preprocess
from tfdp.data.preprocessing import cifar_train_preprocess
from tfdp.data.preprocessing import imagenet_eval_preprocess
from tfdp.data.preprocessing import imagenet_train_preprocess
from tfdp.data.sources import ArraySource
from tfdp.data.sources import DataSource
from tfdp.data.sources import DatasetInfo
from tfdp.data.sources import RandomAccessSource
from tfdp.data.sources import StreamingSource
from tfdp.data.sources import load_offline
from tfdp.data.sources import load_tfds
from tfdp.data.splits import held_out_count
from tfdp.data.tfrecord import ArrayRecordSource
from tfdp.data.train_pipeline import make_train_pipeline
from tfdp.data.train_pipeline import train_sampler
from tfdp.data.validation import SubsetSource
from tfdp.data.validation import split_validation

__all__ = [
    "CATALOG",
    "catalog_entry",
    "ArrayRecordSource",
    "ArraySource",
    "DataSource",
    "DatasetSplits",
    "DatasetInfo",
    "DecodeStats",
    "FileSource",
    "RandomAccessSource",
    "StreamingSource",
    "SubsetSource",
    "cifar_eval_preprocess",
    "cifar_train_preprocess",
    "imagenet_eval_preprocess",
    "held_out_count",
    "imagenet_train_preprocess",
    "load_dataset",
    "load_offline",
    "load_tfds",
    "make_eval_pipeline",
    "make_train_pipeline",
    "split_validation",
    "train_sampler",
]
