"""What example-level DP says about a group of examples, such as one user's.

A user-level run (`privacy_unit="user"`) reports, beside its own ε, what
example-level accounting of the same training would claim for a user of at
most k examples: the standard group-privacy conversion of the example-level
(ε, δ). Imports no TensorFlow.
"""

import math

from tfdp.privacy import accounting


def group_privacy(epsilon, delta, group_size):
    """The (ε, δ) that example-level (ε, δ)-DP gives a group of k examples.

    The standard conversion (Dwork and Roth 2014, Lemma 2.2 applied k
    times): (kε, k·e^{(k−1)ε}·δ). It is what example-level accounting can
    claim for a user who contributed at most k examples.

    Args:
        epsilon: float. Example-level ε.
        delta: float. Example-level δ.
        group_size: int. k, the examples of one user.

    Returns:
        `(group_epsilon, group_delta)`.
    """
    k = int(group_size)
    if k < 1:
        raise ValueError(f"`group_size` must be >= 1. Received: group_size={group_size}")
    return k * float(epsilon), k * math.exp((k - 1) * float(epsilon)) * float(delta)


def example_level_budget(user_epsilon, user_delta, group_size):
    """The example-level (ε, δ) whose `group_privacy` for k examples is the given one.

    Args:
        user_epsilon: float. The user-level ε to reach.
        user_delta: float. The user-level δ to reach.
        group_size: int. k, the most examples of one user.

    Returns:
        `(epsilon, delta)`: ε = ε_user / k, δ = δ_user / (k·e^{(k−1)ε}).
    """
    k = int(group_size)
    if k < 1:
        raise ValueError(f"`group_size` must be >= 1. Received: group_size={group_size}")
    epsilon = float(user_epsilon) / k
    return epsilon, float(user_delta) / (k * math.exp((k - 1) * epsilon))


def example_level_claim(ledger, group_size, steps=None):
    """What example-level accounting with group privacy claims for a user of k examples.

    Example-level DP-SGD with the same σ, steps and sampling rate (Poisson
    sampling of examples at the ledger's rate), accounted at the ledger's δ,
    then `group_privacy` for k examples: (kε, k·e^{(k−1)ε}·δ).

    Args:
        ledger: `tfdp.privacy.PrivacyLedger`. The user-level run's.
        group_size: int. k, the most examples of one user in a step.
        steps: int or None. Defaults to the ledger's steps.

    Returns:
        A dict: `example_epsilon`, `group_size`, `group_epsilon`,
        `group_delta` (at most 1) and `how`, a sentence saying what it is.
    """
    steps = ledger.steps if steps is None else steps
    example_epsilon = accounting.epsilon(
        ledger.effective_noise_multiplier, steps, ledger.delta,
        sampling_rate=ledger.sampling_rate,
        accountant=ledger.accountant)
    group_epsilon, group_delta = group_privacy(example_epsilon, ledger.delta, group_size)
    return {"example_epsilon": example_epsilon, "group_size": int(group_size),
            "group_epsilon": group_epsilon, "group_delta": min(group_delta, 1.0),
            "how": "example-level DP-SGD at the same sigma, steps and sampling rate, "
                   "accounted at this delta, converted by group privacy for k examples: "
                   "(k*eps, k*exp((k-1)*eps)*delta); it holds only for users with at most "
                   "k examples"}


def describe_example_level_claim(claim):
    """One line: what example-level accounting with group privacy would claim."""
    delta = (f"delta={claim['group_delta']:.3g}" if claim["group_delta"] < 1
             else "delta>=1 (no guarantee)")
    return (f"example-level accounting with group privacy for {claim['group_size']} "
            f"examples would claim epsilon={claim['group_epsilon']:.4g} at {delta}")
