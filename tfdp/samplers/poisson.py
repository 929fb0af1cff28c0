"""`PoissonSampler`: each example joins each step independently with probability q."""

import dp_accounting

from tfdp.samplers import base
from tfdp.samplers import keys


@base.register
class PoissonSampler(base.Sampler):
    """Poisson sampling, accounted with amplification by sampling.

    Step s includes example i independently with probability q = B/N, from
    a stateless uniform keyed by (secret sampling key, s). The step's
    examples are split over the hosts (sampled index number i goes to host
    i mod H) and padded with weight-0 examples to the same positive multiple
    of the granule (P unless the pipeline asks for a finer one) on every
    host, so that all hosts run the same number of physical batches and an
    empty step still yields one (all-padding) batch.

    The accountant composes the Poisson-subsampled Gaussian mechanism once
    per step under add/remove-one adjacency. The divisor of the noisy sum is
    the expected size q·N, never the realised one, which would leak it.

    Args: see `tfdp.samplers.Sampler`.
    """

    name = "poisson"
    user_form = "user_poisson"
    banded_form = "banded_poisson"
    amplified = True
    needs_random_access = True
    fixed_size_steps = False

    @property
    def expected_batch_size(self):
        return self.sampling_rate * self.dataset_size

    @property
    def steps_per_epoch(self):
        return self.dataset_size / self.logical_batch_size

    def unit_event(self, noise_multiplier):
        return dp_accounting.PoissonSampledDpEvent(
            self.sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
        )

    def unit_count(self, steps):
        return int(steps)

    def mask(self, sampling_key, step):
        """Boolean `[N]`: example i is in step `step` with probability q."""
        import tensorflow as tf

        u = tf.random.stateless_uniform(
            [self.dataset_size], seed=keys.fold(sampling_key, keys.SALT_POISSON, step),
            dtype=tf.float64,
        )
        return u < self.sampling_rate

    def step_indices(self, sampling_key, step, host=0, granule=None):
        import tensorflow as tf

        sampled = tf.where(self.mask(sampling_key, step))[:, 0]
        n = tf.shape(sampled, out_type=tf.int64)[0]
        mine = sampled[host::self.num_hosts]
        g = self.physical_batch_size if granule is None else int(granule)
        # From the global count, so that every host pads to the same length.
        per_host = (n + self.num_hosts - 1) // self.num_hosts
        length = tf.maximum((per_host + g - 1) // g, 1) * g
        pad = length - tf.shape(mine, out_type=tf.int64)[0]
        indices = tf.concat([mine, -tf.ones([pad], tf.int64)], axis=0)
        return indices, tf.cast(indices >= 0, tf.float32)
