"""Empirical privacy auditing of DP-SGD in one training run.

Implements Steinke, Nasr & Jagielski, "Privacy Auditing with One (1)
Training Run" (NeurIPS 2023) for tfdp: m canaries, each included with
probability 1/2, one training run, a membership guess per canary, and a
lower bound on ε at confidence 1 - β to set beside the accountant's upper
bound. `python -m tfdp.audit --help`; see docs/AUDIT.md.

Public API:

- `p_value`, `epsilon_lower_bound`: the paper's bound (Theorem 3.1 for
  δ = 0, Theorem 5.2 / Appendix D for δ > 0).
- `make_guesses`, `count_correct`, `audit_epsilon`: from scores to a bound.
- `make_canaries`, `draw_inclusion`: the input-space canaries.
- `AuditConfig`, `run_audit`: train one model and audit it.
"""

from tfdp.audit.bounds import AuditBound
from tfdp.audit.bounds import audit_epsilon
from tfdp.audit.bounds import count_correct
from tfdp.audit.bounds import default_guess_counts
from tfdp.audit.bounds import epsilon_lower_bound
from tfdp.audit.bounds import make_guesses
from tfdp.audit.bounds import p_value
from tfdp.audit.canaries import draw_inclusion
from tfdp.audit.canaries import make_canaries
from tfdp.audit.run import AuditConfig
from tfdp.audit.run import run_audit

__all__ = [
    "AuditBound",
    "AuditConfig",
    "audit_epsilon",
    "count_correct",
    "default_guess_counts",
    "draw_inclusion",
    "epsilon_lower_bound",
    "make_canaries",
    "make_guesses",
    "p_value",
    "run_audit",
]
