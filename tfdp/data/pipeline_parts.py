"""The parts the training and evaluation pipelines share.

- `host_index_and_count`: this host's input pipeline and the number of them.
- `default_preprocess`: decoding and scaling when no `preprocess_fn` is given.
- `no_autograph`, `no_autograph_if`: tfdp's tf.data functions traced as
  written, without autograph's conversion.
- `reads_batches`, `batched_preprocess`: reading and preprocessing whole
  batches from a source with `fetch_batch`.
- `without_autotune_thread`: a pipeline whose iterator is freed at once.
"""

import tensorflow as tf

from tfdp.data import preprocessing


def host_index_and_count(input_context):
    """`(this host's input pipeline id, number of input pipelines)`; `(0, 1)` for None."""
    if input_context is None:
        return 0, 1
    return input_context.input_pipeline_id, input_context.num_input_pipelines


def default_preprocess(source, train):
    """Decodes with the source's channel count and pins its static shape."""
    info = getattr(source, "info", None)
    shape = tuple(info.image_shape) if info is not None else None
    channels = shape[-1] if shape else 3

    @no_autograph
    def preprocess(image, seed=None):
        del seed
        image = preprocessing.to_float(preprocessing.decode(image, channels))
        if shape and all(d is not None for d in shape):
            image = tf.ensure_shape(image, shape)
        return image

    if train:
        return preprocess
    return no_autograph(lambda image: preprocess(image))


def reads_batches(source):
    """Whether `source` serves whole physical batches (`fetch_batch`).

    Only decoded images qualify: an encoded one may fail to decode, and
    `decode_guard.guarded_map` must isolate it example by example.
    """
    return hasattr(source, "fetch_batch") and not getattr(source, "encoded", True)


def no_autograph(fn):
    """`fn` for a tf.data transformation, traced as written.

    tf.data converts every function it traces with autograph, and with it
    everything that function calls (the sampler's code, ...): most of the
    1.5 s that building the default run's pipelines took. Only for tfdp's
    functions that do not call the user's preprocessing, which may rely on
    autograph.
    """
    traced_as_written = tf.autograph.experimental.do_not_convert(fn)
    traced_as_written._tfdp_no_autograph = True
    return traced_as_written


def no_autograph_if(fn, callee):
    """`fn`, traced as written where the function it calls is (`no_autograph`).

    Then `fn` calls none of the user's code: the default preprocessing, not
    a `preprocess_fn` that may rely on autograph (which converts what `fn`
    calls only when `fn` is converted).
    """
    return no_autograph(fn) if getattr(callee, "_tfdp_no_autograph", False) else fn


def batched_preprocess(source, preprocess_fn):
    """`fn(images, seeds)` applying the per-example `preprocess_fn` to a batch.

    Functions that `tf.vectorized_map` converts op by op (scaling,
    normalizing) run as one batched op each. Others, such as the stateless
    random crops, which have no batched form, run example by example in a
    `tf.map_fn`: still one tf.data element per batch, with the exact
    per-example ops.
    """
    def vectorized(images, seeds):
        return tf.vectorized_map(
            lambda example: preprocess_fn(*example), (images, seeds),
            fallback_to_while_loop=False,
        )

    images = tf.function(source.fetch_batch, autograph=False).get_concrete_function(
        tf.TensorSpec([None], tf.int64)
    ).structured_outputs[0]
    seeds = tf.TensorSpec([None, 2], tf.int64)
    vectorized = no_autograph_if(vectorized, preprocess_fn)
    try:
        tf.function(vectorized).get_concrete_function(images, seeds)
        return vectorized
    except (ValueError, TypeError, NotImplementedError, tf.errors.OpError):
        pass
    out_spec = tf.function(preprocess_fn).get_concrete_function(
        tf.TensorSpec(images.shape[1:], images.dtype), tf.TensorSpec([2], tf.int64)
    ).structured_outputs

    def one_by_one(images, seeds):
        return tf.map_fn(
            lambda example: preprocess_fn(*example), (images, seeds),
            fn_output_signature=tf.TensorSpec.from_tensor(out_spec),
        )

    return no_autograph_if(one_by_one, preprocess_fn)


def without_autotune_thread(ds):
    """`ds` with tf.data's autotuning off (AUTOTUNE then means one per core).

    The autotuner's background thread sleeps between optimisations for up
    to a minute, and destroying an iterator waits for it to wake: a run's
    last `for batch in pipeline` stalled 39-89 s after its last step. With
    the tuner off the iterator is freed at once.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.with_options(options)
