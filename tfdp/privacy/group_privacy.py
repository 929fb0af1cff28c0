"""What example-level DP says about a group of examples, such as one user's.

A user-level run (`privacy_unit="user"`) reports, beside its own ε, what
example-level accounting of the same training would claim for a user of at
most k examples (`example_level_claim`, by `group_epsilon`: the conversion
TF-Privacy's privacy statement uses). `group_privacy` is the plain
(kε, k·e^{(k−1)ε}·δ) conversion. Imports no TensorFlow.
"""

import math

import dp_accounting
from scipy import optimize
from scipy import stats

from tfdp import samplers
from tfdp.privacy import accounting
from tfdp.validation import validate_delta
from tfdp.validation import validate_noise_multiplier


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


def group_epsilon(noise_multiplier, steps, delta, group_size, *, sampling_rate=None,
                  accountant="rdp"):
    """ε at δ for a group of k examples (one user's) of example-level DP-SGD.

    The tightest conversion of the three that TF-Privacy's privacy statement
    uses, chosen by how the examples were drawn:

    - `sampling_rate=None` (each example at most once in each of `steps`
      Gaussian mechanisms, e.g. once per pass over the data): in the worst
      case a group's k examples meet in one mechanism, which multiplies its
      sensitivity by k. So the group's ε is the example-level ε at σ / k.
    - Poisson sampling under `accountant="pld"`: each step is a mixture of
      Gaussians whose sensitivity is the number of the group's examples
      drawn, Binomial(k, q) (Ganesh 2024, Theorem 3.1), composed over
      `steps` with a PLD accountant.
    - Poisson sampling under `accountant="rdp"`: the example-level
      (ε, δ_ex) converted by Vadhan (2017) Lemma 2.2 in its tighter form,
      δ = δ_ex·(e^{kε} − 1)/(e^ε − 1), with the δ_ex that gives the target δ
      found by a line search; the group's ε is kε. It may be infinite.

    With k = 1 it is the example-level ε.

    Args:
        noise_multiplier: float. σ of one example (already halved by a
            caller whose microbatches double the sensitivity).
        steps: int. Gaussian mechanisms composed: the steps under Poisson
            sampling, the passes without it.
        delta: float. The group's δ, in (0, 1).
        group_size: int. k, the most examples of one group.
        sampling_rate: float or None. Poisson rate q, or `None` for no
            sampling. Defaults to `None`.
        accountant: str. `"rdp"` or `"pld"`. Defaults to `"rdp"`.

    Returns:
        The group's ε as a float (`inf` when no bound follows).
    """
    k = _group_size(group_size)
    sigma = validate_noise_multiplier(noise_multiplier)
    delta = validate_delta(delta)
    accountant = accounting.validate_accountant(accountant)
    # A rate of 1 is the unamplified Gaussian mechanism in dp_accounting.
    q = 1.0 if sampling_rate is None else float(sampling_rate)

    def example_epsilon(noise, example_delta):
        return accounting.epsilon(noise, steps, example_delta, sampling_rate=q,
                                  sampler="poisson", accountant=accountant)

    if k == 1 or steps == 0:
        # Nothing released (no step) holds for any group as for one example.
        return example_epsilon(sigma, delta)
    if sampling_rate is None:
        return example_epsilon(sigma / k, delta)
    if sigma == 0:
        return math.inf
    if accountant == "pld":
        return _mixture_epsilon(sigma, steps, delta, k, q)
    return _vadhan_epsilon(lambda d: example_epsilon(sigma, d), delta, k)


def _group_size(group_size):
    if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 1:
        raise ValueError(f"`group_size` must be an int >= 1. Received: group_size={group_size!r}")
    return int(group_size)


def _mixture_epsilon(sigma, steps, delta, k, q):
    sensitivities = list(range(k + 1))
    probabilities = [float(p) for p in stats.binom.pmf(sensitivities, k, q)]
    event = dp_accounting.dp_event.MixtureOfGaussiansDpEvent(sigma, sensitivities, probabilities)
    pld = dp_accounting.pld.PLDAccountant(
        value_discretization_interval=accounting.PLD_DISCRETIZATION)
    pld.compose(event, int(steps))
    return float(pld.get_epsilon(delta))


def _logexpm1(x):
    return x + math.log(-math.expm1(-x))


def _vadhan_epsilon(example_epsilon, delta, k):
    """kε at the example δ whose Lemma 2.2 group δ for k examples is `delta`."""
    target = math.log(delta)
    cache = {}

    def epsilon_at(log_delta):
        if log_delta not in cache:
            example_delta = math.exp(log_delta)
            # At δ = 0 (exp underflows) no Gaussian mechanism has a finite ε.
            cache[log_delta] = example_epsilon(example_delta) if example_delta > 0 else math.inf
        return cache[log_delta]

    def gap(log_delta):
        eps = epsilon_at(log_delta)
        if math.isinf(eps):
            return math.inf
        return log_delta + _logexpm1(k * eps) - _logexpm1(eps) - target

    # The gap grows with the example δ, and the target δ bounds it above.
    # If the gap at `low` is positive, the root is below `low - gap(low)`.
    high = target
    low = high - math.log(10)
    gap_low = gap(low)
    while gap_low > 0:
        high = low - gap_low
        low = high - math.log(10)
        gap_low = gap(low)
        if not math.isfinite(gap_low):
            # ε grows as the example δ shrinks, so the group δ can diverge:
            # no user-level bound follows from group privacy.
            return math.inf
    low -= gap_low
    root = optimize.brentq(gap, low, high)
    return k * epsilon_at(root)


def example_level_claim(ledger, group_size, steps=None):
    """What example-level accounting with group privacy claims for a user of k examples.

    Example-level DP-SGD with the same σ, steps and sampling rate (Poisson
    sampling of examples at the ledger's rate), converted for a group of k
    examples at the ledger's δ by `group_epsilon` with the ledger's
    accountant (the conversion of TF-Privacy's privacy statement).

    Args:
        ledger: `tfdp.privacy.PrivacyLedger`. The user-level run's.
        group_size: int. k, the most examples of one user in a step.
        steps: int or None. Defaults to the ledger's steps.

    Returns:
        A dict: `example_epsilon` (example-level, at the ledger's δ),
        `group_size`, `group_epsilon` (possibly `inf`), `group_delta` (the
        ledger's δ) and `how`, a sentence saying what it is.

    Raises:
        ValueError: for a banded run (`ledger.bands` > 1), which has no such
            comparison: the conversions are proved for DP-SGD's Poisson
            sampling, where a user's k examples may share every step, not
            for b groups in which they may sit apart.
    """
    if ledger.bands > 1:
        raise ValueError(
            "The example-level comparison is for DP-SGD runs: group privacy is not "
            "established for banded matrix factorization. Received: a ledger with "
            f"bands={ledger.bands}")
    steps = ledger.steps if steps is None else steps
    sigma, q = ledger.effective_noise_multiplier, ledger.sampling_rate
    example_epsilon = accounting.epsilon(sigma, steps, ledger.delta, sampling_rate=q,
                                         accountant=ledger.accountant)
    group = group_epsilon(sigma, steps, ledger.delta, group_size, sampling_rate=q,
                          accountant=ledger.accountant)
    how = ("mixture of Gaussians, Ganesh 2024" if ledger.accountant == "pld"
           else "Vadhan 2017, Lemma 2.2")
    return {"example_epsilon": example_epsilon, "group_size": int(group_size),
            "group_epsilon": group, "group_delta": float(ledger.delta),
            "how": "example-level DP-SGD at the same sigma, steps and sampling rate, "
                   f"converted by group privacy for k examples ({how}) at this delta; "
                   "it holds only for users with at most k examples"}


def describe_example_level_claim(claim):
    """One line: what example-level accounting with group privacy would claim."""
    head = f"example-level accounting with group privacy for {claim['group_size']} examples"
    if math.isinf(claim["group_epsilon"]):
        return f"{head} would claim no finite epsilon at delta={claim['group_delta']:.3g}"
    return (f"{head} would claim epsilon={claim['group_epsilon']:.4g} "
            f"at delta={claim['group_delta']:.3g}")


def copies_claim(ledger, group_size, steps=None):
    """The (ε, δ) of k rows that share their content, were they one record.

    Where rows with the same content are trained on as distinct records
    (`duplicates="keep"`, `tfdp.data.duplicates`), the run's ε holds for each
    row; this is what it would be for the largest group of identical rows
    if they were one record after all.

    - A DP-SGD run with Poisson sampling (of examples or users, no bands):
      `group_epsilon`'s conversion at the ledger's δ, with its accountant.
    - Any other run: the standard conversion of the run's (ε, δ),
      `group_privacy`: (kε, k·e^{(k−1)ε}·δ).

    Args:
        ledger: `tfdp.privacy.PrivacyLedger`. The run's.
        group_size: int. k, the rows of the largest group of copies.
        steps: int or None. Defaults to the ledger's steps.

    Returns:
        A dict: `group_size`, `group_epsilon` (possibly `inf`), `group_delta`
        and `how`, a sentence saying which conversion.
    """
    k = _group_size(group_size)
    steps = ledger.steps if steps is None else steps
    # The amplified samplers without bands draw by Poisson sampling (of
    # examples or users), which `group_epsilon`'s conversions are proved for.
    poisson = ledger.bands == 1 and samplers.sampler_class(ledger.sampler).amplified
    if poisson:
        sigma, q = ledger.effective_noise_multiplier, ledger.sampling_rate
        group = group_epsilon(sigma, steps, ledger.delta, k, sampling_rate=q,
                              accountant=ledger.accountant)
        how = ("mixture of Gaussians, Ganesh 2024" if ledger.accountant == "pld"
               else "Vadhan 2017, Lemma 2.2")
        return {"group_size": k, "group_epsilon": group, "group_delta": float(ledger.delta),
                "how": f"Poisson-sampled DP-SGD's group conversion for k rows ({how})"}
    epsilon, delta = group_privacy(ledger.epsilon_after(steps), ledger.delta, k)
    return {"group_size": k, "group_epsilon": epsilon, "group_delta": min(delta, 1.0),
            "how": "the run's (epsilon, delta) converted by group privacy, "
                   "(k epsilon, k e^((k-1) epsilon) delta)"}


def describe_copies_claim(claim):
    """One line: the group's (ε, δ), were the largest group of copies one record."""
    head = (f"were the largest group of {claim['group_size']} identical rows one record, "
            "its guarantee would be")
    if math.isinf(claim["group_epsilon"]) or claim["group_delta"] >= 1:
        return f"{head} no finite epsilon ({claim['how']})"
    return (f"{head} epsilon={claim['group_epsilon']:.4g} at "
            f"delta={claim['group_delta']:.3g} ({claim['how']})")
