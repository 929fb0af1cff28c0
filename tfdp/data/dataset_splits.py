"""`DatasetSplits`: what `load_dataset` returns, the sources of one dataset and how they were read."""

import dataclasses

import numpy as np

from tfdp.data import data_source


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
            empty for data other than `folder:` (`tfrecord:`, `npz:` and
            tfds training data with copies is refused instead).
        duplicates_kept: `tfdp.data.duplicates.KeptCopies` or None. Under
            `duplicates="keep"`, the exact copies trained on as distinct
            records (counts not covered by ε).
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
    info: data_source.DatasetInfo
    train_preprocess: object = None
    eval_preprocess: object = None
    notes: str = ""
    test_held_out: bool = False
    validation_held_out: bool = False
    duplicates_dropped: dict = dataclasses.field(default_factory=dict)
    duplicates_kept: object = None
    undecodable_dropped: dict = dataclasses.field(default_factory=dict)
    undecodable_files: list = dataclasses.field(default_factory=list)

    def class_counts(self, split="train"):
        """Examples per class of a split whose labels are in memory, else `None`."""
        source = getattr(self, split)
        labels = getattr(source, "labels", None)
        if labels is None:
            return None
        return np.bincount(labels, minlength=self.info.num_classes).tolist()
