"""Images that do not decode, dropped from their split when the data is loaded, and named.

`tfdp.data.image_check` decodes every encoded image of your own data once;
this module drops those that failed from their split, names them (a file,
or `record K of <file>`) and words the note of the `data:` line.
"""

import os

import numpy as np

from tfdp.data import image_check
from tfdp.data import validation as validation_lib


def nothing_decodes(split, count, origin):
    """The error for a split none of whose images decodes (counts and where, no image)."""
    return ValueError(
        f"None of the {split} images decodes (JPEG, PNG, BMP, GIF); check the data. "
        f"Received: {count} undecodable images in {origin}")


def _under(path, directory):
    """`path` relative to `directory` when it lies inside it, else `path`."""
    root = os.path.abspath(directory)
    if os.path.isdir(directory) and os.path.commonpath([os.path.abspath(path), root]) == root:
        return os.path.relpath(path, directory)
    return path


def _example_name(source, index, origin):
    """`(name, shown)` of example `index`: its file (or record of a file), and as the notes show it.

    `origin` is the folder or the file pattern the source was read from;
    the notes show names relative to it.
    """
    paths = getattr(source, "paths", None)
    if paths is not None:
        path = str(paths[index])
        return path, _under(path, origin)
    record_files = getattr(source, "record_files", None)
    if record_files is None:
        name = f"record {index} of {origin}"
        return name, name
    files, counts = record_files
    ends = np.cumsum(counts)
    k = int(np.searchsorted(ends, index, side="right"))
    record = index - (int(ends[k - 1]) if k else 0)
    return (f"record {record} of {files[k]}",
            f"record {record} of {_under(files[k], os.path.dirname(origin))}")


def drop_undecodable(given, scans, origins, channels, size):
    """The splits without the images that do not decode, and what the notes say of them.

    Args:
        given: dict. Split -> source or None.
        scans: dict. Split -> `image_check.Scan`, for the encoded sources.
        origins: dict. Split -> the folder or pattern it was read from.
        channels: int. The model's channels.
        size: tuple or None. The size every image is resized to, or None
            (random crops).

    Returns:
        `(sources, dropped, files, note_lines)`: the splits, split -> count
        dropped (for each scanned split), the dropped images' names (paths
        or records) and the lines for the notes.
    """
    kept, dropped, files, shown, shapes = dict(given), {}, [], [], []
    for name, found in scans.items():
        source = given[name]
        bad = np.flatnonzero(~found.ok)
        dropped[name] = int(bad.size)
        if bad.size == len(source):
            raise nothing_decodes(name, len(source), origins[name])
        for index in bad.tolist():
            full, short = _example_name(source, index, origins[name])
            files.append(full)
            shown.append(short)
        if bad.size:
            kept[name] = validation_lib.subset(source, np.flatnonzero(found.ok))
        shapes.append(found.shapes[found.ok])
    lines = []
    if files:
        all_files = all(getattr(given[name], "paths", None) is not None for name in scans)
        lines.append(image_check.dropped_note(
            shown, dropped, sum(len(given[name]) for name in scans), files=all_files))
    if shapes:
        converted = image_check.conversion_note(np.concatenate(shapes), channels, size)
        if converted:
            lines.append(converted)
    return kept, dropped, files, lines
