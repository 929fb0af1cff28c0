"""Validation sets held out from the training data.

The validation set is held out from the training data so that
hyperparameters are chosen on it and the test set gives the final number
only. Held-out examples are not in the training set, so the N the
accountant uses is the size of what remains.

How a source is split depends on what it holds:

* labels in memory (`ArraySource` and its subclasses: the offline sets,
  small tfds sets, folders, TFRecords, `.npz`): stratified by label, seeded;
  or, when the source has a user per example (`user_ids`), by user: a
  seeded fraction of the users with all their examples, so that no user is
  in two splits;
* other random-access sources (tfds array_record): a seeded uniform
  random subset of the indices (reading every label would be a pass over
  all images);
* streaming tfds sources: a slice of the tfds split (tfds shuffles the
  examples when it prepares a dataset, so a slice is a random subset).
"""

import numpy as np
import tensorflow as tf

from tfdp.data import data_source
from tfdp.data import splits


class SubsetSource:
    """The examples `indices` of a random-access source, renumbered 0..n-1.

    Args:
        source: A random-access source (with `fetch` and `info`).
        indices: np.ndarray. Indices into `source`, each used once.
    """

    random_access = True

    def __init__(self, source, indices):
        if not getattr(source, "random_access", False):
            raise ValueError(
                "SubsetSource needs a random-access source. "
                f"Received: source={type(source).__name__}"
            )
        self.source = source
        self.indices = np.asarray(indices, np.int64)
        self.info = source.info
        self.encoded = getattr(source, "encoded", False)
        self._indices_t = None

    def __len__(self):
        return int(self.indices.shape[0])

    @property
    def size(self):
        return len(self)

    def fetch(self, index):
        """Returns `(image, label)` of example `index` of the subset."""
        if self._indices_t is None:
            with tf.init_scope():
                self._indices_t = tf.constant(self.indices)
        return self.source.fetch(tf.gather(self._indices_t, index))

    def record_sizes(self):
        """The source's sizes of the subset's examples, or None."""
        sizes = self.source.record_sizes()
        return None if sizes is None else sizes[self.indices]

    def record(self, index):
        """The input bytes of example `index` of the subset."""
        return self.source.record(self.indices[index])

    def records(self):
        """Every example's input bytes, in the subset's order."""
        return data_source.random_access_records(self)

    def as_dataset(self, *, shuffle=False, seed=0, input_context=None):
        """Returns a dataset of `(image, label)` in index order."""
        del shuffle, seed
        return data_source.indexed_dataset(self, input_context)


def subset(source, indices):
    """The examples `indices` of `source`, as a source of the same kind."""
    if hasattr(source, "subset"):
        return source.subset(indices)
    return SubsetSource(source, indices)


def split_validation(source, fraction, seed):
    """Holds out a validation set from a training source.

    Args:
        source: A training source (see the module docstring for how each
            kind is split).
        fraction: float. Fraction of the training examples held out, in
            [0, 1); `0` holds out nothing.
        seed: int. Seed of the split.

    Returns:
        `(train, validation)`; `validation` is `None` when `fraction` is 0.
    """
    splits.check_fraction("validation_fraction", fraction)
    if fraction == 0:
        return source, None
    labels = getattr(source, "labels", None)
    if labels is not None:
        kept, held_out = splits.held_out_split(source, fraction, seed)
    elif getattr(source, "random_access", False):
        permutation = np.random.default_rng(seed).permutation(len(source))
        count = splits.held_out_count(len(source), fraction)
        kept, held_out = np.sort(permutation[count:]), np.sort(permutation[:count])
    elif hasattr(source, "slice"):
        count = splits.held_out_count(len(source), fraction)
        return source.slice(count, None), source.slice(0, count)
    else:
        raise ValueError(
            "A validation split needs a source with labels in memory, random access or "
            f"slicing. Received: source={type(source).__name__}"
        )
    return subset(source, kept), subset(source, held_out)
