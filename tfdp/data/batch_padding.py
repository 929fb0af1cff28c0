"""Padding of physical batches with weight-0 examples.

- Training: `resolve_pad_granule` says to what multiple a Poisson step of
  random size is padded, and `batch_by_key` cuts such a step into physical
  batches whose last one may be shorter than P.
- Evaluation: `padded_to` and `pad_batch` pad the final partial batch with
  zero images of weight 0 to the static batch size.
"""

import tensorflow as tf

from tfdp.data import pipeline_parts


def resolve_pad_granule(pad_granule, physical_batch_size):
    """The padding granule of `make_train_pipeline`, as an int dividing P.

    Args:
        pad_granule: int, "auto" or None (see `make_train_pipeline`).
        physical_batch_size: int. P, per host.
    """
    p = physical_batch_size
    if pad_granule is None:
        return p
    if pad_granule == "auto":
        return next((p // k for k in (8, 4, 2) if p % k == 0), p)
    if isinstance(pad_granule, bool) or not isinstance(pad_granule, int) or not (
        1 <= pad_granule <= p and p % pad_granule == 0
    ):
        raise ValueError(
            "`pad_granule` must be 'auto', None or a divisor of the physical batch size "
            f"({p}). Received: pad_granule={pad_granule!r}"
        )
    return pad_granule


def batch_by_key(ds, physical_batch_size):
    """`(*example, key)` elements -> physical batches of varying length.

    Consecutive elements with the same key form one batch; the key is
    `unique_id * (P + 1) + length`, so each batch is emitted as soon as its
    `length` elements have arrived, in order.
    """
    modulus = physical_batch_size + 1
    return ds.group_by_window(
        key_func=lambda *example: example[-1],
        reduce_func=lambda key, window: window.map(lambda *example: example[:-1]).batch(
            physical_batch_size
        ),
        window_size_func=lambda key: key % modulus,
    )


@pipeline_parts.no_autograph
def padded_to(batch_size, images, labels, weights):
    """A final partial evaluation batch padded with weight-0 zeros to a static size."""
    missing = batch_size - tf.shape(labels)[0]
    images = tf.pad(images, [[0, missing]] + [[0, 0]] * (images.shape.rank - 1))
    labels = tf.pad(labels, [[0, missing]])
    weights = tf.pad(weights, [[0, missing]])
    images.set_shape([batch_size] + images.shape.as_list()[1:])
    labels.set_shape([batch_size])
    weights.set_shape([batch_size])
    return images, labels, weights


def pad_batch(batch_size, decode_stats):
    """A map from a batch of guarded evaluation examples to a padded batch.

    The returned function adds the batch's skipped examples to
    `decode_stats`, drops the `last` flags and pads with `padded_to`.

    Args:
        batch_size: int. The static batch size to pad to.
        decode_stats: `tfdp.data.decode_guard.DecodeStats`. The counter to add to.
    """
    def pad(images, labels, weights, lasts, skipped):
        del lasts
        decode_stats.skipped.assign_add(tf.reduce_sum(tf.cast(skipped, tf.int64)))
        return padded_to(batch_size, images, labels, weights)

    return pad
