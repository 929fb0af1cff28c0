"""`load_tfds`: a prepared tfds split as a source, and whether a tfds dataset is prepared.

Nothing is downloaded unless asked. The split comes back in memory (an
`ArraySource`: mnist, fashion_mnist, cifar10, cifar100), read by index
(`RandomAccessSource`, array_record files) or as a stream
(`StreamingSource`, TFRecord files).
"""

import gin
import numpy as np

from tfdp.data import array_source
from tfdp.data import catalog
from tfdp.data import data_source
from tfdp.data import tfds_sources

# Datasets whose train split fits comfortably in host memory (< 200 MB as
# uint8); `load_tfds(access="auto")` keeps these in memory.
SMALL_TFDS = ("mnist", "fashion_mnist", "cifar10", "cifar100")


def not_prepared_error(name, data_dir, builder):
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
    return False, str(not_prepared_error(name, data_dir, builder))


def _tfds_info(builder, name, image_key, label_key):
    features = builder.info.features
    return data_source.DatasetInfo(
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
        access = "in_memory" if name.split("/")[0] in SMALL_TFDS else "random_access_or_streaming"

    if access in ("random_access", "random_access_or_streaming"):
        try:
            split_source = builder.as_data_source(
                split=split, decoders={image_key: tfds.decode.SkipDecoding()}
            )
            return tfds_sources.RandomAccessSource(split_source, info, image_key, label_key)
        except Exception as e:  # tfds raises many types for missing files.
            if not builder.is_prepared():
                raise not_prepared_error(name, data_dir, builder) from e
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
            raise not_prepared_error(name, data_dir, builder) from e
        return tfds_sources.StreamingSource(builder, split, info, image_key, label_key)

    # access == "in_memory"
    try:
        # Encoded bytes: tfds' own decoding would abort the whole load on one
        # corrupt image; `decode_in_memory` decodes with a guard instead.
        ds = builder.as_dataset(
            split=split, decoders={image_key: tfds.decode.SkipDecoding()}
        )
    except AssertionError as e:
        raise not_prepared_error(name, data_dir, builder) from e
    # Chunked reads: `batch_size=-1` aborts the process under tfds mock data.
    images, labels = [], []
    for batch in tfds.as_numpy(ds.batch(4096)):
        images.append(batch[image_key])
        labels.append(batch[label_key])
    images, labels = np.concatenate(images), np.concatenate(labels)
    if images.ndim == 1:  # Encoded (image features); decode once, here.
        images = array_source.decode_in_memory(images, info)
    return array_source.ArraySource(images, labels, info)
