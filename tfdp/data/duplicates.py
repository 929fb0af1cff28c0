"""Exact duplicates among the examples of a dataset, found by content hash.

Two examples with the same input bytes are one example given twice: kept,
they would both move with one record of the data, and the guarantee would
be group privacy for a group of two (ε grows with the group). The label
plays no part: one image under two labels is still one person's image
twice. The same digest (BLAKE2b of the input's bytes: a file's bytes, an
encoded image, or an array row's raw bytes) serves every route:

* image folders (`folder:` data, `drop_duplicates`): a copied file is the
  usual way one example enters twice, and files are examples of their
  own, so the first of each group of copies is kept and the others are
  dropped before N is counted;
* arrays and records given as they are (`npz:`, `tfrecord:` and tfds data
  in the trainer, arrays and streams given to a private Keras model's
  `fit`): copies are refused (`check_source`, `check_rows`, `CopyCounter`),
  with their count, since which row to keep is the data owner's call;
  deduplicate the data, or train at user level.

Sources are read through the `tfdp.data.data_source.DataSource` protocol:
`record_sizes()` (only examples of a shared size are hashed), `record(i)`
by index, or `records()` in one sequential read for a stream (a tfds split
without random access), before training.

Under user-level privacy (rows with user ids, trained with
`privacy_unit='user'`), copies held by one user are that user's data and
fine: ε covers the user's rows together. Copies held by different users
still count: one image shared by two users would move with either. The
folder route drops such copies like any other.

Duplicates across splits matter too: a test or validation example that is
also a training example would put that training example into figures
evaluated without noise. Such held-out copies of folder data are dropped
from the held-out split.

Only exact copies are found (same bytes): a re-encoded, resized or cropped
copy of an image, or a float row rounded differently, is another example
to this module.

Distinct records may share their content (two patients' blank scans, a
default avatar). Where the data owner knows that each row is its own
record, `duplicates="keep"` (`policy=KEEP` here) trains on them: nothing
is refused, and the check returns a `KeptCopies` (the count of copies and
the largest group of identical rows) for the route to print beside the
group ε of that group: what ε would be if those rows were one record
after all. The default stays `"refuse"`.
"""

import dataclasses
import hashlib

import numpy as np

from tfdp import validation
from tfdp.data import progress as progress_lib
from tfdp.data import validation as validation_lib

_DIGEST_BYTES = 16
# What to do about copies, unless the caller names what suits its data.
DEDUPLICATE = (
    "Deduplicate the data (keep one row of each group of copies), or train at user level "
    "(privacy_unit='user' with each row's user) so that copies held by one user count as "
    "that user's data. If each copy is a distinct record that happens to share its "
    "content, pass duplicates='keep'.")


REFUSE, KEEP = validation.DUPLICATES_POLICIES
POLICIES = validation.DUPLICATES_POLICIES
# `duplicates` checked: "refuse" (the default) or "keep".
validate_policy = validation.validate_duplicates


@dataclasses.dataclass(frozen=True)
class KeptCopies:
    """Exact copies that `duplicates="keep"` trained on, as distinct records.

    Counts of the private data, released without noise: not covered by ε.

    Args:
        copies: int. Rows whose content an earlier row had.
        rows: int. The rows compared.
        largest_group: int. The most rows that share one content (k >= 2).
    """

    copies: int
    rows: int
    largest_group: int

    def describe(self, where):
        """One line: the counts, and what keeping them means."""
        return (f"{where}: kept {self.copies} rows that repeat another row's content among "
                f"{self.rows} (duplicates='keep'; the largest group holds "
                f"{self.largest_group} identical rows): ε holds for each row as its own "
                "record. These counts are not covered by ε.")

    def to_dict(self):
        return {"copies": self.copies, "rows": self.rows,
                "largest_group": self.largest_group, "covered_by_epsilon": False}


def digest(data):
    """The content digest of one example's bytes (BLAKE2b, 16 bytes).

    Args:
        data: bytes-like. An encoded image, or a C-contiguous array.
    """
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()


def row_digests(rows):
    """The content digest of each row of an array, from its raw bytes.

    Args:
        rows: np.ndarray `[n, ...]` of numbers (each row's bytes, so the
            dtype matters: a uint8 row and its float32 copy differ), or
            `[n]` objects that are bytes (encoded images).

    Returns:
        A list of n digests; equal digests mean equal bytes.
    """
    rows = np.asarray(rows)
    if rows.dtype == object:
        return [digest(bytes(row)) for row in rows]
    if not len(rows):
        return []
    flat = np.ascontiguousarray(rows).reshape(len(rows), -1).view(np.uint8)
    return [digest(row) for row in flat]


class CopyCounter:
    """Counts rows whose input bytes an earlier row of the same pass had.

    Fed the rows of one pass in any number of batches (`add`); `reset`
    starts the next pass.

    Args:
        by_user: bool. User-level privacy: a copy held by the same user as
            the earlier row is not counted; one held by another user is.
            Defaults to False (every copy counts).
    """

    def __init__(self, by_user=False):
        self.by_user = bool(by_user)
        self.reset()

    def reset(self):
        """Forgets the rows seen: a new pass."""
        self.rows = 0
        self.copies = 0
        self.largest_group = 0
        self._users = {}  # digest -> the users (or None) whose rows had it.
        self._group = {}  # digest -> the rows (or users) that count as one group.

    def add(self, digests, user_ids=None):
        """Takes a batch of rows; returns how many of them are copies.

        Args:
            digests: list. `row_digests` of the batch's rows.
            user_ids: sequence of int or None. Each row's user, with
                `by_user`. Defaults to None.
        """
        users = user_ids if self.by_user and user_ids is not None else [None] * len(digests)
        copies = 0
        for key, user in zip(digests, users):
            holders = self._users.setdefault(key, set())
            if holders and (user is None or user not in holders):
                copies += 1
            if not holders or user is None or user not in holders:
                self._group[key] = self._group.get(key, 0) + 1
                self.largest_group = max(self.largest_group, self._group[key])
            holders.add(user)
        self.rows += len(digests)
        self.copies += copies
        return copies

    def kept(self):
        """The `KeptCopies` of the rows seen, or None without a copy."""
        if not self.copies:
            return None
        return KeptCopies(self.copies, self.rows, self.largest_group)


def copies_error(copies, rows, where, applied="Nothing was trained.", remedy=DEDUPLICATE):
    """The message that refuses exact duplicate rows.

    It holds counts only, never a row or a label.

    Args:
        copies: int. Rows that repeat an earlier row's input bytes (a
            lower bound when the pass was not read to its end).
        rows: int. The rows compared.
        where: str. What held them (e.g. "fit's x").
        applied: str. What was (not) trained.
        remedy: str. What to do. Defaults to `DEDUPLICATE`.
    """
    return (
        f"{where}: {copies} rows are exact duplicates of other rows in one pass (the same "
        "input bytes, whatever the label), so one example would count twice and ε would "
        f"hold for a group of two, not for one example. {applied} {remedy} "
        f"Received: {copies} duplicate rows among {rows}"
    )


def check_rows(x, *, where, user_ids=None, sample_weight=None, policy=REFUSE):
    """Refuses arrays whose rows repeat (before any training), unless told to keep them.

    Args:
        x: array `[n, ...]`. The inputs (numpy or a tensor).
        where: str. What the rows are, for the error.
        user_ids: array `[n]` or None. Each row's user, under user-level
            privacy. Defaults to None (every copy counts).
        sample_weight: array `[n]` or None. Rows of weight 0 contribute
            nothing and are not compared. Defaults to None.
        policy: str. `REFUSE` (the default) or `KEEP`.

    Returns:
        None, or under `KEEP` the `KeptCopies` when there are copies.

    Raises:
        ValueError: naming the count of copies (under `REFUSE`).
    """
    validate_policy(policy)
    x = np.asarray(x)
    keep = np.arange(len(x))
    if sample_weight is not None:
        keep = np.flatnonzero(np.asarray(sample_weight).reshape(-1) != 0)
    counter = CopyCounter(by_user=user_ids is not None)
    counter.add(row_digests(x[keep]),
                None if user_ids is None else np.asarray(user_ids)[keep].tolist())
    if counter.copies and policy == REFUSE:
        raise ValueError(copies_error(counter.copies, counter.rows, where))
    return counter.kept()


def check_source(source, *, where, by_user=False, remedy=DEDUPLICATE, policy=REFUSE):
    """Refuses a source whose examples repeat, before any training (unless told to keep them).

    Only examples whose size in bytes another example shares are hashed,
    where sizes are known without reading (`record_sizes()`). A
    random-access source is read by index (`record(i)`); a stream is read
    once, in order (`records()`), as the TFRecord files of `tfrecord:`
    data are read once to be converted.

    Args:
        source: A `tfdp.data.data_source.DataSource`.
        where: str. What the data is, for the error.
        by_user: bool. User-level privacy: copies held by one user are fine
            (the source's `user_ids`). Defaults to False.
        remedy: str. What the error tells to do. Defaults to `DEDUPLICATE`.
        policy: str. `REFUSE` (the default) or `KEEP`.

    Returns:
        None, or under `KEEP` the `KeptCopies` when there are copies.

    Raises:
        ValueError: naming the count of copies (under `REFUSE`).
    """
    validate_policy(policy)
    sizes = source.record_sizes()
    shared = None
    if sizes is not None:
        values, counts = np.unique(sizes, return_counts=True)
        shared = set(values[counts > 1].tolist())
    digests = content_digests(source, sizes, shared, "train")
    user_ids = getattr(source, "user_ids", None)
    counter = CopyCounter(by_user=by_user and user_ids is not None)
    counter.add(digests, None if user_ids is None else user_ids.tolist())
    if counter.copies and policy == REFUSE:
        raise ValueError(copies_error(counter.copies, counter.rows, where, remedy=remedy))
    return counter.kept()


def content_digests(source, sizes, shared_sizes, name):
    """One digest per example: equal digests mean equal bytes.

    Only examples whose size in bytes is in `shared_sizes` are hashed (an
    example of a size of its own has no copy), so a folder is not read in
    full; the others get a digest of their own.

    Args:
        source: A `tfdp.data.data_source.DataSource`: read by index
            (`record(i)`) where it has random access, else in one pass
            (`records()`).
        sizes: np.ndarray or None. `source.record_sizes()`; None hashes
            every example.
        shared_sizes: set or None. Sizes that more than one example has,
            over every split compared.
        name: str. The split's name, which keeps unhashed digests apart.

    Returns:
        A list of digests, one per example.
    """
    desc = f"hashing {name} images"
    if not source.random_access:  # A stream: one sequential read.
        records = progress_lib.progress(source.records(), total=len(source), desc=desc)
        return [digest(record) for record in records]
    if sizes is None:
        need = list(range(len(source)))
        digests = {}
    else:
        need = [i for i, size in enumerate(sizes.tolist()) if size in shared_sizes]
        digests = {i: ("unique", name, i) for i in range(len(sizes))}
    for i in progress_lib.progress(need, total=len(need), desc=desc) if need else ():
        digests[i] = digest(source.record(i))
    return [digests[i] for i in range(len(source))]


def drop_duplicates(train, held_out):
    """Drops repeated training examples, and held-out copies of training examples.

    The first of each group of training examples with the same bytes is
    kept, whatever the labels.

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
    sizes = {"train": train.record_sizes()}
    if sizes["train"] is None:
        return train, held_out, {}
    for name, source in held_out.items():
        held_sizes = None if source is None else source.record_sizes()
        if held_sizes is not None:
            sizes[name] = held_sizes
    values, counts = np.unique(np.concatenate(list(sizes.values())), return_counts=True)
    shared_sizes = set(values[counts > 1].tolist())
    digests = content_digests(train, sizes["train"], shared_sizes, "train")
    first = {}
    for i, key in enumerate(digests):
        first.setdefault(key, i)
    keep = np.array(sorted(first.values()), np.int64)
    train_digests = set(first)
    dropped = {"train": len(digests) - len(keep)}
    if dropped["train"]:
        train = validation_lib.subset(train, keep)
    kept = {}
    for name, source in held_out.items():
        if name not in sizes:
            kept[name] = source
            continue
        other = content_digests(source, sizes[name], shared_sizes, name)
        fresh = np.array([i for i, key in enumerate(other) if key not in train_digests],
                         np.int64)
        dropped[name] = len(other) - len(fresh)
        if dropped[name] == len(other):
            raise ValueError(
                f"Every {name} example is also a training example: nothing is left to "
                f"evaluate on. Received: {len(other)} {name} examples, all copies"
            )
        kept[name] = validation_lib.subset(source, fresh) if dropped[name] else source
    return train, kept, dropped
