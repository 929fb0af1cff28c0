"""`ShuffleSampler`: fixed-size batches, each example once per pass, any order."""

import math

import dp_accounting

from tfdp.samplers import base
from tfdp.samplers import keys


@base.register
class ShuffleSampler(base.Sampler):
    """Fixed-size batches from a per-pass order; accounted for ANY order.

    Each pass over the data is cut into N // B logical steps of exactly B
    examples (the N mod B left over sit out that pass). A logical step never
    spans two passes, and no example appears twice in a pass. With random
    access, pass e is the stateless permutation `index_shuffle(., key_e)`
    keyed by the secret sampling key; a streaming source is shuffled by a
    buffer instead, which is not a uniform permutation.

    So the accountant assumes nothing about the order: within one pass each
    example touches one step, with sensitivity C and noise σC, so one pass
    is at most one Gaussian mechanism with noise multiplier σ, and the run
    composes one per pass (a partial pass counts as whole). This holds under
    zero-out adjacency: the neighbouring dataset leaves one example's slot
    empty (its batch contributes nothing for it; the divisor is the fixed
    B), every other example keeping its place. It does not hold for truly
    removing an example: with a public order (`fit(shuffle=False)`, a
    stream's own order) that shifts every later example to another step.
    Replacing one example by another moves one step's sum by up to 2C, so
    the replace-one ε, also reported, is this bound with σ / 2 per pass.
    The zero-out figure is the "each example occurring once per epoch"
    figure of TF-Privacy's `compute_dp_sgd_privacy_statement` with
    `used_microbatching=False`. It is much larger than the Poisson figure:
    shuffling gets no amplification here (Chua et al. 2024, "How private
    are DP-SGD implementations?").

    Args: see `tfdp.samplers.Sampler`. The per-host logical batch B / H
    must be a multiple of P.
    """

    name = "shuffle"
    amplified = False
    adjacency = "zero_out"
    adjacency_description = "zero-out: one example's slot left empty, the others in place"
    replace_one_sensitivity = 2
    needs_random_access = False
    fixed_size_steps = True

    def _validate(self):
        if self.logical_batch_size % self.num_hosts:
            raise ValueError(
                "For sampler='shuffle', `logical_batch_size` must be divisible by "
                f"the number of hosts. Received: logical_batch_size={self.logical_batch_size}, "
                f"num_hosts={self.num_hosts}"
            )
        if (self.logical_batch_size // self.num_hosts) % self.physical_batch_size:
            raise ValueError(
                "For sampler='shuffle', `physical_batch_size` must divide the "
                "per-host logical batch size (logical_batch_size / num_hosts). "
                f"Received: physical_batch_size={self.physical_batch_size}, "
                f"logical_batch_size={self.logical_batch_size}, num_hosts={self.num_hosts}"
            )

    @property
    def expected_batch_size(self):
        return float(self.logical_batch_size)

    @property
    def steps_per_epoch(self):
        return self.dataset_size // self.logical_batch_size

    def unit_event(self, noise_multiplier):
        return dp_accounting.GaussianDpEvent(noise_multiplier)

    def unit_count(self, steps):
        """One Gaussian mechanism per pass (see `passes`)."""
        return self.passes(steps)

    def step_indices(self, sampling_key, step, host=0, granule=None):
        # Fixed-size steps are whole physical batches: no padding to refine.
        del granule
        import tensorflow as tf

        epoch = tf.cast(step, tf.int64) // self.steps_per_epoch
        positions, weights = self.ordered_step_indices(step, host)
        indices = tf.random.experimental.index_shuffle(
            positions, seed=keys.fold(sampling_key, keys.SALT_SHUFFLE, epoch),
            max_index=self.dataset_size - 1,
        )
        return indices, weights

    def ordered_step_indices(self, step, host=0):
        """Positions `[(s mod S)·B, (s mod S + 1)·B)` of the pass, this host's share."""
        import tensorflow as tf

        step = tf.cast(step, tf.int64)
        offset = (step % self.steps_per_epoch) * self.logical_batch_size
        positions = offset + tf.range(host, self.logical_batch_size, self.num_hosts,
                                      dtype=tf.int64)
        return positions, tf.ones(tf.shape(positions), tf.float32)

    def passes(self, steps):
        """Passes over the data that `steps` logical steps touch; a partial
        pass counts as a pass."""
        return math.ceil(int(steps) / self.steps_per_epoch)
