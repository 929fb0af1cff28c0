"""Training and evaluation input pipelines.

Training elements are physical batches `(images, labels, weights, last)`:
images float32 `[P, H, W, C]`, labels int32 `[P]`, weights float32 `[P]`
(0 for padding), and `last`, a bool scalar that is True on the final
physical batch of a logical step.
"""

import inspect

import gin
import tensorflow as tf

from tfdp.data import preprocessing
from tfdp.data import sampling as sampling_lib


def _hosts(input_context):
    if input_context is None:
        return 0, 1
    return input_context.input_pipeline_id, input_context.num_input_pipelines


def _default_preprocess(source, train):
    """Decodes with the source's channel count and pins its static shape."""
    info = getattr(source, "info", None)
    shape = tuple(info.image_shape) if info is not None else None
    channels = shape[-1] if shape else 3

    def preprocess(image, seed=None):
        del seed
        image = preprocessing.to_float(preprocessing.decode(image, channels))
        if shape and all(d is not None for d in shape):
            image = tf.ensure_shape(image, shape)
        return image

    if train:
        return preprocess
    return lambda image: preprocess(image)


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


def _check_source(source, sampling):
    if sampling == "poisson" and not getattr(source, "random_access", False):
        raise ValueError(
            "sampling='poisson' needs a random-access source (an ArraySource, or "
            "a tfds dataset prepared with `tfds build <name> "
            "--file_format=array_record`). Use sampling='shuffle' for streaming "
            f"sources. Received: source={type(source).__name__}"
        )


def _load(source, preprocess_fn):
    """Per-element map: fetch, preprocess, and blank out padding."""

    def load(index, weight, last, seed):
        image, label = source.fetch(tf.maximum(index, 0))
        image = preprocess_fn(image, seed)
        # Padding reuses example 0 for a valid shape and dtype; zero it so
        # padding never depends on real data.
        real = weight > 0
        image = tf.where(real, image, tf.zeros_like(image))
        label = tf.where(real, tf.cast(label, tf.int32), 0)
        return image, label, weight, last

    return load


def _finish_batch(images, labels, weights, lasts):
    # Each step's length is a multiple of P, so the step's final element is
    # always the final element of a physical batch.
    return images, labels, weights, lasts[-1]


def _indexed_train_pipeline(
    source, spec, *, num_steps, start_step, seed, preprocess_fn, input_context
):
    host, num_hosts = _hosts(input_context)

    def step_elements(step):
        indices, weights = sampling_lib.step_indices(seed, step, spec, host, num_hosts)
        length = tf.shape(indices)[0]
        lasts = tf.equal(tf.range(length), length - 1)
        seeds = sampling_lib.augment_seeds(seed, step, host, length)
        return tf.data.Dataset.from_tensor_slices((indices, weights, lasts, seeds))

    ds = tf.data.Dataset.range(start_step, num_steps).flat_map(step_elements)
    ds = ds.map(
        _load(source, preprocess_fn), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
    )
    ds = ds.batch(spec.physical_batch_size, drop_remainder=True)
    return ds.map(_finish_batch)


def _streaming_train_pipeline(
    source, spec, *, num_steps, start_step, seed, preprocess_fn, input_context, shuffle_buffer
):
    host, num_hosts = _hosts(input_context)
    per_host = spec.logical_batch_size // num_hosts
    ds = source.as_dataset(shuffle=True, seed=seed, input_context=input_context)
    ds = ds.repeat().shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    # The stream is deterministic, so resuming replays and drops the consumed
    # prefix; decoding happens after the skip, keeping it cheap.
    ds = ds.skip(start_step * per_host).take((num_steps - start_step) * per_host)
    counter = tf.data.Dataset.range(start_step * per_host, num_steps * per_host)

    def load(example, position):
        image, label = example
        step = position // per_host
        elem = position % per_host
        elem_seed = tf.random.experimental.stateless_fold_in(
            sampling_lib.augment_seeds(seed, step, host, 1)[0], elem
        )
        image = preprocess_fn(image, elem_seed)
        last = tf.equal(elem, per_host - 1)
        return image, tf.cast(label, tf.int32), tf.constant(1.0), last

    ds = tf.data.Dataset.zip((ds, counter)).map(
        load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
    )
    ds = ds.batch(spec.physical_batch_size, drop_remainder=True)
    return ds.map(_finish_batch)


@gin.configurable(module="tfdp.data")
def make_train_pipeline(
    source,
    *,
    sampling,
    physical_batch_size,
    logical_batch_size,
    num_steps,
    start_step=0,
    seed,
    preprocess_fn=None,
    input_context=None,
    shuffle_buffer=16384,
):
    """Builds the training pipeline of physical batches.

    Each element is `(images, labels, weights, last)`: float32
    `[P, H, W, C]`, int32 `[P]`, float32 `[P]` (1 real, 0 padding) and a bool
    scalar that is True on the last physical batch of a logical step. The
    batches of step `s` are a pure function of `(seed, s)`.

    Args:
        source: An `ArraySource`, `RandomAccessSource` or `StreamingSource`
            (see `tfdp.data.sources`).
        sampling: str. `"poisson"`: each example joins step s independently
            with probability q = logical_batch_size / N (mask drawn in-graph
            from a stateless RNG seeded by (seed, s)), padded with weight-0
            examples up to a multiple of P; an empty step yields one
            all-padding batch. `"shuffle"`: per-epoch stateless permutation,
            consecutive chunks of `logical_batch_size`, no padding.
        physical_batch_size: int. Examples per physical batch P (per host).
        logical_batch_size: int. Expected (Poisson) or exact (shuffle)
            examples per logical step, over all hosts.
        num_steps: int. Total logical steps of the run; the pipeline ends
            after step `num_steps - 1`.
        start_step: int. First step to produce, for exact resume. Defaults
            to `0`.
        seed: int. Seed of sampling and augmentation.
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

    Returns:
        A `tf.data.Dataset`.
    """
    _check_source(source, sampling)
    _, num_hosts = _hosts(input_context)
    spec = sampling_lib.make_sampling_spec(
        sampling,
        dataset_size=len(source),
        logical_batch_size=logical_batch_size,
        physical_batch_size=physical_batch_size,
        num_hosts=num_hosts,
    )
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

    kwargs = dict(
        num_steps=num_steps,
        start_step=start_step,
        seed=seed,
        preprocess_fn=preprocess_fn,
        input_context=input_context,
    )
    if getattr(source, "random_access", False):
        ds = _indexed_train_pipeline(source, spec, **kwargs)
    else:
        ds = _streaming_train_pipeline(source, spec, shuffle_buffer=shuffle_buffer, **kwargs)
    return ds.prefetch(tf.data.AUTOTUNE)


@gin.configurable(module="tfdp.data")
def train_sampling_spec(
    source, *, sampling, physical_batch_size, logical_batch_size, input_context=None
):
    """Returns the `SamplingSpec` of `make_train_pipeline` with these args.

    Args:
        source: A source (anything with `len()`), or the dataset size.
        sampling: str. `"poisson"` or `"shuffle"`.
        physical_batch_size: int. Examples per physical batch.
        logical_batch_size: int. Expected or exact logical batch size.
        input_context: `tf.distribute.InputContext`, optional. Defaults to
            `None`.
    """
    size = source if isinstance(source, int) else len(source)
    return sampling_lib.make_sampling_spec(
        sampling,
        dataset_size=size,
        logical_batch_size=logical_batch_size,
        physical_batch_size=physical_batch_size,
        num_hosts=_hosts(input_context)[1],
    )


def _pad_batch(batch_size):
    def pad(images, labels):
        n = tf.shape(labels)[0]
        missing = batch_size - n
        images = tf.pad(images, [[0, missing]] + [[0, 0]] * (images.shape.rank - 1))
        labels = tf.pad(labels, [[0, missing]])
        weights = tf.pad(tf.ones([n], tf.float32), [[0, missing]])
        images.set_shape([batch_size] + images.shape.as_list()[1:])
        labels.set_shape([batch_size])
        weights.set_shape([batch_size])
        return images, labels, weights

    return pad


@gin.configurable(module="tfdp.data")
def make_eval_pipeline(source, batch_size, preprocess_fn=None, input_context=None):
    """Builds the evaluation pipeline, every example exactly once.

    Elements are `(images, labels, weights)` with static batch size; the
    final partial batch is padded with zero images of weight 0.

    Args:
        source: A source (see `tfdp.data.sources`).
        batch_size: int. Examples per batch.
        preprocess_fn: callable, optional. `fn(image) -> image` returning
            float32 with a static shape. Defaults to `None` (decode if
            needed and scale to [0, 1]).
        input_context: `tf.distribute.InputContext`, optional. Each host
            evaluates a disjoint shard. Defaults to `None`.

    Returns:
        A `tf.data.Dataset`.
    """
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be positive. Received: batch_size={batch_size}")
    if preprocess_fn is None:
        preprocess_fn = _default_preprocess(source, train=False)
    ds = source.as_dataset(shuffle=False, input_context=input_context)
    ds = ds.map(
        lambda image, label: (preprocess_fn(image), tf.cast(label, tf.int32)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    ds = ds.batch(batch_size).map(_pad_batch(batch_size))
    return ds.prefetch(tf.data.AUTOTUNE)
