"""Undecodable images, found once when a dataset is loaded and dropped from every split.

A folder or TFRecord file may hold a corrupt image (truncated, random
bytes, empty). `load_dataset` decodes each encoded image once, up front,
with the decoder the pipelines use (`tf.io.decode_image`), in a parallel
tf.data pass. The images that fail are dropped from their split (train,
test, validation) and named in one line of `DatasetSplits.notes`, so the
training and evaluation pipelines never meet them: their speed does not
depend on them, and their weight-0 guard (`tfdp.data.decode_guard`) is left
for data that cannot be checked up front (tfds sources).

The same pass gives each image's decoded size and channels, from which the
notes say, in one line, how many images are converted (grayscale or RGBA
to RGB, ...) or resized to the model's input.

TensorFlow's image decoders print to stderr for each bad file, without
naming it (libjpeg's own "Premature end of JPEG file", and
`jpeg_mem.cc:...]` log lines), directly to file descriptor 2, where
Python's logging cannot reach them. The pass holds them back: the note
names the files instead.
"""

import contextlib
import dataclasses
import io
import os
import re
import sys
import tempfile

import numpy as np
import tensorflow as tf

from tfdp.data import preprocessing
from tfdp.data import progress as progress_lib

# Undecodable images named in the notes; the rest are counted.
NAMED_IN_NOTES = 5
# Examples decoded per batch of the pass.
_BATCH = 256
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# A TensorFlow (absl) log line, "E0101 12:00:00.000000 1234 jpeg_mem.cc:331] ..." (or
# "E0000 00:00:1796294606.209579 ..." before logging is set up): group 1 is its file.
_LOG_LINE = re.compile(rb"^[IWEF]\d{4} [\d:.]+\s+\d+ ([^:\s]+):\d+\]")
# Source files of TensorFlow's image decoders, whose log lines are held back.
_DECODER_FILE = re.compile(rb"jpeg|png|gif|bmp|webp|image", re.IGNORECASE)
_CHANNEL_NAMES = {1: "grayscale", 2: "gray+alpha", 3: "RGB", 4: "RGBA"}


@dataclasses.dataclass
class Scan:
    """What one decode of every image of a source found.

    Args:
        ok: np.ndarray. `[N]` bool: the image decodes.
        shapes: np.ndarray. `[N, 3]` int64 `(height, width, channels)` as
            decoded with the file's own channels (`channels=0`); zeros where
            `ok` is False.
        common_format: np.ndarray. `[N]` bool: JPEG or PNG, which decode
            to their own channel count exactly when they decode to it
            explicitly (BMP and GIF refuse `channels=1`).
    """

    ok: np.ndarray
    shapes: np.ndarray
    common_format: np.ndarray

    def first_shape(self):
        """`(height, width, channels)` of the first decodable image."""
        good = np.flatnonzero(self.ok)
        if not good.size:
            raise ValueError(
                "None of the images could be decoded; check the data. "
                f"Received: {len(self.ok)} undecodable images")
        return tuple(int(d) for d in self.shapes[good[0]])


@contextlib.contextmanager
def decoder_messages_held_back():
    """Holds back what TensorFlow's image decoders print to stderr meanwhile.

    File descriptor 2 points at a temporary file inside the block. On exit
    it is restored, and TensorFlow's log lines from files other than the
    decoders' are written to it. The rest is dropped: libjpeg's messages,
    which have no log prefix (as would anything else written to descriptor
    2 without one, meant for a block that runs only the decode pass), and
    log lines of the decoders' source files. Python's own `sys.stderr`,
    where it is descriptor 2, writes to the real stderr meanwhile (the
    progress bar).
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # No stderr to protect.
        yield
        return
    python_stderr = sys.stderr
    try:
        # A notebook's stream is left alone: it does not write to descriptor 2.
        on_fd2 = isinstance(python_stderr, io.TextIOWrapper) and python_stderr.fileno() == 2
    except (OSError, ValueError):
        on_fd2 = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        if on_fd2:
            sys.stderr = open(os.dup(saved), "w", buffering=1,
                              encoding=getattr(python_stderr, "encoding", None),
                              errors="backslashreplace")
        try:
            yield
        finally:
            if on_fd2:
                sys.stderr.close()
                sys.stderr = python_stderr
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().splitlines(keepends=True)
                    if not _from_decoder(line)]
            if kept:
                os.write(2, b"".join(kept))


def _from_decoder(line):
    stripped = line.strip()
    if not stripped:
        return True
    found = _LOG_LINE.match(stripped)
    if found is None:
        return True  # libjpeg prints its messages without a prefix.
    return bool(_DECODER_FILE.search(found.group(1)))


def _options():
    # As the pipelines: the autotuner's thread delays the iterator's end by up
    # to a minute; without it AUTOTUNE means one call per core.
    options = tf.data.Options()
    options.autotune.enabled = False
    return options


def decode_pass(source, channels=0, indices=None, desc="checking images"):
    """Decodes images of `source` once, in parallel; which decode, and their shapes.

    Args:
        source: A random-access source of encoded images (`fetch`).
        channels: int. The `channels` of `tf.io.decode_image`: 0 keeps the
            file's. Defaults to `0`.
        indices: np.ndarray, optional. The examples to decode. Defaults to
            `None` (all).
        desc: str. Label of the progress bar. Defaults to `"checking images"`.

    Returns:
        `(ok, shapes, common_format)` over `indices` (see `Scan`).
    """
    indices = np.arange(len(source), dtype=np.int64) if indices is None else (
        np.asarray(indices, np.int64))
    n = len(indices)
    ok = np.zeros(n, bool)
    shapes = np.zeros((n, 3), np.int64)
    common = np.zeros(n, bool)
    if not n:
        return ok, shapes, common

    @tf.autograph.experimental.do_not_convert
    def check(position, index):
        image, _ = source.fetch(index)
        decoded = preprocessing.decode(image, channels)
        png = tf.equal(tf.strings.substr(image, 0, len(_PNG_SIGNATURE)), _PNG_SIGNATURE)
        return position, tf.shape(decoded, out_type=tf.int64), tf.logical_or(
            tf.io.is_jpeg(image), png)

    # A failing element (an undecodable or unreadable image) is dropped, with
    # no log line: the positions that come out are the images that decode.
    ds = (tf.data.Dataset.from_tensor_slices((np.arange(n, dtype=np.int64), indices))
          .map(check, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
          .ignore_errors()
          .batch(_BATCH)
          .prefetch(1)
          .with_options(_options()))
    with progress_lib.progress(total=n, desc=desc) as bar:
        for positions, batch_shapes, batch_common in ds.as_numpy_iterator():
            ok[positions] = True
            shapes[positions] = batch_shapes
            common[positions] = batch_common
            bar.update(len(positions))
    return ok, shapes, common


def scan(source, desc="checking images"):
    """A `Scan` of every image of `source`, decoded with the file's own channels."""
    return Scan(*decode_pass(source, 0, desc=desc))


def check_channels(source, found, channels, desc="checking images"):
    """`found.ok`, also False for images that do not decode with `channels`.

    The pipelines decode with the model's channel count. Converting is
    decoding anew, and some decoders refuse some conversions (BMP and GIF
    to 1 channel, CMYK JPEG to grayscale); JPEG and PNG images already of
    `channels` decode the same either way, and are not decoded again.
    """
    again = np.flatnonzero(found.ok & ((found.shapes[:, 2] != channels)
                                       | ((channels == 1) & ~found.common_format)))
    ok = found.ok.copy()
    if again.size:
        ok[again] = decode_pass(source, channels, again, desc=desc)[0]
    return ok


def dropped_note(bad_names, dropped, total, files=True):
    """The notes' line for the dropped images, naming the first few.

    Args:
        bad_names: list of str. The dropped images, in split order.
        dropped: dict. Split -> count.
        total: int. Images checked, over every split.
        files: bool. The images are files (else records). Defaults to True.
    """
    count = len(bad_names)
    per_split = ""
    if len(dropped) > 1:  # Which split each came from, when several were checked.
        per_split = " (" + ", ".join(f"{k} {v:,}" for k, v in dropped.items() if v) + ")"
    named = ", ".join(bad_names[:NAMED_IN_NOTES])
    more = f" and {count - NAMED_IN_NOTES:,} more" if count > NAMED_IN_NOTES else ""
    kind = "image file(s)" if files else "image(s)"
    return f"dropped {count:,} undecodable {kind} of {total:,}{per_split}: {named}{more}"


def conversion_note(shapes, channels, size):
    """The notes' line for the images the preprocessing converts or resizes, or "".

    Args:
        shapes: np.ndarray. `[N, 3]` decoded shapes of the kept images.
        channels: int. The model's channels.
        size: tuple or None. `(height, width)` every image is resized to,
            or None when the preprocessing does not resize to one size
            (random crops).
    """
    total = len(shapes)
    parts = []
    converted = shapes[:, 2] != channels
    if converted.any():
        kinds = np.unique(shapes[converted, 2], return_counts=True)
        what = [f"{int(c):,} {_CHANNEL_NAMES.get(int(k), f'{int(k)}-channel')}"
                for k, c in zip(*kinds)]
        if np.isin(shapes[converted, 2], (2, 4)).any():
            what.append("alpha dropped")
        parts.append(f"{int(converted.sum()):,} of {total:,} converted to "
                     f"{_CHANNEL_NAMES[channels]} ({', '.join(what)})")
    if size is not None:
        resized = (shapes[:, 0] != size[0]) | (shapes[:, 1] != size[1])
        if resized.any():
            parts.append(f"{int(resized.sum()):,} of {total:,} resized to {size[0]}x{size[1]}")
    return ("images: " + ", ".join(parts)) if parts else ""
