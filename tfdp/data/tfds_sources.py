"""Sources over a prepared tfds split: random access (array_record) or a stream (TFRecord).

Both follow `tfdp.data.data_source.DataSource` and hold encoded images,
decoded in the tf.data graph. `tfdp.data.tfds_loading.load_tfds` picks one.
"""

import numpy as np
import tensorflow as tf

from tfdp.data import data_source as data_source_lib

# Encoded images read per batch by `StreamingSource.records`.
_RECORDS_BATCH = 1024


class RandomAccessSource:
    """A tfds split read by index through `tfds.data_source` (array_record).

    Images are returned as encoded bytes and decoded in the tf.data graph,
    where decoding runs in parallel without the Python GIL.

    Args:
        data_source: Sequence. A tfds random-access data source built with
            `decoders={image_key: tfds.decode.SkipDecoding()}`.
        info: `DatasetInfo`. Metadata.
        image_key: str. Feature name of the image. Defaults to `"image"`.
        label_key: str. Feature name of the label. Defaults to `"label"`.
    """

    random_access = True
    encoded = True

    def __init__(self, data_source, info, image_key="image", label_key="label"):
        self.data_source = data_source
        self.info = info
        self.image_key = image_key
        self.label_key = label_key

    def __len__(self):
        return len(self.data_source)

    @property
    def size(self):
        return len(self)

    def _example(self, index):
        example = self.data_source[int(index)]
        image = example[self.image_key]
        if not isinstance(image, bytes):
            raise ValueError(
                "RandomAccessSource expects encoded image bytes; build the data "
                "source with decoders={image_key: tfds.decode.SkipDecoding()}. "
                f"Received: type(image)={type(image)}"
            )
        return image, example[self.label_key]

    def _py_fetch(self, index):
        image, label = self._example(index)
        return image, np.int32(label)

    def record_sizes(self):
        """None: an example's size is known only by reading it."""
        return None

    def record(self, index):
        """The encoded image of example `index`, as bytes."""
        return self._example(index)[0]

    def records(self):
        """Every example's encoded image, in index order."""
        return data_source_lib.random_access_records(self)

    def fetch(self, index):
        """Returns `(encoded_image, label)` of example `index`."""
        image, label = tf.numpy_function(
            self._py_fetch, [index], [tf.string, tf.int32], stateful=False
        )
        image.set_shape([])
        label.set_shape([])
        return image, label

    def as_dataset(self, *, shuffle=False, seed=0, input_context=None):
        """Returns a dataset of `(encoded_image, label)` in index order."""
        del shuffle, seed
        return data_source_lib.indexed_dataset(self, input_context)


class StreamingSource:
    """A tfds split read sequentially (TFRecord), without random access.

    Supports `sampler="shuffle"` (shuffle buffer) and evaluation; Poisson
    sampling needs a random-access source.

    Args:
        builder: `tfds.core.DatasetBuilder`. A prepared builder.
        split: str. Split name.
        info: `DatasetInfo`. Metadata.
        image_key: str. Feature name of the image. Defaults to `"image"`.
        label_key: str. Feature name of the label. Defaults to `"label"`.
        num_examples: int, optional. Size of the split, when known (a
            slice's). Defaults to `None` (from the tfds metadata).
    """

    random_access = False
    encoded = True

    def __init__(self, builder, split, info, image_key="image", label_key="label",
                 num_examples=None):
        self.builder = builder
        self.split = split
        self.info = info
        self.image_key = image_key
        self.label_key = label_key
        self.num_examples = num_examples

    def __len__(self):
        if self.num_examples is not None:
            return self.num_examples
        splits = self.builder.info.splits
        if self.split in splits:
            return int(splits[self.split].num_examples)
        # Split metadata can be missing (e.g. under tfds mock data); tfds
        # datasets still carry their cardinality.
        cardinality = int(self.builder.as_dataset(split=self.split).cardinality())
        if cardinality < 0:
            raise ValueError(
                f"The size of split {self.split!r} is unknown. Received: "
                f"splits={list(splits.keys())}"
            )
        return cardinality

    @property
    def size(self):
        return len(self)

    def slice(self, start, stop):
        """Examples `[start, stop)` of the split, as a tfds sub-split source."""
        start, stop, _ = slice(start, stop).indices(len(self))
        return StreamingSource(
            self.builder, f"{self.split}[{start}:{stop}]", self.info, self.image_key,
            self.label_key, num_examples=max(stop - start, 0),
        )

    def record_sizes(self):
        """None: an example's size is known only by reading it."""
        return None

    def records(self):
        """Every example's encoded image, in one sequential read of the split's files."""
        images = self.as_dataset().map(lambda image, label: image)
        for batch in images.batch(_RECORDS_BATCH).as_numpy_iterator():
            yield from (bytes(image) for image in batch)

    def as_dataset(self, *, shuffle=False, seed=0, input_context=None):
        """Returns a dataset of `(encoded_image, label)`.

        Args:
            shuffle: bool. Shuffle the file order (seeded). Defaults to `False`.
            seed: int. Seed of the file shuffle. Defaults to `0`.
            input_context: `tf.distribute.InputContext`, optional. Reads this
                host's shard of the files. Defaults to `None`.
        """
        import tensorflow_datasets as tfds

        read_config = tfds.ReadConfig(
            shuffle_seed=seed if shuffle else None,
            input_context=input_context,
            # Exact resume replays the stream, so file interleaving must be
            # deterministic.
            interleave_cycle_length=16,
        )
        ds = self.builder.as_dataset(
            split=self.split,
            shuffle_files=shuffle,
            read_config=read_config,
            decoders={self.image_key: tfds.decode.SkipDecoding()},
        )
        image_key, label_key = self.image_key, self.label_key
        return ds.map(
            lambda ex: (ex[image_key], tf.cast(ex[label_key], tf.int32)),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
