"""The evaluation input pipeline: `make_eval_pipeline`, every example once.

Elements are `(images, labels, weights)` with a static batch size; the final
partial batch is padded with zero images of weight 0
(`tfdp.data.batch_padding`), and undecodable images are skipped and counted
(`tfdp.data.decode_guard`).
"""

import gin
import numpy as np
import tensorflow as tf

from tfdp.data import batch_padding
from tfdp.data import decode_guard
from tfdp.data import pipeline_parts

# Evaluation batches of in-memory arrays are cached up to this size.
_EVAL_CACHE_BYTES = 256 * 2**20


@gin.configurable(module="tfdp.data")
def make_eval_pipeline(
    source, batch_size, preprocess_fn=None, input_context=None, decode_stats=None
):
    """Builds the evaluation pipeline, every example exactly once.

    Elements are `(images, labels, weights)` with static batch size; the
    final partial batch is padded with zero images of weight 0. An example
    whose encoded image fails to decode gets weight 0 (and a zero image)
    and is counted in `decode_stats`.

    Args:
        source: A source (see `tfdp.data.sources`).
        batch_size: int. Examples per batch.
        preprocess_fn: callable, optional. `fn(image) -> image` returning
            float32 with a static shape. Defaults to `None` (decode if
            needed and scale to [0, 1]).
        input_context: `tf.distribute.InputContext`, optional. Each host
            evaluates a disjoint shard. Defaults to `None`.
        decode_stats: `DecodeStats`, optional. Counts the skipped
            (undecodable) examples; it accumulates over passes, so
            `reset()` it before a pass to count one pass. Defaults to
            `None` (a new one).

    Returns:
        A `tf.data.Dataset`, with the counter as its `decode_stats`
        attribute.
    """
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be positive. Received: batch_size={batch_size}")
    if preprocess_fn is None:
        preprocess_fn = pipeline_parts.default_preprocess(source, train=False)
    image_fn = preprocess_fn
    decode_stats = decode_stats or decode_guard.DecodeStats()

    def seeded(image, seed):
        del seed
        return image_fn(image)

    seeded = pipeline_parts.no_autograph_if(seeded, image_fn)

    if pipeline_parts.reads_batches(source):
        ds = _eval_batches(source, batch_size, seeded, input_context)
    else:
        ds = source.as_dataset(shuffle=False, input_context=input_context)
        ds = ds.map(
            lambda image, label: (
                image, label, tf.constant(1.0), tf.constant(False), tf.zeros([2], tf.int64)
            )
        )
        ds = decode_guard.guarded_map(
            ds, seeded,
            lambda: decode_guard.find_substitute(source.as_dataset(shuffle=False), seeded),
        )
        ds = ds.batch(batch_size).map(batch_padding.pad_batch(batch_size, decode_stats))
    if small_decoded_array(source, ds, _EVAL_CACHE_BYTES):
        # Every pass is the same: keep the batches rather than preprocess the
        # examples again at every evaluation (a third of the default run's
        # evaluation time). Decoded arrays have no undecodable images to count.
        ds = ds.cache()
    ds = pipeline_parts.without_autotune_thread(ds.prefetch(tf.data.AUTOTUNE))
    ds.decode_stats = decode_stats
    return ds


def _eval_batches(source, batch_size, preprocess_fn, input_context):
    """`make_eval_pipeline`'s batches of a `fetch_batch` source, read batch by batch.

    This host's examples are those of `source.as_dataset`'s shard, in the
    same order; the last batch is padded the same way.
    """
    host, num_hosts = pipeline_parts.host_index_and_count(input_context)
    indices = np.arange(host, len(source), num_hosts, dtype=np.int64)
    preprocess_batch = pipeline_parts.batched_preprocess(source, preprocess_fn)

    def read(batch_indices):
        images, labels = source.fetch_batch(batch_indices)
        count = tf.shape(batch_indices)[0]
        images = preprocess_batch(images, tf.zeros([count, 2], tf.int64))
        return batch_padding.padded_to(
            batch_size, images, tf.cast(labels, tf.int32), tf.ones([count], tf.float32)
        )

    ds = tf.data.Dataset.from_tensor_slices(indices).batch(batch_size)
    return ds.map(pipeline_parts.no_autograph_if(read, preprocess_fn),
                  num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def small_decoded_array(source, ds, limit):
    """Whether `ds`, batches of an in-memory decoded array source, fits `limit` bytes."""
    images = getattr(source, "images", None)
    if images is None or getattr(source, "encoded", True):
        return False
    spec = ds.element_spec[0]
    if not spec.shape.is_fully_defined():
        return False
    per_batch = spec.shape.num_elements() * spec.dtype.size
    return -(-len(source) // int(spec.shape[0])) * per_batch <= limit
