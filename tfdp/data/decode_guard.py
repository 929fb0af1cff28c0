"""Decode guard: corrupt encoded images become skipped, counted examples.

When a source holds encoded bytes (JPEG/PNG), an example whose image fails
to decode (truncated, random bytes, empty, ...) is not fatal: it becomes a
weight-0 example with a zero image and label 0 (in DP terms it is simply
not sampled, so it contributes no gradient), and it is counted in a
`DecodeStats` counter (`dataset.decode_stats`, or the `decode_stats`
argument) that the trainer logs. `load_dataset` drops the undecodable
images of `folder:` and `tfrecord:` data when it loads them
(`tfdp.data.image_check`), so for those the guard never fires; it is for
sources that cannot be checked up front (tfds, sources built by hand).

This module holds the counter (`DecodeStats`), the search for a decodable
stand-in image (`find_substitute`), the guarded preprocessing map
(`guarded_map`) and the per-batch count of skipped examples
(`count_skipped`), which the training and evaluation pipelines share.
"""

import tensorflow as tf


# Examples scanned when looking for a decodable stand-in image (below).
_SUBSTITUTE_SCAN = 64


class DecodeStats:
    """Counts the examples whose encoded image failed to decode.

    The count is a CPU `tf.Variable` (int64) that the pipeline's map
    functions increment as batches are produced, so with prefetching it may
    run a few batches ahead of what the trainer consumed. Only real
    examples are counted (never padding).

    Note: this count is a statistic of the dataset's files, not covered by
    the DP guarantee; it is meant for the operator's logs.
    """

    def __init__(self):
        with tf.init_scope(), tf.device("/cpu:0"):
            self.skipped = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="skipped_undecodable"
            )

    def value(self):
        """The number of skipped examples so far, as a Python int."""
        return int(self.skipped.numpy())

    def reset(self):
        self.skipped.assign(0)

    def __repr__(self):
        return f"DecodeStats(skipped={self.value()})"


def find_substitute(dataset, preprocess_fn):
    """A decodable encoded image from the first examples of `dataset`.

    Run through `preprocess_fn` (eagerly) it gives the shape and dtype of
    the zero image that replaces an undecodable one.
    """
    seed = tf.zeros([2], tf.int64)
    tried = 0
    for image, _ in dataset.take(_SUBSTITUTE_SCAN).ignore_errors():
        tried += 1
        try:
            preprocess_fn(image, seed)
        except (tf.errors.OpError, ValueError):
            continue
        return image
    raise ValueError(
        f"None of the first {tried} images of the source could be decoded and "
        "preprocessed; check the data (or the preprocess_fn). "
        f"Received: {tried} undecodable images"
    )


# Encoded examples are preprocessed in chunks of this many (see below).
_GUARD_CHUNK = 32


def guarded_map(ds, preprocess_fn, substitute_fn):
    """`(image, label, weight, last, seed, *extra)` -> `(image, label, weight, last, skipped, *extra)`.

    Decoded images go through `preprocess_fn` in a plain parallel map. For
    encoded images a decode error must not end the pipeline, and tf.data
    can only drop failing elements (`ignore_errors`). So consecutive
    examples are preprocessed in chunks of `_GUARD_CHUNK` inside one-element
    datasets with `ignore_errors()`: a chunk that fails is redone example
    by example the same way, and an example that fails alone becomes a
    skipped one (weight 0, zero image, label 0). Order is kept. The caller
    counts the skipped examples per batch, from the `skipped` component.
    Any `extra` components pass through unchanged.

    Args:
        ds: `tf.data.Dataset` of `(image, label, weight, last, seed, *extra)`;
            `image` decoded, or encoded bytes (`tf.string`).
        preprocess_fn: callable. `(image, seed) -> image`; for encoded
            images it also decodes.
        substitute_fn: callable. `() -> image`: an encoded image that
            `preprocess_fn` accepts; its output gives the zero image of a
            skipped example. Called only for encoded images.

    Returns:
        The mapped `tf.data.Dataset`.
    """
    encoded = ds.element_spec[0].dtype == tf.string

    def finish(image, label, weight, last, ok, *extra):
        # Padding and skipped examples carry no data: zero image, label 0.
        real = weight > 0
        keep = tf.logical_and(real, ok)
        image = tf.where(keep, image, tf.zeros_like(image))
        label = tf.where(keep, tf.cast(label, tf.int32), 0)
        weight = tf.where(ok, weight, tf.zeros_like(weight))
        return (image, label, weight, last, tf.logical_and(real, tf.logical_not(ok))) + extra

    if not encoded:

        def plain(image, label, weight, last, seed, *extra):
            return finish(preprocess_fn(image, seed), label, weight, last, tf.constant(True),
                          *extra)

        return ds.map(plain, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    substitute = substitute_fn()
    zero = tf.zeros_like(preprocess_fn(substitute, tf.zeros([2], tf.int64))).numpy()
    # The static output spec of preprocess_fn, as traced in a graph.
    out_spec = (
        tf.data.Dataset.from_tensors((substitute, tf.zeros([2], tf.int64)))
        .map(preprocess_fn)
        .element_spec
    )

    def one(image, label, weight, last, seed, *extra):
        tried = tf.data.Dataset.from_tensors((image, seed)).map(preprocess_fn).ignore_errors()
        fallback = tf.data.Dataset.from_tensors(tf.constant(zero))
        return (
            tried.map(lambda out: (out, True))
            .concatenate(fallback.map(lambda out: (out, False)))
            .take(1)
            .map(lambda out, ok: (out, label, weight, last, ok) + extra)
        )

    def chunk(images, labels, weights, lasts, seeds, *extras):
        def attempt(images, seeds):
            return tf.map_fn(
                lambda args: preprocess_fn(args[0], args[1]),
                (images, seeds),
                fn_output_signature=out_spec,
            )

        elements = (images, labels, weights, lasts, seeds) + extras
        tried = (
            tf.data.Dataset.from_tensors((images, seeds))
            .map(attempt)
            .ignore_errors()
            .map(lambda out: (out, labels, weights, lasts, tf.ones_like(lasts)) + extras)
        )
        one_by_one = (
            tf.data.Dataset.from_tensor_slices(elements).flat_map(one).batch(_GUARD_CHUNK)
        )
        return tried.concatenate(one_by_one).take(1).unbatch()

    ds = ds.batch(_GUARD_CHUNK).interleave(
        chunk,
        cycle_length=tf.data.AUTOTUNE,
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return ds.map(finish, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def count_skipped(decode_stats):
    """A map from a batch of guarded training examples to a physical batch.

    The returned function adds the batch's skipped examples to
    `decode_stats` and keeps the batch's last `last` flag as its own.

    Args:
        decode_stats: `DecodeStats`. The counter to add to.
    """
    def finish_batch(images, labels, weights, lasts, skipped):
        decode_stats.skipped.assign_add(tf.reduce_sum(tf.cast(skipped, tf.int64)))
        # Physical batches never straddle two steps, so the step's final
        # element is always the final element of a physical batch.
        return images, labels, weights, lasts[-1]

    return finish_batch
