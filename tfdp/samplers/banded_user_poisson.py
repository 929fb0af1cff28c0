"""`BandedUserPoissonSampler`: b groups of users, step t samples group t mod b (BandMF)."""

from tfdp.samplers import banded_poisson
from tfdp.samplers import base
from tfdp.samplers import user_poisson


@base.register
class BandedUserPoissonSampler(banded_poisson.BandGroups, user_poisson.UserPoissonSampler):
    """Poisson sampling of users within b groups: banded MF DP-SGD at user level.

    Each user (not each example) is put once into one of b secret groups,
    independently of the other users, and step t draws the users of group t mod b, each with
    probability q = b·B_u / N_u (`tfdp.samplers.BandGroups`); each drawn
    user brings at most k = `max_examples_per_user` of their examples, laid
    out and clipped as one block, as in `UserPoissonSampler`. A user's steps
    are therefore at least b apart, and T steps are accounted as ⌈T/b⌉
    rounds of the Poisson-subsampled Gaussian at q under add-or-remove-one-
    user adjacency: the other users' groups do not depend on the added or
    removed user, so the fixed-partition argument holds for each of its
    groups. With b = 1 its batches
    and events are `UserPoissonSampler`'s exactly.

    Args:
        dataset_size: int. N_u, the number of users. b·B_u must not exceed it.
        logical_batch_size: int. B_u, the expected users per logical step.
        physical_batch_size, num_hosts, user_ids, max_examples_per_user:
            see `tfdp.samplers.UserPoissonSampler`.
        bands: int. b >= 1, the strategy's bands and the number of groups
            of users. Defaults to 1 (`UserPoissonSampler`'s sampling).
    """

    name = "banded_user_poisson"
    user_form = "banded_user_poisson"
    banded_form = "banded_user_poisson"

    def __init__(self, dataset_size, logical_batch_size, physical_batch_size=None, num_hosts=1,
                 *, user_ids=None, max_examples_per_user=1, bands=1):
        super().__init__(dataset_size, logical_batch_size, physical_batch_size, num_hosts,
                         user_ids=user_ids, max_examples_per_user=max_examples_per_user,
                         bands=bands)

    def with_hosts(self, num_hosts, physical_batch_size=None):
        return type(self)(self.dataset_size, self.logical_batch_size,
                          physical_batch_size or self.physical_batch_size, num_hosts,
                          user_ids=self.user_ids,
                          max_examples_per_user=self.max_examples_per_user, bands=self.bands)
