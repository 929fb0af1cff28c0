"""The (ε, δ) of releasing only the best of a random number of identical private runs.

Each trial of a private selection is one trainer run; its DP event is its
sampler's, rebuilt from the ledger the run wrote
(`checkpoints/privacy_ledger.json`). The selection is
`dp_event.RepeatAndSelectDpEvent(event, mean, shape)` (Papernot &
Steinke 2022), which only `dp_accounting`'s RDP accountant accounts: the
selection's ε is an RDP bound whatever accountant the runs used.
"""

import contextlib
import math

from absl import logging as absl_logging
from dp_accounting import dp_event
from dp_accounting import rdp as dp_rdp

from tfdp import privacy
from tfdp import samplers

ACCOUNTANT = "rdp"


@contextlib.contextmanager
def _quiet():
    """Silences dp_accounting's "failed to converge ... Excluding this order".

    An excluded order only leaves the minimum over orders, so the bound
    stays valid; the warning says nothing a user can act on.
    """
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        absl_logging.set_verbosity(verbosity)


def run_event(ledger):
    """`(event, neighboring_relation)`: the DP event of the run `ledger` records.

    Rebuilt from the ledger's sampler, q, N, B, bands, effective σ and
    steps, and checked: its RDP ε must be the ledger's own (at the ledger's δ), or the
    run is refused, since the selection would account something else.

    Args:
        ledger: `tfdp.privacy.PrivacyLedger`. A finished run's.

    Returns:
        A tuple of a `dp_accounting.DpEvent` and a
        `dp_accounting.NeighboringRelation`.
    """
    # A banded run (b > 1) is its banded sampler's ⌈T/b⌉ rounds at the rate
    # within a group; its ledger records the sampler and b.
    options = {"bands": ledger.bands} if ledger.bands > 1 else {}
    accounted = samplers.for_accounting(ledger.sampler, ledger.sampling_rate,
                                        ledger.dataset_size, ledger.batch_size, **options)
    event = accounted.dp_event(ledger.effective_noise_multiplier, ledger.steps)
    relation = accounted.neighboring_relation
    own = ledger.to_dict()
    own["accountant"] = ACCOUNTANT
    accountant = dp_rdp.RdpAccountant(neighboring_relation=relation)
    with _quiet():
        expected = privacy.PrivacyLedger.from_dict(own).epsilon()
        accountant.compose(event)
        rebuilt = accountant.get_epsilon(ledger.delta)
    if ledger.steps and not math.isclose(rebuilt, expected, rel_tol=1e-9):
        raise ValueError(
            "The DP event rebuilt from a run's ledger does not give the run's own RDP epsilon, so "
            "the selection cannot be accounted. "
            f"Received: ledger={ledger.to_dict()}, rebuilt epsilon={rebuilt}, "
            f"ledger epsilon={expected}")
    return event, relation


def selection_event(event, trial_count):
    """`RepeatAndSelectDpEvent` of `event` with the trial count's mean and shape.

    Args:
        event: `dp_accounting.DpEvent`. One trial's (`run_event`).
        trial_count: `tfdp.tuning.TrialCount`.
    """
    return dp_event.RepeatAndSelectDpEvent(
        event, float(trial_count.mean), trial_count.accounting_shape)


def selection_epsilon(event, relation, trial_count, delta):
    """ε at `delta` of releasing the best of K trials of `event`, K ~ `trial_count` (RDP).

    Args:
        event: `dp_accounting.DpEvent`. One trial's.
        relation: `dp_accounting.NeighboringRelation`. The event's.
        trial_count: `tfdp.tuning.TrialCount`.
        delta: float. δ of the guarantee (the runs').

    Returns:
        ε, a float.
    """
    accountant = dp_rdp.RdpAccountant(neighboring_relation=relation)
    with _quiet():
        accountant.compose(selection_event(event, trial_count))
        return float(accountant.get_epsilon(delta))
