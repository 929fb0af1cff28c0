"""Image folders: one subfolder per class, read by index.

Layouts (class folder names are the labels, in sorted order):

    root/train/<class>/*.jpg   [root/test/<class>/...]   [root/validation/<class>/...]
    root/<class>/*.jpg                                    (no train/: all of it is training data)

For user-level privacy (`PrivacyConfig.privacy_unit = 'user'`), `root/users.csv`
names the user of every training image: a header line `path,user`, then
one line per file, its path relative to `root` (`train/cat/001.jpg`, or
`cat/001.jpg` without `train/`) and any user name or number. Files of the
test and validation folders may be listed too; they are not trained on.

An index over the files (paths and labels) is random access with no
conversion: Poisson sampling reads each sampled file with `tf.io.read_file`.
Folders smaller than `in_memory_max_bytes` are read into memory once.
Either way the source's `paths` name its files: `load_dataset` decodes
each file once (`tfdp.data.image_check`) and drops, and names, those that
do not decode.
"""

import csv
import os

import numpy as np
import tensorflow as tf

from tfdp.data import array_source
from tfdp.data import progress as progress_lib

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
# The file of an image folder that names each training image's user.
USERS_FILE = "users.csv"


class FileSource(array_source.ArraySource):
    """Random access over image files: example i is the file `paths[i]`.

    Paths and labels are held in memory; the file of a sampled index is
    read in the tf.data graph and decoded by the preprocessing.
    `load_dataset` has dropped the files that do not decode; one that
    breaks later is skipped (weight 0) and counted like any encoded image.

    Args:
        paths: np.ndarray. `[N]` file paths (str).
        labels: np.ndarray. `[N]` integer labels.
        info: `DatasetInfo`, optional. Metadata. Defaults to `None`.
        user_ids: np.ndarray, optional. `[N]` integers, the user of each
            file (`ArraySource`). Defaults to `None`.
    """

    encoded = True

    def __init__(self, paths, labels, info=None, user_ids=None):
        super().__init__(np.asarray(paths, dtype=object), labels, info, user_ids=user_ids)

    @property
    def paths(self):
        return self.images

    def fetch(self, index):
        """Returns `(encoded_image, label)`: the bytes of file `paths[index]`."""
        paths, labels = self._tensors()
        return tf.io.read_file(tf.gather(paths, index)), tf.gather(labels, index)

    def record_sizes(self):
        """Bytes of each file, from the file system (no file is read)."""
        return np.array([os.path.getsize(path) for path in self.paths], np.int64)

    def record(self, index):
        """The bytes of file `paths[index]`."""
        with open(self.paths[index], "rb") as f:
            return f.read()


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


def read_users(csv_path, root, paths):
    """The user of each of `paths`, from a `path,user` CSV file.

    Args:
        csv_path: str. The CSV file: a header `path,user`, then one line per
            image, its path relative to `root`.
        root: str. The folder the CSV's paths are relative to.
        paths: list of str. The training images, each of which must be listed.

    Returns:
        `[N]` int64 user ids (users numbered in sorted order of their names).

    Raises:
        ValueError: for a bad header, a listed file that does not exist, or
            a training image that the file does not list.
    """
    with open(csv_path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows or [c.strip() for c in rows[0]] != ["path", "user"]:
        raise ValueError(
            f"{csv_path} must start with the header line 'path,user'. Received: "
            f"{','.join(rows[0]) if rows else 'an empty file'!r}")
    user_of, missing = {}, []
    for line, row in enumerate(rows[1:], start=2):
        if not row or not "".join(row).strip():
            continue
        if len(row) != 2 or not row[1].strip():
            raise ValueError(f"Each line of {csv_path} is 'path,user'. Received: line {line} "
                             f"{','.join(row)!r}")
        path = os.path.normpath(os.path.join(root, row[0].strip()))
        if not os.path.isfile(path):
            missing.append(row[0])
        user_of[path] = row[1].strip()
    if missing:
        raise ValueError(f"{csv_path} lists {len(missing)} files that do not exist. "
                         f"Received: {missing[:3]}")
    unlisted = [p for p in paths if os.path.normpath(p) not in user_of]
    if unlisted:
        raise ValueError(
            f"Under user-level privacy every training image needs its user: {csv_path} does "
            f"not list {len(unlisted)} of the {len(paths)} training images. Received: "
            f"{[os.path.relpath(p, root) for p in unlisted[:3]]}")
    names = [user_of[os.path.normpath(p)] for p in paths]
    _, ids = np.unique(np.asarray(names, dtype=object).astype(str), return_inverse=True)
    return ids.astype(np.int64)


def class_folder_source(directory, class_names, in_memory_max_bytes, users_csv=None,
                        users_root=None):
    """The images of `directory/<class>/` as a source.

    Args:
        directory: str. Folder with one subfolder per class.
        class_names: list or None. The training folder's classes, for an
            evaluation folder; `None` for the training folder itself.
        in_memory_max_bytes: int. At most this many bytes of files are read
            into memory; more are read per index.
        users_csv: str or None. A `path,user` file (`read_users`) naming
            the user of every image. Defaults to None (no users).
        users_root: str or None. The folder its paths are relative to.
            Defaults to `directory`.

    Returns:
        `(class_names, source, how)`: `how` is "in memory" or "file index".
        The source's `paths` are its files (an in-memory source's too,
        until it is subset).
    """
    class_names, paths, labels, total_bytes = list_class_folders(directory, class_names)
    user_ids = (None if users_csv is None else
                read_users(users_csv, users_root or directory, paths))
    if total_bytes <= in_memory_max_bytes:
        source = array_source.ArraySource(read_files(paths), labels, user_ids=user_ids)
        # Names a file that does not decode (`load_dataset`'s check); a subset
        # of the bytes has no need of it.
        source.paths = np.asarray(paths, dtype=object)
        return class_names, source, "in memory"
    return class_names, FileSource(paths, labels, user_ids=user_ids), "file index"


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
    users_csv = os.path.join(root, USERS_FILE)
    users_csv = users_csv if os.path.isfile(users_csv) else None
    users_note = f", users from {USERS_FILE}" if users_csv else ""
    train_dir = os.path.join(root, "train")
    if not os.path.isdir(train_dir):
        class_names, train, how = class_folder_source(root, None, in_memory_max_bytes,
                                                      users_csv, root)
        return dict(train=train, test=None, validation=None, class_names=class_names,
                    notes=f"{root}: class folders, train {how}{users_note}")
    class_names, train, how = class_folder_source(train_dir, None, in_memory_max_bytes,
                                                  users_csv, root)
    notes = [f"train/ {how}{users_note}"]
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
