"""The `DataSource` protocol: what every source of examples provides.

A source is what the pipelines (`tfdp.data.train_pipeline`,
`tfdp.data.eval_pipeline`), the held-out splits (`tfdp.data.validation`)
and the duplicate check (`tfdp.data.duplicates`) read. Each kind of data
(`tfdp.data.kinds`) builds its splits as sources of one of the classes
that follow this protocol:

| class | where | access | `labels` | sizes without reading |
|---|---|---|---|---|
| `ArraySource` | arrays or encoded images in memory (npz, small folders and TFRecords, the offline sets, small tfds sets) | random | in memory | yes |
| `FileSource` | image files read by index (large folders) | random | in memory | yes (file sizes) |
| `ArrayRecordSource` | large TFRecords converted to ArrayRecord | random | in memory | no |
| `RandomAccessSource` | tfds array_record splits | random | no | no |
| `StreamingSource` | tfds TFRecord splits | stream | no | no |
| `SubsetSource` | a subset of a random-access source | random | no | the source's |

The protocols are structural (`typing.Protocol`): a source you build by
hand needs no base class, only these members. The pipelines read
`fetch` (random access) or `as_dataset` (a stream); the duplicate check
reads `record_sizes()` and `record(index)` (random access) or `records()`
(a stream, in one pass).
"""

import dataclasses
from typing import Iterator, Optional, Protocol, runtime_checkable

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What the model and trainer need to know about a dataset.

    Args:
        name: str. Dataset name.
        num_classes: int. Number of label classes.
        image_shape: tuple. `(H, W, C)` of the stored images; `H` and `W`
            are `None` for variable-size datasets such as imagenet2012.
    """

    name: str
    num_classes: int
    image_shape: tuple


@runtime_checkable
class DataSource(Protocol):
    """A dataset split: N examples of an image and an integer label.

    Attributes:
        info: `DatasetInfo` or None. The dataset's classes and image shape
            (`num_classes`, `image_shape`); set by `load_dataset`.
        random_access: bool. True: the source is a `RandomAccessDataSource`
            (`fetch(index)` reads any example, which Poisson sampling
            needs). False: a stream, read in order by `as_dataset` (shuffle
            sampling and evaluation only).
        encoded: bool. True when images are scalar `tf.string`s of encoded
            bytes (JPEG, PNG, ...), decoded by the preprocessing; False for
            decoded `[H, W, C]` arrays.

    Optional attributes, read with `getattr(source, name, None)`:
    `labels` (np.ndarray `[N]`, where the labels are in memory: stratified
    splits, class counts and the label check need them; absent where
    reading them means reading every example) and `user_ids` (np.ndarray
    `[N]`, each example's user, for user-level privacy).
    """

    info: Optional[DatasetInfo]
    random_access: bool
    encoded: bool

    def __len__(self) -> int:
        """N: the number of examples (the accountant's N for training data)."""

    def as_dataset(self, *, shuffle=False, seed=0, input_context=None) -> tf.data.Dataset:
        """A dataset of `(image, label)`, every example once.

        Args:
            shuffle: bool. A stream's seeded file order; random-access
                sources ignore it (the samplers draw their indices).
            seed: int. Seed of that order.
            input_context: `tf.distribute.InputContext` or None. This
                host's shard.
        """

    def record_sizes(self) -> Optional[np.ndarray]:
        """Bytes of each example's input, where known without reading it, else None.

        The duplicate check (`tfdp.data.duplicates`) hashes only examples
        whose size another one shares; None hashes every example.
        """

    def records(self) -> Iterator[bytes]:
        """Every example's input bytes in index order, in one sequential read.

        What the duplicate check hashes: an encoded image's bytes, a file's
        bytes, or a decoded array row's raw bytes (so its dtype matters).
        A stream is checked this way, in one pass before training.
        """


@runtime_checkable
class RandomAccessDataSource(DataSource, Protocol):
    """A `DataSource` that reads any example by its index (`random_access = True`).

    A decoded in-memory source may also have `fetch_batch(indices)` (int64
    `[n]` to `(images [n, ...], labels [n])`); the training pipeline then
    reads whole physical batches.
    """

    def fetch(self, index) -> tuple:
        """`(image, label)` of example `index` (a scalar int64 tensor), in the tf.data graph."""

    def record(self, index) -> bytes:
        """The input bytes of example `index` (eager), as `records()` gives them."""


def indexed_dataset(source, input_context=None):
    """`source.fetch` over all indices in order, sharded per input pipeline."""
    indices = tf.data.Dataset.range(len(source))
    if input_context is not None and input_context.num_input_pipelines > 1:
        indices = indices.shard(
            input_context.num_input_pipelines, input_context.input_pipeline_id
        )
    return indices.map(source.fetch, num_parallel_calls=tf.data.AUTOTUNE)


def random_access_records(source):
    """`records()` of a random-access source: `record(i)` for every index in order."""
    return (source.record(i) for i in range(len(source)))
