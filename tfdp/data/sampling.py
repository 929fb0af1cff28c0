"""Samplers: which example indices form each logical step.

Both samplers are stateless: the indices of step `s` are a pure function of
`(sampling_key, s)` (and the host), computed inside the tf.data graph, so a
run resumed at step `s` with its checkpointed key sees exactly the batches it
would have seen. `sampling_key` is the run's secret sub-key
(`tfdp.secret_key.SecretKey.derive("sampling")`): amplification by sampling
holds only against an adversary who cannot predict which examples were drawn.
The augmentations, which need no secrecy, use the public `--seed`.
"""

import dataclasses

import gin
import tensorflow as tf

SAMPLINGS = ("poisson", "shuffle")

# Salts keep the random streams of the mask and the permutation independent
# of each other and of the augmentations.
_SALT_POISSON = 0x5EED0001
_SALT_SHUFFLE = 0x5EED0002
_SALT_AUGMENT = 0x5EED0003


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """Describes how logical batches are sampled.

    Args:
        sampling: str. `"poisson"` or `"shuffle"`.
        dataset_size: int. Number of training examples N.
        logical_batch_size: int. Expected (Poisson) or exact (shuffle)
            number of examples per logical step.
        physical_batch_size: int. Examples per physical batch.
        sampling_rate: float. q = logical_batch_size / dataset_size.
    """

    sampling: str
    dataset_size: int
    logical_batch_size: int
    physical_batch_size: int
    sampling_rate: float

    @property
    def expected_batch_size(self):
        """q·N for Poisson (equal to B up to rounding), B for shuffle."""
        if self.sampling == "poisson":
            return self.sampling_rate * self.dataset_size
        return float(self.logical_batch_size)

    @property
    def steps_per_epoch(self):
        """Logical steps per pass over the data (N // B for shuffle)."""
        if self.sampling == "poisson":
            return self.dataset_size / self.logical_batch_size
        return self.dataset_size // self.logical_batch_size

    @property
    def physical_batches_per_step(self):
        """Exact for shuffle; the expected count, ignoring padding, for Poisson."""
        if self.sampling == "shuffle":
            return self.logical_batch_size // self.physical_batch_size
        return self.expected_batch_size / self.physical_batch_size


@gin.configurable(module="tfdp.data")
def make_sampling_spec(
    sampling, *, dataset_size, logical_batch_size, physical_batch_size, num_hosts=1
):
    """Validates the sampling arguments and returns a `SamplingSpec`.

    Args:
        sampling: str. `"poisson"` (each example joins a step independently
            with probability q) or `"shuffle"` (fixed-size batches from a
            per-epoch permutation).
        dataset_size: int. Number of training examples N.
        logical_batch_size: int. Expected (Poisson) or exact (shuffle)
            logical batch size B.
        physical_batch_size: int. Examples per physical batch P, per host.
        num_hosts: int. Number of input pipelines. Defaults to `1`.

    Returns:
        A `SamplingSpec`.
    """
    if sampling not in SAMPLINGS:
        raise ValueError(f"`sampling` must be one of {SAMPLINGS}. Received: sampling={sampling!r}")
    for arg, value in (
        ("dataset_size", dataset_size),
        ("logical_batch_size", logical_batch_size),
        ("physical_batch_size", physical_batch_size),
        ("num_hosts", num_hosts),
    ):
        if int(value) != value or value < 1:
            raise ValueError(f"`{arg}` must be a positive integer. Received: {arg}={value}")
    if logical_batch_size > dataset_size:
        raise ValueError(
            "`logical_batch_size` must not exceed the dataset size. Received: "
            f"logical_batch_size={logical_batch_size}, dataset_size={dataset_size}"
        )
    if sampling == "shuffle":
        if logical_batch_size % num_hosts:
            raise ValueError(
                "For sampling='shuffle', `logical_batch_size` must be divisible by "
                f"the number of hosts. Received: logical_batch_size={logical_batch_size}, "
                f"num_hosts={num_hosts}"
            )
        if (logical_batch_size // num_hosts) % physical_batch_size:
            raise ValueError(
                "For sampling='shuffle', `physical_batch_size` must divide the "
                "per-host logical batch size (logical_batch_size / num_hosts). "
                f"Received: physical_batch_size={physical_batch_size}, "
                f"logical_batch_size={logical_batch_size}, num_hosts={num_hosts}"
            )
    return SamplingSpec(
        sampling=sampling,
        dataset_size=int(dataset_size),
        logical_batch_size=int(logical_batch_size),
        physical_batch_size=int(physical_batch_size),
        sampling_rate=logical_batch_size / dataset_size,
    )


def _key(base_key, salt, *data):
    """A stateless seed `[2]` int64 derived from `base_key` `[2]`, a salt and `data`."""
    key = tf.random.experimental.stateless_fold_in(
        tf.cast(base_key, tf.int64), tf.constant(salt, tf.int64)
    )
    for d in data:
        key = tf.random.experimental.stateless_fold_in(key, tf.cast(d, tf.int64))
    return key


def augment_seeds(seed, step, host, count):
    """Per-element stateless seeds `[count, 2]` for the augmentations of a step.

    Args:
        seed: int. The run's public seed.
    """
    key = _key(tf.stack([tf.cast(seed, tf.int64), tf.constant(0, tf.int64)]),
               _SALT_AUGMENT, step, host)
    return tf.random.stateless_uniform(
        [count, 2], seed=key, minval=None, maxval=None, dtype=tf.int64
    )


def poisson_mask(sampling_key, step, dataset_size, sampling_rate):
    """Boolean `[N]`: example i is in step `step` with probability q."""
    u = tf.random.stateless_uniform(
        [dataset_size], seed=_key(sampling_key, _SALT_POISSON, step), dtype=tf.float64
    )
    return u < sampling_rate


def poisson_step(sampling_key, step, spec, host=0, num_hosts=1):
    """This host's share of the Poisson sample of `step`, padded.

    Sampled index number i (in increasing index order) goes to host
    `i % num_hosts`, so the hosts' shares partition the sample. Every host
    pads to the same length, a positive multiple of the physical batch
    size, so all hosts run the same number of physical batches per step and
    an empty step still yields one (all-padding) physical batch.

    Returns:
        `(indices, weights)`: int64 `[L]` with -1 for padding and float32
        `[L]`, where L is a positive multiple of `spec.physical_batch_size`.
    """
    mask = poisson_mask(sampling_key, step, spec.dataset_size, spec.sampling_rate)
    sampled = tf.where(mask)[:, 0]
    n = tf.shape(sampled, out_type=tf.int64)[0]
    mine = sampled[host::num_hosts]
    p = spec.physical_batch_size
    per_host = (n + num_hosts - 1) // num_hosts
    num_batches = tf.maximum((per_host + p - 1) // p, 1)
    length = num_batches * p
    pad = length - tf.shape(mine, out_type=tf.int64)[0]
    indices = tf.concat([mine, -tf.ones([pad], tf.int64)], axis=0)
    weights = tf.cast(indices >= 0, tf.float32)
    return indices, weights


def shuffle_step(sampling_key, step, spec, host=0, num_hosts=1):
    """This host's share of shuffle-sampled step `step`.

    Epoch e = step // steps_per_epoch uses the stateless permutation
    `index_shuffle(., seed=fold(sampling_key, e))`; step positions j with
    `j % num_hosts == host` go to this host.

    Returns:
        `(indices, weights)`: int64 `[B / num_hosts]` and float32 ones.
    """
    steps_per_epoch = spec.dataset_size // spec.logical_batch_size
    step = tf.cast(step, tf.int64)
    epoch = step // steps_per_epoch
    offset = (step % steps_per_epoch) * spec.logical_batch_size
    positions = offset + tf.range(host, spec.logical_batch_size, num_hosts, dtype=tf.int64)
    indices = tf.random.experimental.index_shuffle(
        positions, seed=_key(sampling_key, _SALT_SHUFFLE, epoch), max_index=spec.dataset_size - 1
    )
    weights = tf.ones(tf.shape(indices), tf.float32)
    return indices, weights


def step_indices(sampling_key, step, spec, host=0, num_hosts=1):
    """Dispatches to `poisson_step` or `shuffle_step`.

    Args:
        sampling_key: int64 `[2]`. The run's secret sampling sub-key.
    """
    if spec.sampling == "poisson":
        return poisson_step(sampling_key, step, spec, host, num_hosts)
    return shuffle_step(sampling_key, step, spec, host, num_hosts)
