"""Exact duplicates among the examples of a dataset, found by content hash.

Two examples with the same bytes and the same label are one example given
twice. Kept, they would both move with one record of the data, and the
guarantee would be group privacy for a group of two (ε grows with the
group). So the first of each group is kept and the others are dropped:
then adding or removing one file changes the training set by at most one
example, as the accounting assumes.

Duplicates across splits matter too: a test or validation example that is
also a training example would put that training example into figures
evaluated without noise. Such held-out copies are dropped from the held-out
split.

Within the training data, a duplicate has the same bytes and the same label
(one image under two labels is two examples); a held-out example is
dropped when its bytes are a training example's, whatever its label.

`load_dataset` checks image folders (`folder:` data): there a copied file
is the usual way one example enters twice. Arrays and TFRecords are taken
as given, one example per entry. Only exact copies are found (same
bytes): a re-encoded, resized or cropped copy of an image is another
example to this module.
"""

import hashlib
import os

import numpy as np

from tfdp.data import folder
from tfdp.data import progress as progress_lib
from tfdp.data import sources
from tfdp.data import validation as validation_lib

_CHUNK = 1 << 20


def _sizes(source):
    """Bytes of each example, or `None` for a source whose contents are not at hand."""
    if isinstance(source, folder.FileSource):
        return np.array([os.path.getsize(p) for p in source.paths], np.int64)
    if type(source) is sources.ArraySource:
        if source.encoded:
            return np.array([len(image) for image in source.images], np.int64)
        return np.full(len(source), source.images[0].nbytes, np.int64)
    return None


def _content(source, i):
    if isinstance(source, folder.FileSource):
        digest = hashlib.blake2b(digest_size=16)
        with open(source.paths[i], "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                digest.update(chunk)
        return digest.digest()
    image = source.images[i]
    data = bytes(image) if source.encoded else np.ascontiguousarray(image).tobytes()
    return hashlib.blake2b(data, digest_size=16).digest()


def content_keys(source, sizes, shared_sizes, name):
    """One `(digest, label)` per example: equal digests mean equal bytes.

    Only examples whose size in bytes is in `shared_sizes` are hashed (an
    example of a size of its own has no copy), so a folder is not read in
    full; the others get a digest of their own.

    Args:
        source: An `ArraySource` (arrays or encoded images in memory) or a
            `FileSource` (image files read by index).
        sizes: np.ndarray. `_sizes(source)`.
        shared_sizes: set. Sizes that more than one example has, over every
            split compared.
        name: str. The split's name, which keeps unhashed digests apart.

    Returns:
        A list of `(digest, label)`, one per example.
    """
    need = [i for i, size in enumerate(sizes.tolist()) if size in shared_sizes]
    digests = {i: ("unique", name, i) for i in range(len(sizes))}
    for i in progress_lib.progress(need, total=len(need), desc=f"hashing {name} images") if need else ():
        digests[i] = _content(source, i)
    return [(digests[i], label) for i, label in enumerate(source.labels.tolist())]


def drop_duplicates(train, held_out):
    """Drops repeated training examples, and held-out copies of training examples.

    Args:
        train: The training source.
        held_out: dict of name -> source or `None`: the test and validation
            sources.

    Returns:
        `(train, held_out, dropped)`: the sources without the duplicates and
        a dict of name -> number dropped (`"train"` and each held-out name),
        or the arguments unchanged and an empty dict when the training
        source's contents are not at hand.
    """
    sizes = {"train": _sizes(train)}
    if sizes["train"] is None:
        return train, held_out, {}
    for name, source in held_out.items():
        held_sizes = None if source is None else _sizes(source)
        if held_sizes is not None:
            sizes[name] = held_sizes
    values, counts = np.unique(np.concatenate(list(sizes.values())), return_counts=True)
    shared_sizes = set(values[counts > 1].tolist())
    keys = content_keys(train, sizes["train"], shared_sizes, "train")
    first = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    keep = np.array(sorted(first.values()), np.int64)
    train_digests = {digest for digest, _ in keys}
    dropped = {"train": len(keys) - len(keep)}
    if dropped["train"]:
        train = validation_lib.subset(train, keep)
    kept = {}
    for name, source in held_out.items():
        if name not in sizes:
            kept[name] = source
            continue
        other = content_keys(source, sizes[name], shared_sizes, name)
        fresh = np.array([i for i, (digest, _) in enumerate(other)
                          if digest not in train_digests], np.int64)
        dropped[name] = len(other) - len(fresh)
        if dropped[name] == len(other):
            raise ValueError(
                f"Every {name} example is also a training example: nothing is left to "
                f"evaluate on. Received: {len(other)} {name} examples, all copies"
            )
        kept[name] = validation_lib.subset(source, fresh) if dropped[name] else source
    return train, kept, dropped

