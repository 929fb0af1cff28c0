"""Privacy accounting for DP-SGD on top of `dp_accounting`.

What is composed is the sampler's own DP event (`tfdp.samplers`), so each
sampler is accounted for what it does:

- `"poisson"`: every example joins each step's batch independently with
  probability `q`: the Poisson-subsampled Gaussian mechanism of Abadi et al.
  (2016), once per step, under add/remove-one adjacency. This is what the
  paper's code reported (although its pipeline did not sample that way).
- `"shuffle"`: fixed-size batches, each example at most once per pass, in
  any order: one Gaussian mechanism per pass over the data, no
  amplification (see `tfdp.samplers.ShuffleSampler` and docs/PRIVACY.md).

No TensorFlow is imported here, so `python -m tfdp.privacy` starts quickly.
"""

import fractions
import functools
import math

from absl import logging as absl_logging
from dp_accounting import pld as dp_pld
from dp_accounting import rdp as dp_rdp
from dp_accounting.rdp import rdp_privacy_accountant

from tfdp import samplers
from tfdp.privacy.deltas import check_delta_against_dataset
from tfdp.validation import is_int
from tfdp.validation import is_real
from tfdp.validation import validate_delta
from tfdp.validation import validate_noise_multiplier
from tfdp.validation import validate_steps

ACCOUNTANTS = ("rdp", "pld")
SAMPLERS = samplers.names()
DEFAULT_DELTAS = (1e-5, 1e-6, 1e-7, 1e-8)

# The RDP orders dp_accounting uses by default; pinned so that the cached
# single-step RDP vector below and a plain `RdpAccountant()` agree exactly.
RDP_ORDERS = tuple(rdp_privacy_accountant.DEFAULT_RDP_ORDERS)

# dp_accounting's default PLD discretisation. The PLD accountant is run with
# pessimistic rounding, so the reported epsilon is an upper bound.
PLD_DISCRETIZATION = 1e-4



# --------------------------------------------------------------------------
# Validation.
# --------------------------------------------------------------------------


def validate_accountant(accountant):
    if accountant not in ACCOUNTANTS:
        raise ValueError(
            f"`accountant` must be one of {ACCOUNTANTS}. "
            f"Received: accountant={accountant!r}"
        )
    return accountant


def validate_sampler(sampler, name="sampler"):
    if isinstance(sampler, samplers.Sampler):
        return sampler
    if sampler not in SAMPLERS:
        raise ValueError(
            f"`{name}` must be one of {SAMPLERS}. "
            f"Received: {name}={sampler!r}"
        )
    return sampler


def adjacency(sampler):
    """The name of the adjacency relation `sampler`'s bound is stated under."""
    return _sampler_type(sampler).adjacency


def _sampler_type(sampler):
    return type(sampler) if isinstance(sampler, samplers.Sampler) else samplers.sampler_class(sampler)


def check_supported(accountant, sampler):
    if not _sampler_type(sampler).supports_accountant(accountant):
        raise ValueError(
            f"The {accountant} accountant does not support this sampler. "
            f"Received: accountant={accountant!r}, sampler={sampler!r}"
        )


def resolve_sampling_rate(
    sampling_rate=None, dataset_size=None, batch_size=None
):
    """Validates the batch description and returns `(q, N, B)`.

    Either `sampling_rate`, or `dataset_size` and `batch_size` (then
    `q = batch_size / dataset_size`) must be given. `dataset_size` alone may
    accompany `sampling_rate` (it is then only used for the `delta` check).
    When all three are given they must agree.

    Args:
        sampling_rate: float or None. Probability `q` in `(0, 1]`.
        dataset_size: int or None. Number of training examples `N`.
        batch_size: int or None. Expected (Poisson) or exact (shuffle)
            batch size `B`, `1 <= B <= N`.

    Returns:
        A tuple `(sampling_rate, dataset_size, batch_size)`; the last two may
        be `None`.
    """
    if dataset_size is not None:
        if not is_int(dataset_size) or dataset_size < 1:
            raise ValueError(
                "`dataset_size` must be an integer >= 1. "
                f"Received: dataset_size={dataset_size!r}"
            )
        dataset_size = int(dataset_size)
    if batch_size is not None:
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(
                "`batch_size` must be an integer >= 1. "
                f"Received: batch_size={batch_size!r}"
            )
        batch_size = int(batch_size)
        if dataset_size is None:
            raise ValueError(
                "`batch_size` needs `dataset_size`. "
                f"Received: batch_size={batch_size}, dataset_size=None"
            )
        if batch_size > dataset_size:
            raise ValueError(
                "`batch_size` must be <= `dataset_size`. "
                f"Received: batch_size={batch_size}, "
                f"dataset_size={dataset_size}"
            )
    if sampling_rate is not None:
        if not is_real(sampling_rate) or not 0 < sampling_rate <= 1:
            raise ValueError(
                "`sampling_rate` must be in (0, 1]. "
                f"Received: sampling_rate={sampling_rate!r}"
            )
        sampling_rate = float(sampling_rate)
        if batch_size is not None:
            implied = batch_size / dataset_size
            if not math.isclose(sampling_rate, implied, rel_tol=1e-9):
                raise ValueError(
                    "`sampling_rate` disagrees with batch_size / dataset_size"
                    f" = {implied!r}. Received: sampling_rate={sampling_rate!r}"
                )
            sampling_rate = implied
    elif batch_size is not None:
        sampling_rate = batch_size / dataset_size
    else:
        raise ValueError(
            "Pass either `sampling_rate`, or `dataset_size` and `batch_size`. "
            f"Received: sampling_rate=None, dataset_size={dataset_size!r}, "
            "batch_size=None"
        )
    return sampling_rate, dataset_size, batch_size


def steps_for_epochs(epochs, dataset_size, batch_size):
    """Returns `ceil(epochs * dataset_size / batch_size)`.

    A partial last step still touches data, so it counts as a full step.
    The product is formed exactly (as a fraction of the decimal value of
    `epochs`), so e.g. 70 epochs of 1,281,167 examples in batches of 65,536
    is 1,369 steps, with no float rounding at integer boundaries.

    Args:
        epochs: float. Number of passes over the data, `> 0`.
        dataset_size: int. Number of training examples `N`.
        batch_size: int. Batch size `B`, `1 <= B <= N`.

    Returns:
        The number of optimizer steps, an int.
    """
    if not is_real(epochs) or not math.isfinite(epochs) or epochs <= 0:
        raise ValueError(f"`epochs` must be > 0. Received: epochs={epochs!r}")
    resolve_sampling_rate(None, dataset_size, batch_size)
    exact = fractions.Fraction(str(epochs)) * dataset_size / batch_size
    return int(math.ceil(exact))


# --------------------------------------------------------------------------
# DpEvents.
# --------------------------------------------------------------------------


def make_dp_event(
    noise_multiplier,
    steps,
    *,
    sampling_rate=None,
    dataset_size=None,
    batch_size=None,
    sampler="poisson",
):
    """Returns the `dp_accounting.DpEvent` describing a DP-SGD run.

    It is the sampler's event (`tfdp.samplers`): for `"poisson"`,
    `SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)`; for
    `"shuffle"`, `SelfComposed(Gaussian(sigma), passes)`, one Gaussian
    mechanism per pass over the data. Both are accounted under add/remove-one
    adjacency (`adjacency(sampler)`).

    Args:
        noise_multiplier: float. Noise std over the clipping norm `C`,
            `sigma`, on the logical batch.
        steps: int. Number of optimizer steps.
        sampling_rate: float or None. Poisson rate `q`. Defaults to `None`.
        dataset_size: int or None. `N`. Defaults to `None`.
        batch_size: int or None. `B`. Defaults to `None`.
        sampler: str or `tfdp.samplers.Sampler`. `"poisson"` or `"shuffle"`,
            or a sampler instance. Defaults to `"poisson"`.

    Returns:
        A `dp_accounting.DpEvent`.
    """
    sigma = validate_noise_multiplier(noise_multiplier)
    steps = validate_steps(steps)
    validate_sampler(sampler)
    q, n, b = resolve_sampling_rate(sampling_rate, dataset_size, batch_size)
    return samplers.for_accounting(sampler, q, n, b).dp_event(sigma, steps)


# --------------------------------------------------------------------------
# Epsilon.
# --------------------------------------------------------------------------


class _QuietAccountant:
    """Silences dp_accounting's "failed to converge ... Excluding this order".

    Excluding an order only drops it from the minimum over orders (it gets
    ε = inf), so the bound stays valid; the warning is printed dozens of
    times per run for σ below ~1 and says nothing the user can act on.
    """

    def __enter__(self):
        self._verbosity = absl_logging.get_verbosity()
        absl_logging.set_verbosity(absl_logging.ERROR)

    def __exit__(self, *exc):
        absl_logging.set_verbosity(self._verbosity)


@functools.lru_cache(maxsize=256)
def _unit_rdp(unit_event, relation):
    # RDP composes additively, and dp_accounting adds `count * rdp_1` for a
    # self-composed event, so `count * rdp_1` reproduces its numbers exactly
    # while the unit's RDP is computed once per (sampler, sigma) instead of
    # once per query. DpEvents are frozen and hashable.
    accountant = dp_rdp.RdpAccountant(orders=RDP_ORDERS, neighboring_relation=relation)
    with _QuietAccountant():
        accountant.compose(unit_event)
    rdp = getattr(accountant, "_rdp", None)
    if rdp is None:
        return None
    rdp = rdp.copy()
    rdp.setflags(write=False)
    return rdp


def _rdp_epsilon(sigma, steps, delta, sampler):
    rdp_1 = _unit_rdp(sampler.unit_event(sigma), sampler.neighboring_relation)
    if rdp_1 is None:
        # Private attribute gone in some dp_accounting version: compose the
        # whole run the public way.
        accountant = dp_rdp.RdpAccountant(
            orders=RDP_ORDERS, neighboring_relation=sampler.neighboring_relation
        )
        with _QuietAccountant():
            accountant.compose(sampler.dp_event(sigma, steps))
        return float(accountant.get_epsilon(delta))
    eps, _ = dp_rdp.compute_epsilon(RDP_ORDERS, sampler.unit_count(steps) * rdp_1, delta)
    return float(eps)


@functools.lru_cache(maxsize=8)
def _pld_accountant(sampler, sigma, steps):
    accountant = dp_pld.PLDAccountant(
        neighboring_relation=sampler.neighboring_relation,
        value_discretization_interval=PLD_DISCRETIZATION,
    )
    accountant.compose(sampler.dp_event(sigma, steps))
    return accountant


def _epsilon(sigma, steps, delta, accounted, accountant):
    """Epsilon for validated arguments and the sampler as accounted."""
    if steps == 0:
        # No step ran, so nothing was released; this wins over sigma = 0.
        return 0.0
    if sigma == 0:
        return math.inf
    if accountant == "rdp":
        return _rdp_epsilon(sigma, steps, delta, accounted)
    return float(_pld_accountant(accounted, sigma, steps).get_epsilon(delta))


class PrivacyQuery:
    """A validated accounting question: ε of a DP-SGD run.

    Every argument is validated once, here, and δ is checked against the
    dataset size (a `UserWarning` when δ >= 1/N). `epsilon()` then answers
    for the run, or for the same run with another step count, noise
    multiplier or δ: what `epsilon`, `epsilon_table`, `calibrate_noise`,
    `max_steps_within` and `PrivacyLedger` ask.

    Args:
        noise_multiplier: float. σ >= 0 on the logical batch.
        steps: int. Optimizer steps, >= 0.
        delta: float. δ in (0, 1).
        sampling_rate: float or None. `q` in (0, 1]. Defaults to `None`.
        dataset_size: int or None. `N`; with `batch_size`, `q = B / N`.
            Defaults to `None`.
        batch_size: int or None. `B`. Defaults to `None`.
        accountant: str. `"rdp"` or `"pld"`. Defaults to `"rdp"`.
        sampler: str or `tfdp.samplers.Sampler`. `"poisson"` or
            `"shuffle"`, or a sampler instance. Defaults to `"poisson"`.
        stacklevel: int. Where the δ warning points: 2 is the caller of
            `PrivacyQuery`. Defaults to 2.
    """

    def __init__(
        self,
        noise_multiplier,
        steps,
        delta,
        *,
        sampling_rate=None,
        dataset_size=None,
        batch_size=None,
        accountant="rdp",
        sampler="poisson",
        stacklevel=2,
    ):
        self.noise_multiplier = validate_noise_multiplier(noise_multiplier)
        self.steps = validate_steps(steps)
        self.delta = validate_delta(delta)
        self.accountant = validate_accountant(accountant)
        self.sampler = validate_sampler(sampler)
        self.sampling_rate, self.dataset_size, self.batch_size = resolve_sampling_rate(
            sampling_rate, dataset_size, batch_size
        )
        check_supported(accountant, sampler)
        check_delta_against_dataset(self.delta, self.dataset_size, stacklevel=stacklevel + 1)
        self._accounted = samplers.for_accounting(
            sampler, self.sampling_rate, self.dataset_size, self.batch_size
        )

    def epsilon(self, steps=None, noise_multiplier=None, delta=None):
        """ε of the run, or of the run with other steps, σ or δ.

        Args:
            steps: int or None. Total steps. Defaults to the query's.
            noise_multiplier: float or None. σ. Defaults to the query's.
            delta: float or None. δ. Defaults to the query's.

        Returns:
            Epsilon as a float: `0.0` when `steps == 0`, `inf` when σ = 0
            (and `steps > 0`).
        """
        return _epsilon(
            self.noise_multiplier if noise_multiplier is None
            else validate_noise_multiplier(noise_multiplier),
            self.steps if steps is None else validate_steps(steps),
            self.delta if delta is None else validate_delta(delta),
            self._accounted,
            self.accountant,
        )


def epsilon(
    noise_multiplier,
    steps,
    delta,
    *,
    sampling_rate=None,
    dataset_size=None,
    batch_size=None,
    accountant="rdp",
    sampler="poisson",
):
    """Returns the epsilon of `steps` DP-SGD steps at the given `delta`.

    `sampler="poisson"`: each step's batch includes every example
    independently with probability `q`; accounted as the Poisson-subsampled
    Gaussian mechanism under add/remove-one adjacency, by RDP or PLD.

    `sampler="shuffle"`: fixed-size batches, each example at most once per
    pass over the data, in any order; accounted as one Gaussian mechanism
    per pass (a partial pass counts as whole), by RDP or PLD, under
    add/remove adjacency with the removed example's slot left empty. No
    amplification by sampling is claimed. This is TF-Privacy's "each example
    occurring once per epoch" bound (`used_microbatching=False`). With only
    `sampling_rate`, a pass is `floor(1 / q)` steps.

    Args:
        noise_multiplier: float. Noise std over the clipping norm, `sigma`,
            for the whole logical batch (not per device or per micro-batch).
        steps: int. Number of optimizer steps, `>= 0`.
        delta: float. Target delta in `(0, 1)`.
        sampling_rate: float or None. `q` in `(0, 1]`. Defaults to `None`.
        dataset_size: int or None. `N`; with `batch_size`, `q = B / N`.
            Also enables a warning when `delta >= 1/N`. Defaults to `None`.
        batch_size: int or None. `B`. Defaults to `None`.
        accountant: str. `"rdp"` or `"pld"`. Defaults to `"rdp"`.
        sampler: str or `tfdp.samplers.Sampler`. `"poisson"` or `"shuffle"`,
            or a sampler instance. Defaults to `"poisson"`.

    Returns:
        Epsilon as a float: `0.0` when `steps == 0`, `inf` when
        `noise_multiplier == 0` (and `steps > 0`).
    """
    return PrivacyQuery(
        noise_multiplier, steps, delta, sampling_rate=sampling_rate,
        dataset_size=dataset_size, batch_size=batch_size, accountant=accountant,
        sampler=sampler, stacklevel=3,
    ).epsilon()


def format_epsilon(value, digits=4):
    """Formats an epsilon for humans: `inf` stays `inf`."""
    if math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}"
