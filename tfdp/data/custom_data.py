"""Your own images (`folder:`, `tfrecord:`, `npz:`): what every such kind does once it has read its files.

A kind of your own data (`ImageDataKind`) only reads: its `read` gives the
splits as found (`Read`), its `load_test` a separate test set. The rest is
the same for all of them and lives here (`load_own_data`): the label
check, one decode of every encoded image (undecodable ones dropped and
named), exact duplicates (dropped from folders, refused elsewhere), the
model input's size and channels, one decode into memory where it pays, and
the test set held out of the training data when there is none.

Test sets and epsilon: a test set apart from the training data is
evaluated without noise and says nothing about the training examples; one
held out of the given training data (`test_fraction`) is private data
released without noise, and `DatasetSplits.test_held_out` says so.
"""

import dataclasses

import numpy as np

from tfdp import validation
from tfdp.data import data_source
from tfdp.data import dataset_splits
from tfdp.data import duplicates
from tfdp.data import image_check
from tfdp.data import image_options
from tfdp.data import registry
from tfdp.data import splits
from tfdp.data import undecodable
from tfdp.data import validation as validation_lib


@dataclasses.dataclass
class Read:
    """The splits of your own data as found, before any check.

    Args:
        train: The training source (labels in memory).
        test: The data's own test source, or None.
        validation: The data's own validation source, or None.
        notes: str. How the data was read (for the log).
        origins: dict. Split -> the folder or pattern it was read from, to
            name an undecodable image; a split not given is the location.
        class_names: list or None. A folder's classes (its labels' names).
    """

    train: object
    test: object = None
    validation: object = None
    notes: str = ""
    origins: dict = dataclasses.field(default_factory=dict)
    class_names: list = None


class ImageDataKind(registry.DatasetKind):
    """A kind of your own data: labelled images or arrays, read and then checked here.

    Class attributes:
        drops_duplicates: bool. True: copies of a training example are
            dropped, the first of each group kept (files: each is an
            example of its own). False: training data with copies is
            refused, with the count (arrays and records are taken as given:
            which copy to keep is the owner's call).
    """

    drops_duplicates = False

    def read(self, location, options):
        """The splits as found (`Read`); `options.test_dataset` set means no test files are looked for."""
        raise NotImplementedError

    def load(self, location, options):
        return load_own_data(self, location, options)


def check_labels(splits_by_name, num_classes):
    """`num_classes`, checked against the labels of every split by the engine's rule.

    Each split's labels must be class indices in `[0, num_classes)`
    (`tfdp.validation.validate_labels`, the rule of every route), and the
    training labels must hold two classes at least. The errors count
    labels; they never show one, since labels are private.

    Args:
        splits_by_name: dict. Split -> source with `labels`, or None.
        num_classes: int or None. None: the largest training label + 1.

    Returns:
        The number of classes.

    Raises:
        ValueError: for a label outside `[0, num_classes)` or training data
            of a single class.
    """
    train_labels = splits_by_name["train"].labels
    if num_classes is None:
        # At least 1, so that negative labels are counted as such below.
        num_classes = max(int(train_labels.max()) + 1, 1)
    for name, source in splits_by_name.items():
        if source is None:
            continue
        try:
            validation.validate_labels(source.labels, num_classes, name=f"{name} labels")
        except ValueError as error:
            raise ValueError(
                "Every label must name one of load_dataset.num_classes classes (set it if the "
                f"training labels miss a class): {error}") from None
    present = np.unique(train_labels).size
    if present < 2:
        raise ValueError(
            "A classifier needs at least two classes in the training data. "
            f"Received: {train_labels.size} training labels, all of {present} class"
        )
    return num_classes


def _test_dataset(test_dataset, kind, class_names, options):
    """`(source, notes, origin)` of `test_dataset`, a test set apart from the training data."""
    test_kind, location = registry.lookup(test_dataset)
    if not (test_kind.prefixed and isinstance(test_kind, ImageDataKind)):
        raise ValueError(f"`test_dataset` takes the forms {registry.forms()}. Received: "
                         f"test_dataset={test_dataset!r}")
    source, notes = test_kind.load_test(location, options, kind, class_names)
    return source, notes, location


def load_own_data(kind, location, options):
    """The `DatasetSplits` of your own data of kind `kind` (see the module docstring).

    Args:
        kind: `ImageDataKind`.
        location: str. The folder, pattern or file.
        options: `registry.LoadOptions`.
    """
    # Before any file is read: the images are decoded once below.
    image_options.check_preprocessing(options.preprocessing)
    found = kind.read(location, options)
    train, test, validation, notes = found.train, found.test, found.validation, found.notes
    # Where each split's images come from, to name an undecodable one.
    origins = {**dict.fromkeys(("train", "test", "validation"), location), **found.origins}
    num_classes = options.num_classes
    if num_classes is None and found.class_names is not None:
        num_classes = len(found.class_names)
    if options.test_dataset is not None:
        if test is not None:
            raise ValueError(
                f"{kind.name}:{location} has a test split of its own; set either it or "
                f"test_dataset. Received: test_dataset={options.test_dataset!r}"
            )
        test, test_notes, origins["test"] = _test_dataset(
            options.test_dataset, kind, found.class_names, options)
        notes += f"; test: test_dataset {test_notes}"
    given = {"train": train, "test": test, "validation": validation}
    # Labels first: a wrong one is an error before any image is decoded.
    num_classes = check_labels(given, num_classes)
    with image_check.decoder_messages_held_back():
        scans = {name: image_check.scan(source, desc=f"checking {name} images")
                 for name, source in given.items()
                 if source is not None and source.encoded}
        if "train" in scans:
            if not scans["train"].ok.any():
                raise undecodable.nothing_decodes("train", len(train), origins["train"])
            shape = scans["train"].first_shape()
        else:
            shape = image_options.first_image_shape(train)
        size, channels = image_options.image_options(
            shape, train.encoded, options.image_size, options.channels)
        for name, scanned in scans.items():
            scanned.ok = image_check.check_channels(given[name], scanned, channels,
                                                    desc=f"checking {name} images")
    given, undecodable_dropped, bad_files, check_notes = undecodable.drop_undecodable(
        given, scans, origins, channels, size if options.preprocessing == "resize" else None)
    train, test, validation = given["train"], given["test"], given["validation"]
    notes += "".join(f"; {line}" for line in check_notes)
    dropped = {}
    kept_copies = None
    if options.duplicates == duplicates.KEEP:
        kept_copies = duplicates.check_source(
            train, where=f"{kind.name}:{location} (training data)",
            by_user=options.privacy_unit == "user", policy=duplicates.KEEP)
    elif kind.drops_duplicates:
        train, held_out, dropped = duplicates.drop_duplicates(
            train, {"test": test, "validation": validation})
        test, validation = held_out["test"], held_out["validation"]
    else:
        duplicates.check_source(train, where=f"{kind.name}:{location} (training data)",
                                by_user=options.privacy_unit == "user")
    if dropped or any(undecodable_dropped.values()):
        # What is left must still be a classification problem.
        check_labels({"train": train, "test": test, "validation": validation}, num_classes)
    image_shape = (size + (channels,)) if size is not None else shape
    info = data_source.DatasetInfo(
        name=f"{kind.name}:{location}", num_classes=num_classes, image_shape=image_shape
    )
    train, test, validation = (
        None if source is None
        else image_options.decoded_once(source, info, options.preprocessing, size)
        for source in (train, test, validation)
    )
    test_held_out = test is None
    if test_held_out:
        fraction = options.test_fraction
        kept, held = splits.held_out_split(train, fraction, options.seed)
        train, test = validation_lib.subset(train, kept), validation_lib.subset(train, held)
        how = (f"{fraction:g} of the users" if getattr(train, "user_ids", None) is not None
               else f"a stratified {fraction:g}")
        notes += f"; test: {how} held out of the training data"
    train_pre, eval_pre = image_options.own_preprocessing(options.preprocessing, size, channels)
    return dataset_splits.DatasetSplits(
        train, validation, test, info, train_pre, eval_pre, notes, test_held_out=test_held_out,
        duplicates_dropped=dropped, duplicates_kept=kept_copies,
        undecodable_dropped=undecodable_dropped,
        undecodable_files=bad_files)
