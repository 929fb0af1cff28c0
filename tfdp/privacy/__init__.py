"""Differential-privacy accounting for tfdp, built on `dp_accounting`.

Public API:

- `epsilon`: epsilon of a DP-SGD run (RDP or PLD; Poisson or fixed-size
  shuffled batches).
- `calibrate_noise`: smallest noise multiplier meeting a target epsilon.
- `max_steps_within`: most steps within a target epsilon.
- `epsilon_table` / `format_epsilon_table`: epsilon at several deltas.
- `PrivacyLedger`: serialisable privacy state kept with checkpoints.
- `PrivacyQuery`: one validated accounting question (σ, steps, δ, the
  sampler and the accountant), asked for ε at other steps, σ or δ.
- `steps_for_epochs`: `ceil(epochs * N / B)`.
- `default_delta`: the δ of every route when none is given.
- `group_epsilon`, `group_privacy`, `example_level_budget`,
  `example_level_claim`: what example-level DP says about a user of k
  examples; `copies_claim`: about k rows of one content kept as distinct
  records (`duplicates="keep"`).

Imports no TensorFlow. See `docs/PRIVACY.md` for the accounting choices.
"""

from tfdp.privacy import banded_mf
from tfdp.privacy.accounting import ACCOUNTANTS
from tfdp.privacy.accounting import DEFAULT_DELTAS
from tfdp.privacy.accounting import PrivacyQuery
from tfdp.privacy.accounting import SAMPLERS
from tfdp.privacy.accounting import epsilon
from tfdp.privacy.accounting import make_dp_event
from tfdp.privacy.accounting import resolve_sampling_rate
from tfdp.privacy.accounting import steps_for_epochs
from tfdp.privacy.calibration import calibrate_noise
from tfdp.privacy.deltas import default_delta
from tfdp.privacy.deltas import noise_truncation_delta
from tfdp.privacy.epsilon_tables import epsilon_table
from tfdp.privacy.epsilon_tables import format_epsilon_table
from tfdp.privacy.calibration import max_steps_within
from tfdp.privacy.group_privacy import copies_claim
from tfdp.privacy.group_privacy import describe_copies_claim
from tfdp.privacy.group_privacy import describe_example_level_claim
from tfdp.privacy.group_privacy import example_level_budget
from tfdp.privacy.group_privacy import example_level_claim
from tfdp.privacy.group_privacy import group_epsilon
from tfdp.privacy.group_privacy import group_privacy
from tfdp.privacy.ledger import PrivacyLedger

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_DELTAS",
    "SAMPLERS",
    "PrivacyLedger",
    "banded_mf",
    "PrivacyQuery",
    "calibrate_noise",
    "copies_claim",
    "default_delta",
    "describe_copies_claim",
    "describe_example_level_claim",
    "epsilon",
    "epsilon_table",
    "example_level_budget",
    "example_level_claim",
    "format_epsilon_table",
    "group_epsilon",
    "group_privacy",
    "make_dp_event",
    "noise_truncation_delta",
    "max_steps_within",
    "resolve_sampling_rate",
    "steps_for_epochs",
]

