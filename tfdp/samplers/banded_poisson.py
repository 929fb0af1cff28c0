"""`BandGroups` and `BandedPoissonSampler`: b groups, step t samples group t mod b (BandMF)."""

import dp_accounting
import numpy as np

from tfdp.samplers import base
from tfdp.samplers import keys
from tfdp.samplers import poisson


class BandGroups:
    """Poisson sampling within b secret groups of a sampler's privacy units (BandMF).

    Mixed into a Poisson sampler (before it in the bases) whose `mask` is
    over `dataset_size` privacy units: `BandedPoissonSampler` (examples),
    `BandedUserPoissonSampler` (users). Each unit is put once into one of b
    groups by a draw of its own, uniform over the groups, from the secret
    sampling key and independent of every other unit's (`groups`). Step t
    draws from group t mod b only, each of its units independently with
    probability q = B / (N / b) = b·B / N, from the same uniform as
    `PoissonSampler` (so with b = 1 its masks are the Poisson sampler's
    exactly). The steps of one unit are therefore at least b apart.

    Why independent draws: the privacy argument (docs/PRIVACY.md, "Banded
    matrix factorization") conditions on the other units' groups. Adding or
    removing one unit must leave their groups distributed as before, which
    independent draws do and a balanced split does not (splitting N + 1 units
    into groups of ⌈(N+1)/b⌉ and ⌊(N+1)/b⌋ ties the others' groups to the
    added unit's).

    Group sizes therefore vary: a group holds Binomial(N, 1/b) units, whose
    relative spread is √((b − 1) / N) (2.7 % at N = 4,000, b = 4), and a
    step's expected batch is q times its group's size. The divisor stays B,
    public; a group larger than N / b gets a proportionally larger update.

    Accounting (amplified banded matrix factorization, Choquette-Choo et al.
    2023, Theorem 4, as `jax_privacy`'s `amplified_bandmf_event`): with a
    b-banded strategy whose columns have norm <= 1
    (`tfdp.privacy.banded_mf`), T steps are DP-SGD over ⌈T/b⌉ rounds of the
    Poisson-subsampled Gaussian at the rate q within a group. The divisor of
    the noisy sum is B, the expected batch size (a group's expected size
    times q).

    Args:
        *args, **kwargs: the arguments of the sampler it is mixed into.
        bands: int. b >= 1, the strategy's bands and the number of groups.
            Defaults to 1 (Poisson sampling).
    """

    takes_bands = True

    def __init__(self, *args, bands=1, **kwargs):
        self.bands = base.positive_int("bands", bands)
        # The groups of each key drawn so far: they are fixed for a run, and
        # every step's mask would otherwise draw them again.
        self._groups_by_key = {}
        super().__init__(*args, **kwargs)

    def _validate(self):
        super()._validate()
        if self.bands * self.logical_batch_size > self.dataset_size:
            units = f"{self.privacy_unit}s"
            raise ValueError(
                f"For sampler={self.name!r}, bands × logical_batch_size must not exceed the "
                f"dataset size ({units}): each step samples one of `bands` groups of about "
                f"N / bands {units}. Received: bands={self.bands}, "
                f"logical_batch_size={self.logical_batch_size}, dataset_size={self.dataset_size}"
            )

    @property
    def group_sampling_rate(self):
        """q = B / (N / b): each unit's probability in a step of its group."""
        return self.logical_batch_size * self.bands / self.dataset_size

    def unit_event(self, noise_multiplier):
        return dp_accounting.PoissonSampledDpEvent(
            self.group_sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
        )

    def unit_count(self, steps):
        """⌈T/b⌉ rounds: each unit takes part in at most one step of b."""
        return -(-int(steps) // self.bands)

    def groups(self, sampling_key):
        """int64 `[N]`: the group of each unit, in [0, b)."""
        import tensorflow as tf

        if self.bands == 1:
            return tf.zeros([self.dataset_size], tf.int64)
        key = tf.get_static_value(sampling_key)
        if key is None:  # A key known only when the graph runs: drawn there.
            return self._draw_groups(sampling_key)
        cache_key = np.asarray(key, np.int64).tobytes()
        if cache_key not in self._groups_by_key:
            # Drawn eagerly once, also while a tf.data function is traced,
            # which then holds the groups as a constant.
            with tf.init_scope():
                self._groups_by_key[cache_key] = self._draw_groups(
                    tf.constant(key, tf.int64))
        return self._groups_by_key[cache_key]

    def _draw_groups(self, sampling_key):
        import tensorflow as tf

        # One uniform draw per unit, element i from Philox's counter i: no
        # unit's group depends on another's, nor on N.
        return tf.random.stateless_uniform(
            [self.dataset_size], seed=keys.fold(sampling_key, keys.SALT_BAND_GROUPS),
            minval=0, maxval=self.bands, dtype=tf.int64)

    def mask(self, sampling_key, step):
        """Boolean `[N]`: the units of group `step mod b`, each with probability q."""
        import tensorflow as tf

        u = tf.random.stateless_uniform(
            [self.dataset_size], seed=keys.fold(sampling_key, keys.SALT_POISSON, step),
            dtype=tf.float64,
        )
        drawn = u < self.group_sampling_rate
        if self.bands == 1:
            return drawn
        mine = tf.equal(self.groups(sampling_key), tf.cast(step, tf.int64) % self.bands)
        return tf.logical_and(drawn, mine)

    def describe(self):
        return (super().describe()
                + f" bands={self.bands} group_q={self.group_sampling_rate:.6g}")

    def __repr__(self):
        return super().__repr__()[:-1] + f", bands={self.bands})"


@base.register
class BandedPoissonSampler(BandGroups, poisson.PoissonSampler):
    """Poisson sampling of examples within b groups: the sampler of banded MF DP-SGD.

    Each example is put once into one of b secret groups, independently of
    the others, and step t samples group t mod b at q = b·B / N (`BandGroups`); with b = 1 its
    batches and events are `PoissonSampler`'s exactly.

    Args:
        dataset_size, logical_batch_size, physical_batch_size, num_hosts:
            see `tfdp.samplers.Sampler`. b·B must not exceed N.
        bands: int. b >= 1, the strategy's bands and the number of groups.
            Defaults to 1 (Poisson sampling).
    """

    name = "banded_poisson"
    user_form = "banded_user_poisson"
    banded_form = "banded_poisson"

    def __init__(self, dataset_size, logical_batch_size, physical_batch_size=None, num_hosts=1,
                 *, bands=1):
        super().__init__(dataset_size, logical_batch_size, physical_batch_size, num_hosts,
                         bands=bands)

    def with_hosts(self, num_hosts, physical_batch_size=None):
        return type(self)(self.dataset_size, self.logical_batch_size,
                          physical_batch_size or self.physical_batch_size, num_hosts,
                          bands=self.bands)
