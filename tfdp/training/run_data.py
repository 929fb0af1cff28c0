"""The trainer's data stage: the splits of `DataConfig.dataset`, read once and logged."""

import dataclasses

from tfdp import data as data_lib
from tfdp.data import sources
from tfdp.training import reporting


@dataclasses.dataclass(frozen=True)
class RunData:
    """What a run trains and evaluates on.

    Args:
        train: The training source, or (a dry run of a catalog dataset)
            its size.
        validation: The validation source held out of the training data,
            or None.
        test: The test source, or None in a dry run.
        info: `tfdp.data.DatasetInfo`.
        train_preprocess: `fn(image, seed)` or None (the default).
        eval_preprocess: `fn(image)` or None (the default).
        held_out: dict. Split name -> size, for the splits held out of the
            training data: private examples evaluated without noise.
        duplicates_dropped: dict. Exact duplicates dropped, per split.
        duplicates_kept: `tfdp.data.duplicates.KeptCopies` or None. Copies
            trained on as distinct records (`DataConfig.duplicates="keep"`).
        undecodable_dropped: dict. Image files that do not decode, dropped
            when the data was loaded, per split as given ("train" before
            any hold-out).
    """

    train: object
    validation: object
    test: object
    info: data_lib.DatasetInfo
    train_preprocess: object = None
    eval_preprocess: object = None
    held_out: dict = dataclasses.field(default_factory=dict)
    duplicates_dropped: dict = dataclasses.field(default_factory=dict)
    duplicates_kept: object = None
    undecodable_dropped: dict = dataclasses.field(default_factory=dict)

    @property
    def train_size(self):
        """Training examples."""
        return self.train if isinstance(self.train, int) else len(self.train)

    def preparation(self):
        """`summary.json`'s `data_preparation`: what each split holds and what was dropped."""
        return {
            "train_examples": self.train_size,
            "validation_examples": len(self.validation or []),
            "test_examples": len(self.test) if self.test is not None else 0,
            "undecodable_dropped": dict(self.undecodable_dropped),
        }


def load_run_data(config, *, seed, dry_run, report_non_dp_statistics, privacy_unit="example"):
    """The splits of `config.dataset` (`tfdp.data.load_dataset`), with the data lines logged.

    A dry run of a tfds catalog dataset reads no data: it runs on mock data of
    the catalog's shapes, and says whether the real run would find its data.

    Args:
        config: `tfdp.training.DataConfig`. The dataset, its directory, the
            validation fraction and the test set.
        seed: int. The public seed of the splits.
        dry_run: bool. Mock data of a catalog dataset's shapes.
        report_non_dp_statistics: bool. Log the class counts and other
            figures not covered by epsilon.
        privacy_unit: str. "example" or "user": decides which exact
            duplicates of `npz:` and `tfrecord:` data are refused
            (`tfdp.data.duplicates`). Defaults to "example".
    """
    dataset, data_dir = config.dataset, config.data_dir
    validation_fraction = config.validation_fraction
    # The offline datasets load in a moment, with their `load_dataset` options
    # (e.g. `image_size`) applied: a dry run reads them.
    if dry_run and dataset in data_lib.CATALOG and dataset not in sources.OFFLINE_DATASETS:
        prepared, message = sources.tfds_preparation_status(dataset, data_dir)
        reporting.log(f"dry run: data {'OK' if prepared else 'NOT READY'}: {message}")
        entry = data_lib.catalog_entry(dataset)
        n = entry.train_size - data_lib.held_out_count(entry.train_size, validation_fraction)
        return RunData(train=n, validation=None, test=None,
                       info=data_lib.DatasetInfo(dataset, entry.num_classes, entry.image_shape))
    loaded = data_lib.load_dataset(dataset, data_dir=data_dir, seed=seed,
                                   validation_fraction=validation_fraction,
                                   test_dataset=config.test_dataset,
                                   privacy_unit=privacy_unit,
                                   duplicates=config.duplicates)
    held_out = {name: len(getattr(loaded, name)) for name in ("test", "validation")
                if getattr(loaded, f"{name}_held_out")}
    reporting.data_lines(
        loaded.notes, n=len(loaded.train), validation_size=len(loaded.validation or []),
        test_size=len(loaded.test), info=loaded.info, class_counts=loaded.class_counts,
        report_non_dp_statistics=report_non_dp_statistics, held_out=held_out,
        duplicates_dropped=loaded.duplicates_dropped,
    )
    return RunData(
        train=loaded.train, validation=loaded.validation, test=loaded.test, info=loaded.info,
        train_preprocess=loaded.train_preprocess, eval_preprocess=loaded.eval_preprocess,
        held_out=held_out, duplicates_dropped=dict(loaded.duplicates_dropped),
        duplicates_kept=loaded.duplicates_kept,
        undecodable_dropped=dict(loaded.undecodable_dropped),
    )
