"""TFRecord files of `tf.train.Example`, made random access for Poisson sampling.

TFRecord files can only be read in order. Poisson sampling draws each
example independently, so it needs to read any example by its index:

* files totalling at most `in_memory_max_bytes` are read once into memory
  (encoded image bytes and labels: an `ArraySource`);
* larger ones are converted once into an ArrayRecord file (the random-access
  format of tfds data sources) holding the encoded image of each example,
  with the labels beside it in `labels.npy`. The conversion is one
  sequential pass with a progress bar; it is cached beside the data (in
  `.tfdp_cache/`) or in a directory the user names, keyed by the files'
  names, sizes and modification times and the feature names, and is
  reused by later runs.
"""

import hashlib
import json
import os
import shutil
import tempfile
import threading

import numpy as np
import tensorflow as tf

from tfdp.data import array_source
from tfdp.data import data_source
from tfdp.data import progress as progress_lib

_RECORD_FILE = "images.array_record"
_LABELS_FILE = "labels.npy"
_USERS_FILE = "user_ids.npy"
_META_FILE = "meta.json"
# Examples parsed per tf.io.parse_example call during a pass.
_PARSE_BATCH = 256


class ArrayRecordSource:
    """Encoded images in an ArrayRecord file, labels in memory.

    Args:
        path: str. The ArrayRecord file; record k is the encoded image of
            example k.
        labels: np.ndarray. `[N]` integer labels.
        info: `DatasetInfo`, optional. Metadata. Defaults to `None`.
        keys: np.ndarray, optional. `[N]` record numbers of the examples
            (a subset's). Defaults to `None` (`0..N-1`).
        user_ids: np.ndarray, optional. `[N]` integers, the user of each
            example (`load_dataset.user_key`). Defaults to `None`.
    """

    random_access = True
    encoded = True

    def __init__(self, path, labels, info=None, keys=None, user_ids=None):
        self.path = path
        self.labels = np.asarray(labels, np.int32)
        self.user_ids = None if user_ids is None else np.asarray(user_ids, np.int64)
        self.keys = np.arange(len(self.labels)) if keys is None else np.asarray(keys, np.int64)
        self.info = info
        self._reader = None
        self._tensors = None
        # Records read through `fetch`, for checking that sampling reads
        # each sampled example once (and nothing more).
        self.reads = 0
        self._lock = threading.Lock()

    def __len__(self):
        return int(self.labels.shape[0])

    @property
    def size(self):
        return len(self)

    def subset(self, indices):
        """The examples `indices`, reading the same file."""
        return ArrayRecordSource(
            self.path, self.labels[indices], self.info, self.keys[indices],
            None if self.user_ids is None else self.user_ids[indices])

    def _open(self):
        if self._reader is None:
            from array_record.python.array_record_data_source import ArrayRecordDataSource

            self._reader = ArrayRecordDataSource(self.path)
        return self._reader

    def _read(self, key):
        self._open()
        with self._lock:  # numpy_function runs on parallel tf.data threads.
            self.reads += 1
        return self._reader[int(key)]

    def record_sizes(self):
        """None: a record's size is known only by reading it."""
        return None

    def record(self, index):
        """The encoded image of example `index`, as bytes (eager; not counted in `reads`)."""
        return self._open()[int(self.keys[index])]

    def records(self):
        """Every example's encoded image, in index order (not counted in `reads`)."""
        return data_source.random_access_records(self)

    def fetch(self, index):
        """Returns `(encoded_image, label)` of example `index`."""
        if self._tensors is None:
            with tf.init_scope():
                self._tensors = (tf.constant(self.keys), tf.constant(self.labels))
        keys, labels = self._tensors
        image = tf.numpy_function(self._read, [tf.gather(keys, index)], tf.string, stateful=False)
        image.set_shape([])
        return image, tf.gather(labels, index)

    def as_dataset(self, *, shuffle=False, seed=0, input_context=None):
        """Returns a dataset of `(encoded_image, label)` in index order."""
        del shuffle, seed
        return data_source.indexed_dataset(self, input_context)


def match_files(pattern):
    """The sorted files matching a glob pattern; an error when there are none."""
    files = sorted(tf.io.gfile.glob(pattern))
    if not files:
        raise ValueError(f"No TFRecord files match the pattern. Received: pattern={pattern!r}")
    return files


def _records(files, image_key, label_key, user_key=None, counts=None):
    """Yields `(encoded_images, labels, user_ids)` numpy batches, reading the files once.

    `user_ids` is None without a `user_key`. Files are read one after the
    other, in order; `counts`, a list, gets the number of records of each
    (which name a record that does not decode by its file).
    """
    features = {
        image_key: tf.io.FixedLenFeature([], tf.string),
        label_key: tf.io.FixedLenFeature([], tf.int64),
    }
    if user_key is not None:
        features[user_key] = tf.io.FixedLenFeature([], tf.int64)
    for path in files:
        ds = tf.data.TFRecordDataset([path]).batch(_PARSE_BATCH)
        ds = ds.map(lambda serialized: tf.io.parse_example(serialized, features))
        count = 0
        try:
            for batch in ds.as_numpy_iterator():
                count += len(batch[label_key])
                yield batch[image_key], batch[label_key], batch.get(user_key)
        except tf.errors.InvalidArgumentError as e:
            raise ValueError(_feature_error(path, image_key, label_key, e, user_key)) from None
        if counts is not None:
            counts.append(count)


def _feature_error(path, image_key, label_key, error, user_key=None):
    found = "unreadable"
    try:
        first = next(iter(tf.data.TFRecordDataset([path]).take(1)))
        feature = tf.train.Example.FromString(first.numpy()).features.feature
        found = {name: value.WhichOneof("kind") for name, value in feature.items()}
    except Exception:  # Only to enrich the message.
        pass
    return (
        f"The TFRecords need a bytes feature {image_key!r} (encoded JPEG/PNG) and an int64 "
        f"feature {label_key!r}"
        + (f" and an int64 user feature {user_key!r}" if user_key else "")
        + "; set them with load_dataset.image_key / label_key"
        + (" / user_key" if user_key else "") + ". "
        f"Received: features of the first record of {path}: {found} "
        f"({' '.join(error.message.split())[:200]})"
    )


def _fingerprint(files, image_key, label_key, user_key=None):
    digest = hashlib.sha1()
    for path in files:
        stat = tf.io.gfile.stat(path)
        digest.update(f"{path}|{stat.length}|{stat.mtime_nsec}\n".encode())
    digest.update(f"{image_key}|{label_key}".encode())
    if user_key is not None:
        digest.update(f"|{user_key}".encode())
    return digest.hexdigest()[:16]


def convert(files, cache_dir, *, image_key, label_key, user_key=None, num_examples=None):
    """Converts TFRecords to a cached ArrayRecord file, or finds the cached one.

    Args:
        files: list. TFRecord paths, in order.
        cache_dir: str. Directory that holds the conversions.
        image_key: str. Bytes feature of the encoded image.
        label_key: str. int64 feature of the label.
        user_key: str, optional. int64 feature of the user id. Defaults to
            `None` (no users).
        num_examples: int, optional. Expected count, for the progress bar.
            Defaults to `None`.

    Returns:
        `(path_of_array_record, labels, user_ids, stats)`: `user_ids` is
        None without a `user_key`; `stats` has `cached` (bool),
        `records_read` / `records_written` (0 when cached) and
        `records_per_file` (a list, or None from a cache written without it).
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    key = _fingerprint(files, image_key, label_key, user_key)
    target = os.path.join(cache_dir, f"tfrecord-{key}")
    if os.path.isfile(os.path.join(target, _META_FILE)):
        labels = np.load(os.path.join(target, _LABELS_FILE))
        users = np.load(os.path.join(target, _USERS_FILE)) if user_key else None
        with open(os.path.join(target, _META_FILE)) as f:
            per_file = json.load(f).get("records_per_file")
        return os.path.join(target, _RECORD_FILE), labels, users, dict(
            cached=True, records_read=0, records_written=0, records_per_file=per_file
        )
    try:
        os.makedirs(cache_dir, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=".tfrecord-", dir=cache_dir)
    except OSError as e:
        raise ValueError(
            "Cannot write the random-access conversion of the TFRecords; name a writable "
            f"directory with load_dataset.cache_dir. Received: cache_dir={cache_dir!r} ({e})"
        ) from None
    labels, users, read, written, per_file = [], [], 0, 0, []
    # group_size:1 makes each record its own chunk: one read per random access.
    writer = ArrayRecordWriter(os.path.join(scratch, _RECORD_FILE), "group_size:1")
    try:
        with progress_lib.progress(total=num_examples, desc="TFRecord -> ArrayRecord") as bar:
            for images, batch_labels, batch_users in _records(files, image_key, label_key,
                                                              user_key, per_file):
                for image in images:
                    writer.write(image)
                read += len(images)
                written += len(images)
                labels.append(batch_labels)
                users.append(batch_users)
                bar.update(len(images))
        writer.close()
        labels = np.concatenate(labels).astype(np.int64) if labels else np.zeros([0], np.int64)
        np.save(os.path.join(scratch, _LABELS_FILE), labels)
        if user_key:
            users = np.concatenate(users).astype(np.int64) if users else np.zeros([0], np.int64)
            np.save(os.path.join(scratch, _USERS_FILE), users)
        else:
            users = None
        with open(os.path.join(scratch, _META_FILE), "w") as f:
            json.dump({"files": files, "num_examples": int(len(labels)),
                       "records_per_file": per_file,
                       "image_key": image_key, "label_key": label_key,
                       "user_key": user_key}, f)
        os.replace(scratch, target)  # Atomic: a crash never leaves a half cache.
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return os.path.join(target, _RECORD_FILE), labels, users, dict(
        cached=False, records_read=read, records_written=written, records_per_file=per_file
    )


def load_tfrecord(pattern, *, image_key, label_key, cache_dir, in_memory_max_bytes,
                  user_key=None):
    """A random-access source over the `tf.train.Example`s of TFRecord files.

    Args:
        pattern: str. Glob of the files, e.g. `/data/shards/train-*`.
        image_key: str. Bytes feature of the encoded image (JPEG, PNG, ...).
        label_key: str. int64 feature of the integer label.
        cache_dir: str, optional. Where the ArrayRecord conversion is
            cached; `None` caches beside the data, in `.tfdp_cache/`.
        in_memory_max_bytes: int. Files totalling at most this many bytes
            are read into memory instead of converted.
        user_key: str, optional. int64 feature of the user of each example
            (user-level privacy). Defaults to `None` (no users).

    Returns:
        `(source, notes)`: an `ArraySource` or `ArrayRecordSource` (with
        `conversion_stats` when converted), and a description. The source's
        `record_files`, `(files, records per file)`, names the file of each
        example (until it is subset); it is absent for a cached conversion
        written without it.
    """
    files = match_files(pattern)
    total_bytes = sum(tf.io.gfile.stat(path).length for path in files)
    if total_bytes <= in_memory_max_bytes:
        images, labels, users, per_file = [], [], [], []
        with progress_lib.progress(desc="reading TFRecords") as bar:
            for batch_images, batch_labels, batch_users in _records(files, image_key, label_key,
                                                                    user_key, per_file):
                images.extend(batch_images)
                labels.append(batch_labels)
                users.append(batch_users)
                bar.update(len(batch_images))
        if not images:
            raise ValueError(f"The TFRecord files hold no examples. Received: pattern={pattern!r}")
        encoded = np.empty(len(images), dtype=object)
        encoded[:] = images
        source = array_source.ArraySource(encoded, np.concatenate(labels),
                                     user_ids=np.concatenate(users) if user_key else None)
        source.record_files = (files, per_file)
        return source, f"{len(files)} TFRecord file(s) in memory{_users_note(user_key)}"
    cache_dir = cache_dir or os.path.join(os.path.dirname(files[0]), ".tfdp_cache")
    path, labels, users, stats = convert(files, cache_dir, image_key=image_key,
                                         label_key=label_key, user_key=user_key)
    if not len(labels):
        raise ValueError(f"The TFRecord files hold no examples. Received: pattern={pattern!r}")
    source = ArrayRecordSource(path, labels, user_ids=users)
    source.conversion_stats = stats
    if stats["records_per_file"] is not None:
        source.record_files = (files, stats["records_per_file"])
    how = "cached" if stats["cached"] else "converted"
    return source, (f"{len(files)} TFRecord file(s), random access via {path} ({how})"
                    f"{_users_note(user_key)}")


def _users_note(user_key):
    return f", users from feature {user_key!r}" if user_key else ""


def held_out_pattern(pattern):
    """The test split's files beside `pattern`: 'train' replaced by 'test' or 'validation'.

    Returns:
        `(split_name, pattern)` of the first that matches files, or `None`.
    """
    directory, name = os.path.split(pattern)
    if "train" not in name:
        return None
    for split in ("test", "validation"):
        candidate = os.path.join(directory, name.replace("train", split))
        if tf.io.gfile.glob(candidate):
            return split, candidate
    return None
