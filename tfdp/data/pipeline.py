"""Training and evaluation input pipelines.

Training elements are physical batches `(images, labels, weights, last)`:
images float32 `[P, H, W, C]`, labels int32 `[P]`, weights float32 `[P]`
(0 for padding), and `last`, a bool scalar that is True on the final
physical batch of a logical step.

Corrupt images. When a source holds encoded bytes (JPEG/PNG), an example
whose image fails to decode (truncated, random bytes, empty, ...) is not
fatal: it becomes a weight-0 example with a zero image and label 0 (in
DP terms it is simply not sampled, so it contributes no gradient), and it
is counted in a `DecodeStats` counter (`dataset.decode_stats`, or the
`decode_stats` argument) that the trainer logs. `load_dataset` drops the
undecodable images of `folder:` and `tfrecord:` data when it loads them
(`tfdp.data.image_check`), so for those the guard never fires; it is for
sources that cannot be checked up front (tfds, sources built by hand).
"""

import inspect

import gin
import numpy as np
import tensorflow as tf

from tfdp import samplers
from tfdp import secret_key as secret_key_lib
from tfdp.data import preprocessing
from tfdp.data import sampling as sampling_lib

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


def _hosts(input_context):
    if input_context is None:
        return 0, 1
    return input_context.input_pipeline_id, input_context.num_input_pipelines


def _default_preprocess(source, train):
    """Decodes with the source's channel count and pins its static shape."""
    info = getattr(source, "info", None)
    shape = tuple(info.image_shape) if info is not None else None
    channels = shape[-1] if shape else 3

    @_no_autograph
    def preprocess(image, seed=None):
        del seed
        image = preprocessing.to_float(preprocessing.decode(image, channels))
        if shape and all(d is not None for d in shape):
            image = tf.ensure_shape(image, shape)
        return image

    if train:
        return preprocess
    return _no_autograph(lambda image: preprocess(image))


def _takes_seed(fn):
    """Whether a training preprocess_fn accepts the per-example seed."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


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


def _count_skipped(decode_stats):
    def finish_batch(images, labels, weights, lasts, skipped):
        decode_stats.skipped.assign_add(tf.reduce_sum(tf.cast(skipped, tf.int64)))
        # Physical batches never straddle two steps, so the step's final
        # element is always the final element of a physical batch.
        return images, labels, weights, lasts[-1]

    return finish_batch


def _indexed_train_pipeline(
    source, sampler, *, num_steps, start_step, seed, sampling_key, preprocess_fn, input_context,
    decode_stats, pad_granule,
):
    host, _ = _hosts(input_context)
    p = sampler.physical_batch_size
    # Physical batches per step are at most this many (the step's length is
    # at most its most rows rounded up to the granule, or P for an empty step).
    max_chunks = -(-sampler.max_step_rows // p) + 1

    def step_elements(step):
        indices, weights = sampler.step_indices(sampling_key, step, host, granule=pad_granule)
        length = tf.shape(indices)[0]
        position = tf.range(length)
        lasts = tf.equal(position, length - 1)
        seeds = sampling_lib.augment_seeds(seed, step, host, length)
        # Each element's physical batch, as one int64 key that also holds
        # the batch's length (see `_batch_by_key`).
        chunk = tf.cast(position // p, tf.int64)
        size = tf.cast(tf.minimum(p, length - (position // p) * p), tf.int64)
        keys = (step * max_chunks + chunk) * (p + 1) + size
        return tf.data.Dataset.from_tensor_slices((indices, weights, lasts, seeds, keys))

    def fetch(index, weight, last, seed, key):
        # Padding reuses example 0 for a valid shape and dtype; it is zeroed.
        image, label = source.fetch(tf.maximum(index, 0))
        return image, label, weight, last, seed, key

    if _reads_batches(source):
        return _indexed_batches(
            source, sampler, num_steps=num_steps, start_step=start_step, seed=seed,
            sampling_key=sampling_key, preprocess_fn=preprocess_fn, host=host,
            pad_granule=pad_granule,
        )
    ds = tf.data.Dataset.range(start_step, num_steps).flat_map(step_elements)
    ds = ds.map(fetch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = guarded_map(
        ds, preprocess_fn, lambda: find_substitute(source.as_dataset(), preprocess_fn)
    )
    if pad_granule == p:
        ds = ds.map(lambda *example: example[:-1]).batch(p, drop_remainder=True)
    else:
        ds = _batch_by_key(ds, p)
    return ds.map(_count_skipped(decode_stats))


def _reads_batches(source):
    """Whether `source` serves whole physical batches (`fetch_batch`).

    Only decoded images qualify: an encoded one may fail to decode, and
    `guarded_map` must isolate it example by example.
    """
    return hasattr(source, "fetch_batch") and not getattr(source, "encoded", True)


def _indexed_batches(
    source, sampler, *, num_steps, start_step, seed, sampling_key, preprocess_fn, host,
    pad_granule,
):
    """The batches of `_indexed_train_pipeline`, read and preprocessed batch by batch.

    The same indices, weights, seeds and zeroed padding as the per-example
    route, whose tf.data elements cost about 0.15 ms of CPU each: 32 of the
    40 ms per physical batch of the default run, taken from the training
    step on a 2-core machine.
    """
    p = sampler.physical_batch_size
    preprocess_batch = _batched_preprocess(source, preprocess_fn)

    def step_batches(step):
        indices, weights = sampler.step_indices(sampling_key, step, host, granule=pad_granule)
        length = tf.shape(indices)[0]
        seeds = sampling_lib.augment_seeds(seed, step, host, length)
        count = (length + p - 1) // p

        def physical_batch(chunk):
            chunk = tf.cast(chunk, tf.int32)
            window = slice(chunk * p, tf.minimum((chunk + 1) * p, length))
            return (indices[window], weights[window], tf.equal(chunk, count - 1),
                    seeds[window])

        return tf.data.Dataset.range(tf.cast(count, tf.int64)).map(_no_autograph(physical_batch))

    def read(indices, weights, last, seeds):
        # Padding reuses example 0 for a valid shape and dtype; it is zeroed.
        images, labels = source.fetch_batch(tf.maximum(indices, 0))
        images = preprocess_batch(images, seeds)
        real = weights > 0
        images = tf.where(
            tf.reshape(real, [-1] + [1] * (images.shape.rank - 1)), images,
            tf.zeros([], images.dtype),
        )
        labels = tf.where(real, tf.cast(labels, tf.int32), 0)
        if pad_granule == p:
            # Every physical batch is P long: keep the static batch size.
            images = tf.ensure_shape(images, [p] + images.shape.as_list()[1:])
            labels = tf.ensure_shape(labels, [p])
            weights = tf.ensure_shape(weights, [p])
        return images, labels, weights, last

    ds = tf.data.Dataset.range(start_step, num_steps).flat_map(_no_autograph(step_batches))
    return ds.map(_no_autograph_if(read, preprocess_fn), num_parallel_calls=tf.data.AUTOTUNE,
                  deterministic=True)


def _no_autograph(fn):
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


def _no_autograph_if(fn, callee):
    """`fn`, traced as written where the function it calls is (`_no_autograph`).

    Then `fn` calls none of the user's code: the default preprocessing, not
    a `preprocess_fn` that may rely on autograph (which converts what `fn`
    calls only when `fn` is converted).
    """
    return _no_autograph(fn) if getattr(callee, "_tfdp_no_autograph", False) else fn


def _batched_preprocess(source, preprocess_fn):
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
    vectorized = _no_autograph_if(vectorized, preprocess_fn)
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

    return _no_autograph_if(one_by_one, preprocess_fn)


def _batch_by_key(ds, physical_batch_size):
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


def _streaming_train_pipeline(
    source, sampler, *, num_steps, start_step, seed, sampling_key, preprocess_fn, input_context,
    shuffle_buffer, decode_stats,
):
    host, num_hosts = _hosts(input_context)
    per_host = sampler.logical_batch_size // num_hosts
    per_pass = int(sampler.steps_per_epoch) * per_host
    # The order is secret randomness too: both shuffles take the secret key.
    file_seed = int(sampling_key[0])

    def one_pass(pass_index):
        # A shuffle buffer is no uniform permutation: this order is accounted
        # with no amplification (the sampler's per-pass bound). Cutting each
        # pass to whole steps BEFORE repeating keeps every logical step inside
        # one pass, so no step can hold an example twice.
        ds = source.as_dataset(shuffle=True, seed=file_seed, input_context=input_context)
        buffer_seed = tf.random.experimental.stateless_fold_in(
            tf.constant(sampling_key, tf.int64), pass_index)[0]
        return ds.shuffle(shuffle_buffer, seed=buffer_seed).take(per_pass)

    ds = tf.data.Dataset.range(sampler.passes(num_steps)).flat_map(one_pass)
    # The stream is deterministic, so resuming replays and drops the consumed
    # prefix; decoding happens after the skip, keeping it cheap.
    ds = ds.skip(start_step * per_host).take((num_steps - start_step) * per_host)
    counter = tf.data.Dataset.range(start_step * per_host, num_steps * per_host)

    def attach(example, position):
        image, label = example
        step = position // per_host
        elem = position % per_host
        elem_seed = tf.random.experimental.stateless_fold_in(
            sampling_lib.augment_seeds(seed, step, host, 1)[0], elem
        )
        last = tf.equal(elem, per_host - 1)
        return image, tf.cast(label, tf.int32), tf.constant(1.0), last, elem_seed

    ds = tf.data.Dataset.zip((ds, counter)).map(
        attach, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
    )
    ds = guarded_map(
        ds, preprocess_fn,
        lambda: find_substitute(source.as_dataset(shuffle=False), preprocess_fn),
    )
    ds = ds.batch(sampler.physical_batch_size, drop_remainder=True)
    return ds.map(_count_skipped(decode_stats))


@gin.configurable(module="tfdp.data")
def make_train_pipeline(
    source,
    *,
    sampler,
    physical_batch_size=None,
    logical_batch_size=None,
    num_steps,
    start_step=0,
    seed,
    sampling_key=None,
    preprocess_fn=None,
    input_context=None,
    shuffle_buffer=16384,
    decode_stats=None,
    pad_granule=None,
):
    """Builds the training pipeline of physical batches.

    Each element is `(images, labels, weights, last)`: float32
    `[P, H, W, C]`, int32 `[P]`, float32 `[P]` (1 real, 0 padding) and a bool
    scalar that is True on the last physical batch of a logical step. The
    batches of step `s` are a pure function of `(sampling_key, s)`.

    Args:
        source: An `ArraySource`, `RandomAccessSource` or `StreamingSource`
            (see `tfdp.data.sources`).
        sampler: `tfdp.samplers.Sampler`, or a sampler name ("poisson",
            "shuffle"; see `tfdp.samplers`) with the two batch sizes. It
            draws the indices of each step; a streaming source gets the
            shuffle sampler's per-pass buffer order.
        physical_batch_size: int. Examples per physical batch P (per host),
            with a sampler name. Defaults to the sampler's.
        logical_batch_size: int. Expected (Poisson) or exact (shuffle)
            examples per logical step, over all hosts, with a sampler name.
        num_steps: int. Total logical steps of the run; the pipeline ends
            after step `num_steps - 1`.
        start_step: int. First step to produce, for exact resume. Defaults
            to `0`.
        seed: int. Public seed of the augmentations.
        sampling_key: int64 `[2]` or None. The run's secret sampling sub-key
            (`SecretKey.derive("sampling")`); the batches of step `s` are a
            pure function of `(sampling_key, s)`. Defaults to None: a fresh
            key from the OS's entropy (pass the checkpointed one to resume).
        preprocess_fn: callable, optional. `fn(image, seed) -> image`
            returning float32 with a static shape (see
            `tfdp.data.preprocessing`); `seed` is an int64 `[2]` stateless
            seed for augmentations. A one-argument `fn(image)` is also
            accepted. Defaults to `None` (decode if needed and scale to
            [0, 1]).
        input_context: `tf.distribute.InputContext`, optional. Produces this
            host's share: for Poisson, sampled index number i goes to host
            `i % num_hosts` and every host pads to the same number of
            physical batches. Defaults to `None` (one host).
        shuffle_buffer: int. Shuffle buffer of streaming sources. Defaults
            to `16384`.
        decode_stats: `DecodeStats`, optional. Counts the real examples
            whose encoded image failed to decode; those become weight-0
            examples with a zero image and label 0. Defaults to `None` (a
            new one).
        pad_granule: int, "auto" or None. Poisson steps have random sizes;
            each is padded (weight 0) to a multiple of this divisor of P
            only, and its last physical batch is that much smaller: so a
            step of 260 with P = 256 costs 256 + 32 examples at a granule of
            32, not 512. There are at most P / granule distinct lengths:
            `PrivateTrainStep` serves them with one trace of unknown batch
            size from the second length on, but XLA (`jit_compile`)
            compiles each. "auto" is P / 8 (or P / 4, P / 2 where 8 does not
            divide P). Defaults to `None` (P: every physical batch is P
            long).

    Returns:
        A `tf.data.Dataset`, with the counter as its `decode_stats`
        attribute.
    """
    sampler = train_sampler(
        source, sampler=sampler, physical_batch_size=physical_batch_size,
        logical_batch_size=logical_batch_size, input_context=input_context,
    )
    sampler.check_source(source)
    if not 0 <= start_step <= num_steps:
        raise ValueError(
            "`start_step` must be in [0, num_steps]. Received: "
            f"start_step={start_step}, num_steps={num_steps}"
        )
    if preprocess_fn is None:
        preprocess_fn = _default_preprocess(source, train=True)
    elif not _takes_seed(preprocess_fn):
        # Deterministic preprocessing written as fn(image) is accepted too.
        image_fn = preprocess_fn

        def preprocess_fn(image, seed):
            del seed
            return image_fn(image)

    if sampling_key is None:
        sampling_key = secret_key_lib.SecretKey.generate().derive("sampling")
    kwargs = dict(
        num_steps=num_steps,
        start_step=start_step,
        seed=seed,
        sampling_key=np.asarray(sampling_key, np.int64),
        preprocess_fn=preprocess_fn,
        input_context=input_context,
        decode_stats=decode_stats or DecodeStats(),
    )
    if getattr(source, "random_access", False):
        ds = _indexed_train_pipeline(
            source, sampler,
            pad_granule=resolve_pad_granule(pad_granule, sampler.physical_batch_size),
            **kwargs,
        )
    else:
        ds = _streaming_train_pipeline(source, sampler, shuffle_buffer=shuffle_buffer, **kwargs)
    ds = _without_autotune_thread(ds.prefetch(tf.data.AUTOTUNE))
    ds.decode_stats = kwargs["decode_stats"]
    return ds


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


def _without_autotune_thread(ds):
    """`ds` with tf.data's autotuning off (AUTOTUNE then means one per core).

    The autotuner's background thread sleeps between optimisations for up
    to a minute, and destroying an iterator waits for it to wake: a run's
    last `for batch in pipeline` stalled 39-89 s after its last step. With
    the tuner off the iterator is freed at once.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.with_options(options)


def train_sampler(
    source, *, sampler, physical_batch_size=None, logical_batch_size=None, input_context=None
):
    """The sampler of `make_train_pipeline` for this source and host.

    Args:
        source: A source (anything with `len()`), or the dataset size.
        sampler: `tfdp.samplers.Sampler` or a registered name.
        physical_batch_size: int. Examples per physical batch, with a name.
            Overrides the sampler's when given.
        logical_batch_size: int. Expected or exact logical batch size, with
            a name.
        input_context: `tf.distribute.InputContext`, optional. Its number of
            input pipelines splits each step. Defaults to `None`.
    """
    size = source if isinstance(source, int) else len(source)
    num_hosts = _hosts(input_context)[1]
    if isinstance(sampler, samplers.Sampler):
        if sampler.num_examples != size:
            raise ValueError(
                "The sampler was made for another dataset size. Received: "
                f"sampler examples={sampler.num_examples}, source size={size}"
            )
        return sampler.with_hosts(num_hosts, physical_batch_size)
    return samplers.make_sampler(
        sampler, dataset_size=size, logical_batch_size=logical_batch_size,
        physical_batch_size=physical_batch_size, num_hosts=num_hosts,
    )


@_no_autograph
def _padded_to(batch_size, images, labels, weights):
    """A final partial evaluation batch padded with weight-0 zeros to a static size."""
    missing = batch_size - tf.shape(labels)[0]
    images = tf.pad(images, [[0, missing]] + [[0, 0]] * (images.shape.rank - 1))
    labels = tf.pad(labels, [[0, missing]])
    weights = tf.pad(weights, [[0, missing]])
    images.set_shape([batch_size] + images.shape.as_list()[1:])
    labels.set_shape([batch_size])
    weights.set_shape([batch_size])
    return images, labels, weights


def _pad_batch(batch_size, decode_stats):
    def pad(images, labels, weights, lasts, skipped):
        del lasts
        decode_stats.skipped.assign_add(tf.reduce_sum(tf.cast(skipped, tf.int64)))
        return _padded_to(batch_size, images, labels, weights)

    return pad


def _eval_batches(source, batch_size, preprocess_fn, input_context):
    """`make_eval_pipeline`'s batches of a `fetch_batch` source, read batch by batch.

    This host's examples are those of `source.as_dataset`'s shard, in the
    same order; the last batch is padded the same way.
    """
    host, num_hosts = _hosts(input_context)
    indices = np.arange(host, len(source), num_hosts, dtype=np.int64)
    preprocess_batch = _batched_preprocess(source, preprocess_fn)

    def read(batch_indices):
        images, labels = source.fetch_batch(batch_indices)
        count = tf.shape(batch_indices)[0]
        images = preprocess_batch(images, tf.zeros([count, 2], tf.int64))
        return _padded_to(
            batch_size, images, tf.cast(labels, tf.int32), tf.ones([count], tf.float32)
        )

    ds = tf.data.Dataset.from_tensor_slices(indices).batch(batch_size)
    return ds.map(_no_autograph_if(read, preprocess_fn), num_parallel_calls=tf.data.AUTOTUNE,
                  deterministic=True)


# Evaluation batches of in-memory arrays are cached up to this size.
_EVAL_CACHE_BYTES = 256 * 2**20


def _small_decoded_array(source, ds, limit):
    """Whether `ds`, batches of an in-memory decoded array source, fits `limit` bytes."""
    images = getattr(source, "images", None)
    if images is None or getattr(source, "encoded", True):
        return False
    spec = ds.element_spec[0]
    if not spec.shape.is_fully_defined():
        return False
    per_batch = spec.shape.num_elements() * spec.dtype.size
    return -(-len(source) // int(spec.shape[0])) * per_batch <= limit


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
        preprocess_fn = _default_preprocess(source, train=False)
    image_fn = preprocess_fn
    decode_stats = decode_stats or DecodeStats()

    def seeded(image, seed):
        del seed
        return image_fn(image)

    seeded = _no_autograph_if(seeded, image_fn)

    if _reads_batches(source):
        ds = _eval_batches(source, batch_size, seeded, input_context)
    else:
        ds = source.as_dataset(shuffle=False, input_context=input_context)
        ds = ds.map(
            lambda image, label: (
                image, label, tf.constant(1.0), tf.constant(False), tf.zeros([2], tf.int64)
            )
        )
        ds = guarded_map(
            ds, seeded, lambda: find_substitute(source.as_dataset(shuffle=False), seeded)
        )
        ds = ds.batch(batch_size).map(_pad_batch(batch_size, decode_stats))
    if _small_decoded_array(source, ds, _EVAL_CACHE_BYTES):
        # Every pass is the same: keep the batches rather than preprocess the
        # examples again at every evaluation (a third of the default run's
        # evaluation time). Decoded arrays have no undecodable images to count.
        ds = ds.cache()
    ds = _without_autotune_thread(ds.prefetch(tf.data.AUTOTUNE))
    ds.decode_stats = decode_stats
    return ds
