"""Samplers: how each logical step's examples are drawn, and their DP events.

`make_sampler("poisson" | "shuffle" | "user_poisson" | "banded_poisson" |
"banded_user_poisson", dataset_size=, logical_batch_size=, ...)` returns one.
See `tfdp.samplers.base.Sampler` for what every sampler knows, and
`BandGroups` for the b-group split the banded samplers share.
"""

from tfdp.samplers.amplification import weak_amplification_warning
from tfdp.samplers.base import Sampler
from tfdp.samplers.base import for_accounting
from tfdp.samplers.base import make_sampler
from tfdp.samplers.base import names
from tfdp.samplers.base import register
from tfdp.samplers.base import resolve_name
from tfdp.samplers.base import sampler_class
from tfdp.samplers.poisson import PoissonSampler
from tfdp.samplers.shuffle import ShuffleSampler
from tfdp.samplers.user_poisson import UserPoissonSampler
# Imported last, so that they are registered (and listed, e.g. in --help) after the others.
from tfdp.samplers.banded_poisson import BandGroups  # noqa: E402,I001
from tfdp.samplers.banded_poisson import BandedPoissonSampler  # noqa: E402,I001
from tfdp.samplers.banded_user_poisson import BandedUserPoissonSampler  # noqa: E402,I001

__all__ = [
    "BandGroups",
    "BandedPoissonSampler",
    "BandedUserPoissonSampler",
    "PoissonSampler",
    "Sampler",
    "ShuffleSampler",
    "UserPoissonSampler",
    "for_accounting",
    "make_sampler",
    "names",
    "register",
    "resolve_name",
    "sampler_class",
    "weak_amplification_warning",
]
