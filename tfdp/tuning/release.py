"""The release of a private selection, written so that nothing in it tells when it was made.

The selection's ε holds for the selected trial alone while K, the number of
trials, stays secret. Anything in the release that depended on when the
selected trial ran, or on the trials after it, would bound K: the file
times of the trial's outputs, the save time that Keras records in
`model.keras` (`date_saved` in its `metadata.json`, and its zip entries'
times), the trial's wall time in `summary.json`, or a `selection.json`
written after the last trial. So `write_release` writes the whole release
once, after every trial, into a staging directory that is then renamed into
place; copies in a fixed order (sorted names); rewrites the Keras archive
with fixed entry times and a fixed `date_saved`; drops the wall time from
the summary; and gives every released file and directory the same mtime and
atime, `RELEASE_TIME`.

What no program sets: a file's change time (ctime) and its inode number,
which show when the release was written, at the end of the selection, so
they grow with K like its running time. Share the files (their bytes, names
and mtimes, e.g. `tar --format=gnu`, which records mtimes only), not the
file system they were written to.
"""

import json
import os
import shutil
import zipfile

# What a selection releases from the selected trial's workdir: the model and
# the figures of that run; never its checkpoints (the secret key), logs or
# TensorBoard files, which name the trial's directory and so its index.
RELEASED_FILES = ("model.keras", "saved_model", "summary.json", "config.gin",
                  "operative_config.gin")
# Every released file's and directory's mtime and atime: 1980-01-01 00:00:00
# UTC, the earliest time a zip entry can record, so the archive's entries
# and the files agree.
RELEASE_TIME = 315532800
RELEASE_ZIP_TIME = (1980, 1, 1, 0, 0, 0)
# Keras' `date_saved` format ("%Y-%m-%d@%H:%M:%S") at RELEASE_TIME.
RELEASE_DATE_SAVED = "1980-01-01@00:00:00"
# Summary fields that time the trial: its wall time depends on what ran
# before it (caches warmed by earlier trials, the machine's load).
TIMING_FIELDS = ("wall_time_s",)
SELECTION_RECORD = "selection.json"


def write_release(trial_workdir, destination, record):
    """Writes the selected trial's `RELEASED_FILES` and `record` into `destination`.

    Call it once, after every trial: what it writes depends on the selected
    trial's outputs and on `record` only, never on when they were made.

    Args:
        trial_workdir: str. The selected trial's workdir.
        destination: str. The release's directory; must not exist.
        record: dict. The public record, written as `selection.json`.
    """
    if os.path.lexists(destination):
        raise ValueError(
            "A selection's release is written once, into a new directory. "
            f"Received: destination={destination!r} exists")
    staging = destination + ".partial"
    os.makedirs(staging)
    for name in RELEASED_FILES:
        source, target = os.path.join(trial_workdir, name), os.path.join(staging, name)
        if name == "model.keras" and zipfile.is_zipfile(source):
            _rewrite_keras_archive(source, target)
        elif name == "summary.json" and os.path.isfile(source):
            _write_summary(source, target)
        elif os.path.isdir(source):
            _copy_tree(source, target)
        elif os.path.isfile(source):
            _copy_file(source, target)
    with open(os.path.join(staging, SELECTION_RECORD), "w") as f:
        json.dump(record, f, indent=2)
    # The release appears whole, or not at all.
    os.rename(staging, destination)
    _set_release_times(destination)


def _copy_file(source, target):
    # Bytes and permission bits only: no times, no extended attributes.
    shutil.copyfile(source, target)
    shutil.copymode(source, target)


def _copy_tree(source, target):
    os.makedirs(target)
    for name in sorted(os.listdir(source)):
        path = os.path.join(source, name)
        if os.path.isdir(path):
            _copy_tree(path, os.path.join(target, name))
        elif os.path.isfile(path):
            _copy_file(path, os.path.join(target, name))


def _write_summary(source, target):
    with open(source) as f:
        summary = json.load(f)
    for name in TIMING_FIELDS:
        summary.pop(name, None)
    with open(target, "w") as f:
        json.dump(summary, f, indent=2)  # As the trainer writes it.


def _rewrite_keras_archive(source, target):
    """`source` with every entry at `RELEASE_ZIP_TIME` and Keras' `date_saved` at its fixed value.

    The entries keep their order, names, bytes (but metadata.json's
    `date_saved`), compression and permissions; extra fields, which may
    hold times, are dropped.
    """
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        new.comment = old.comment
        for info in old.infolist():
            fixed = zipfile.ZipInfo(info.filename, date_time=RELEASE_ZIP_TIME)
            fixed.compress_type = info.compress_type
            fixed.external_attr = info.external_attr
            fixed.create_system = info.create_system
            if info.filename == "metadata.json":
                new.writestr(fixed, _fixed_metadata(old.read(info)))
            elif info.is_dir():
                new.writestr(fixed, b"")
            else:
                fixed.file_size = info.file_size  # Sets zip64 as the source's size needs.
                with old.open(info) as src, new.open(fixed, "w") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)


def _fixed_metadata(data):
    metadata = json.loads(data)
    if isinstance(metadata, dict) and "date_saved" in metadata:
        metadata["date_saved"] = RELEASE_DATE_SAVED
    return json.dumps(metadata)  # As Keras writes it.


def _set_release_times(root):
    # Children first: setting a file's times leaves its directory's alone.
    for directory, dirs, files in os.walk(root, topdown=False):
        for name in files + dirs:
            os.utime(os.path.join(directory, name), (RELEASE_TIME, RELEASE_TIME),
                     follow_symlinks=False)
    os.utime(root, (RELEASE_TIME, RELEASE_TIME))
