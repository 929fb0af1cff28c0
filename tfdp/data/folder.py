"""Image folders: one subfolder per class, read by index.

Layouts (class folder names are the labels, in sorted order):

    root/train/<class>/*.jpg   [root/test/<class>/...]   [root/validation/<class>/...]
    root/<class>/*.jpg                                    (no train/: all of it is training data)

An index over the files (paths and labels) is random access with no
conversion: Poisson sampling reads each sampled file with `tf.io.read_file`.
Folders smaller than `in_memory_max_bytes` are read into memory once.
"""

import os

import numpy as np
import tensorflow as tf

from tfdp.data import progress as progress_lib
from tfdp.data import sources

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")


class FileSource(sources.ArraySource):
    """Random access over image files: example i is the file `paths[i]`.

    Paths and labels are held in memory; the file of a sampled index is
    read in the tf.data graph and decoded by the preprocessing, so an
    undecodable file is skipped and counted like any encoded image.

    Args:
        paths: np.ndarray. `[N]` file paths (str).
        labels: np.ndarray. `[N]` integer labels.
        info: `DatasetInfo`, optional. Metadata. Defaults to `None`.
    """

    encoded = True

    def __init__(self, paths, labels, info=None):
        super().__init__(np.asarray(paths, dtype=object), labels, info)

    @property
    def paths(self):
        return self.images

    def fetch(self, index):
        """Returns `(encoded_image, label)`: the bytes of file `paths[index]`."""
        paths, labels = self._tensors()
        return tf.io.read_file(tf.gather(paths, index)), tf.gather(labels, index)


def _is_image(name):
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def _subfolders(directory):
    return sorted(
        entry.name for entry in os.scandir(directory)
        if entry.is_dir() and not entry.name.startswith(".")
    )


def list_class_folders(directory, class_names=None):
    """Lists the images of `directory/<class>/`.

    Args:
        directory: str. Folder with one subfolder per class.
        class_names: list, optional. The classes of the training folder;
            the subfolders of an evaluation folder must be among them.
            Defaults to `None` (this is the training folder).

    Returns:
        `(class_names, paths, labels, total_bytes)`, paths sorted per class.
    """
    found = _subfolders(directory)
    if class_names is None:
        if not found:
            raise ValueError(
                f"An image folder needs one subfolder per class. Received: {directory!r} "
                "has no subfolders"
            )
        if len(found) < 2:
            raise ValueError(
                "A classifier needs at least two classes, one subfolder each. "
                f"Received: one class folder {found[0]!r} in {directory!r}"
            )
        class_names = found
    else:
        unknown = sorted(set(found) - set(class_names))
        if unknown:
            raise ValueError(
                f"Class folders of {directory!r} that the training folder does not have. "
                f"Received: {unknown} (training classes: {class_names})"
            )
    paths, labels, total_bytes = [], [], 0
    for label, name in enumerate(class_names):
        folder = os.path.join(directory, name)
        if not os.path.isdir(folder):
            continue  # An evaluation folder may lack a class.
        entries = sorted(
            (e for e in os.scandir(folder) if e.is_file() and _is_image(e.name)),
            key=lambda e: e.name,
        )
        if not entries:
            raise ValueError(
                f"Class folder {folder!r} has no image files; remove it or add images. "
                f"Received: no files ending in {IMAGE_EXTENSIONS}"
            )
        for entry in entries:
            paths.append(entry.path)
            labels.append(label)
            total_bytes += entry.stat().st_size
    return class_names, paths, np.asarray(labels, np.int32), total_bytes


def read_files(paths, desc="reading images"):
    """The bytes of each file, as a `[N]` object array (one pass, progress bar)."""
    encoded = np.empty(len(paths), dtype=object)
    for i, path in enumerate(progress_lib.progress(paths, total=len(paths), desc=desc)):
        with open(path, "rb") as f:
            encoded[i] = f.read()
    return encoded


def class_folder_source(directory, class_names, in_memory_max_bytes):
    """The images of `directory/<class>/` as a source.

    Args:
        directory: str. Folder with one subfolder per class.
        class_names: list or None. The training folder's classes, for an
            evaluation folder; `None` for the training folder itself.
        in_memory_max_bytes: int. At most this many bytes of files are read
            into memory; more are read per index.

    Returns:
        `(class_names, source, how)`: `how` is "in memory" or "file index".
    """
    class_names, paths, labels, total_bytes = list_class_folders(directory, class_names)
    if total_bytes <= in_memory_max_bytes:
        return class_names, sources.ArraySource(read_files(paths), labels), "in memory"
    return class_names, FileSource(paths, labels), "file index"


def load_folder(root, *, in_memory_max_bytes):
    """Reads the layout of an image folder.

    Args:
        root: str. The folder (see the module docstring for layouts).
        in_memory_max_bytes: int. Splits whose files total at most this many
            bytes are read into memory; larger ones are read per index.

    Returns:
        A dict with `train`, `test` and `validation` sources (`None` when
        the folder has no such split), `class_names` and `notes` (str).
    """
    if not os.path.isdir(root):
        raise ValueError(f"Image folder not found. Received: folder={root!r}")
    train_dir = os.path.join(root, "train")
    if not os.path.isdir(train_dir):
        class_names, train, how = class_folder_source(root, None, in_memory_max_bytes)
        return dict(train=train, test=None, validation=None, class_names=class_names,
                    notes=f"{root}: class folders, train {how}")
    class_names, train, how = class_folder_source(train_dir, None, in_memory_max_bytes)
    notes = [f"train/ {how}"]
    held = {}
    for split in ("test", "validation"):
        directory = os.path.join(root, split)
        if os.path.isdir(directory):
            _, held[split], split_how = class_folder_source(directory, class_names,
                                                            in_memory_max_bytes)
            notes.append(f"{split}/ {split_how}")
    if "test" not in held and "validation" in held:
        # Like ImageNet: a published validation split is the test set.
        held["test"] = held.pop("validation")
        notes.append("validation/ is the test set (there is no test/)")
    return dict(train=train, test=held.get("test"), validation=held.get("validation"),
                class_names=class_names, notes=f"{root}: " + ", ".join(notes))
