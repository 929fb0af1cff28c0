"""The one-run audit statistics of Steinke, Nasr & Jagielski (NeurIPS 2023).

Setting. m canaries; canary j is included in training iff S_j = +1, with the
S_j independent and uniform on {-1, +1}. After training, the auditor outputs
guesses T ∈ {-1, 0, +1}^m (0 = abstain) with r = ‖T‖₁ non-abstentions, and
counts the correct ones, W = #{j : T_j = S_j}.

Pure ε-DP (the paper's Theorem 3.1). W is stochastically dominated by
Binomial(r, p_ε), where p_ε = e^ε / (1 + e^ε) is the accuracy of ε-DP
randomised response:

    P[W ≥ v] ≤ f_ε(v) := P[Binomial(r, p_ε) ≥ v].

(ε, δ)-DP (the paper's Theorem 5.2 / Corollary 5.4, computed as in its
Appendix D):

    P[W ≥ v] ≤ f_ε(v) + 2·m·δ · max_{i=1..v} (f_ε(v - i) - f_ε(v)) / i,

where f_ε(v - i) - f_ε(v) = P[v - i ≤ Binomial(r, p_ε) < v].

The right-hand side is the p-value of "the training run is (ε, δ)-DP" given v
correct guesses. The empirical lower bound at confidence 1 - β is the largest
ε that this test rejects at level β (found by bisection, keeping the low end,
so it is conservative).
"""

import dataclasses
import math

import numpy as np
from scipy import stats

_BISECTION_STEPS = 50
_EPS_CAP = 100.0


def _check_counts(m, r, v):
    for name, value in (("m", m), ("r", r), ("v", v)):
        if isinstance(value, bool) or int(value) != value:
            raise ValueError(f"`{name}` must be an integer. Received: {name}={value!r}")
    if not 0 <= v <= r <= m:
        raise ValueError(
            f"Need 0 <= v <= r <= m. Received: m={m}, r={r}, v={v}"
        )
    return int(m), int(r), int(v)


def _check_delta(delta):
    if not (isinstance(delta, (int, float)) and 0.0 <= delta < 1.0 and math.isfinite(delta)):
        raise ValueError(f"`delta` must be in [0, 1). Received: delta={delta!r}")
    return float(delta)


def _check_beta(beta):
    if not (isinstance(beta, (int, float)) and 0.0 < beta < 1.0):
        raise ValueError(f"`beta` must be in (0, 1). Received: beta={beta!r}")
    return float(beta)


def randomized_response_accuracy(eps):
    """p_ε = e^ε / (1 + e^ε), computed stably."""
    return 1.0 / (1.0 + math.exp(-eps))


def p_value(m, r, v, eps, delta=0.0):
    """Upper bound on P[W ≥ v] for an (ε, δ)-DP run (see the module docstring).

    Args:
        m: int. Number of canaries (each included with probability 1/2).
        r: int. Number of guesses (non-abstentions), `r <= m`.
        v: int. Number of correct guesses, `v <= r`.
        eps: float. ε ≥ 0 of the null hypothesis.
        delta: float. δ of the null hypothesis. Defaults to 0 (pure DP,
            Theorem 3.1).

    Returns:
        The p-value, a float in [0, 1].
    """
    m, r, v = _check_counts(m, r, v)
    delta = _check_delta(delta)
    if not eps >= 0:
        raise ValueError(f"`eps` must be >= 0. Received: eps={eps!r}")
    if v == 0:
        return 1.0
    p = randomized_response_accuracy(eps)
    tail = float(stats.binom.sf(v - 1, r, p))  # P[Binomial(r, p) >= v]
    if delta == 0.0:
        return min(tail, 1.0)
    # P[v - i <= Binomial < v] for i = 1..v, i.e. cumulative pmf of v-1, v-2, ...
    pmf = stats.binom.pmf(np.arange(v - 1, -1, -1), r, p)
    alpha = float(np.max(np.cumsum(pmf) / np.arange(1, v + 1)))
    return min(tail + 2.0 * m * delta * alpha, 1.0)


def epsilon_lower_bound(m, r, v, delta=0.0, beta=0.05):
    """Largest ε whose (ε, δ)-DP hypothesis is rejected at level β.

    With probability ≥ 1 - β over the canaries' inclusion draws, a run that
    is (ε, δ)-DP yields a value ≤ ε. Returns 0.0 when even ε = 0 is not
    rejected (e.g. random guessing).

    Args:
        m: int. Number of canaries.
        r: int. Number of guesses.
        v: int. Number of correct guesses.
        delta: float. δ. Defaults to 0.
        beta: float. 1 - confidence. Defaults to 0.05.

    Returns:
        float ε_lower ≥ 0 (the low end of the bisection bracket).
    """
    m, r, v = _check_counts(m, r, v)
    delta = _check_delta(delta)
    beta = _check_beta(beta)
    if p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < beta:
        lo, hi = hi, 2.0 * hi
        if hi > _EPS_CAP:
            return lo
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) < beta:
            lo = mid
        else:
            hi = mid
    return lo


def make_guesses(scores, num_positive, num_negative, seed=0):
    """Guesses +1 for the `num_positive` highest scores, -1 for the
    `num_negative` lowest, 0 (abstain) for the rest.

    Ties are broken by a seeded random permutation, which does not depend on
    which canaries were included.
    """
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    m = scores.shape[0]
    if num_positive < 0 or num_negative < 0 or num_positive + num_negative > m:
        raise ValueError(
            "Need num_positive, num_negative >= 0 and num_positive + num_negative <= m. "
            f"Received: num_positive={num_positive}, num_negative={num_negative}, m={m}"
        )
    if not np.all(np.isfinite(scores)):
        # A non-finite score (e.g. an overflowing loss) still orders sensibly.
        scores = np.nan_to_num(scores, nan=-np.inf)
    perm = np.random.default_rng(seed).permutation(m)
    order = perm[np.argsort(-scores[perm], kind="stable")]  # Descending.
    guesses = np.zeros(m, dtype=np.int8)
    guesses[order[:num_positive]] = 1
    if num_negative:
        guesses[order[m - num_negative:]] = -1
    return guesses


def count_correct(guesses, included):
    """Returns (r, v): the number of guesses and of correct ones."""
    guesses = np.asarray(guesses)
    signs = np.where(np.asarray(included, dtype=bool), 1, -1)
    r = int(np.count_nonzero(guesses))
    v = int(np.count_nonzero(guesses == signs))
    return r, v


@dataclasses.dataclass(frozen=True)
class AuditBound:
    """The result of `audit_epsilon`.

    Attributes:
        epsilon_lower: float. Lower bound on ε at confidence 1 - beta.
        m: int. Canaries.
        r: int. Guesses of the chosen guess count.
        v: int. Correct guesses among them.
        num_positive: int. "Included" guesses.
        num_negative: int. "Excluded" guesses.
        delta: float.
        beta: float. Overall 1 - confidence (after the Bonferroni split).
        candidates: list of dicts `{r, v, epsilon_lower}`, one per guess
            count tried, each at level beta / len(candidates).
    """

    epsilon_lower: float
    m: int
    r: int
    v: int
    num_positive: int
    num_negative: int
    delta: float
    beta: float
    candidates: tuple


def default_guess_counts(m):
    """A small grid of total guess counts r (half "in", half "out")."""
    counts = []
    for fraction in (0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0):
        r = 2 * max(1, int(round(fraction * m / 2)))
        if r <= m and r not in counts:
            counts.append(r)
    return counts


def audit_epsilon(scores, included, *, delta=0.0, beta=0.05, guess_counts=None, seed=0):
    """ε lower bound from canary scores, with a Bonferroni-corrected choice of r.

    For each total guess count r in `guess_counts`, guesses "included" for
    the r/2 highest scores and "excluded" for the r/2 lowest (the odd one
    goes to "included"), and computes the bound at level beta / K (K =
    number of counts). The maximum is a valid lower bound at confidence
    1 - beta by a union bound.

    Args:
        scores: array [m]. Higher means "more likely included" (e.g. minus
            the canary's loss).
        included: bool array [m]. The true inclusion draws S.
        delta: float. δ of the hypotheses. Defaults to 0.
        beta: float. 1 - confidence. Defaults to 0.05.
        guess_counts: list of ints, or None for `default_guess_counts(m)`.
        seed: int. Tie-break seed. Defaults to 0.

    Returns:
        An `AuditBound`.
    """
    scores = np.asarray(scores).reshape(-1)
    included = np.asarray(included, dtype=bool).reshape(-1)
    if scores.shape != included.shape:
        raise ValueError(
            f"`scores` and `included` must have the same length. Received: "
            f"{scores.shape[0]} and {included.shape[0]}"
        )
    m = int(scores.shape[0])
    if m == 0:
        raise ValueError("Need at least one canary.")
    delta = _check_delta(delta)
    beta = _check_beta(beta)
    counts = list(guess_counts) if guess_counts is not None else default_guess_counts(m)
    if not counts or any(int(c) != c or not 1 <= c <= m for c in counts):
        raise ValueError(f"`guess_counts` must be ints in [1, m={m}]. Received: {counts}")
    level = beta / len(counts)
    best = None
    candidates = []
    for r in counts:
        k_pos = (int(r) + 1) // 2
        k_neg = int(r) - k_pos
        guesses = make_guesses(scores, k_pos, k_neg, seed=seed)
        rr, v = count_correct(guesses, included)
        eps = epsilon_lower_bound(m, rr, v, delta, level)
        candidates.append({"r": rr, "v": v, "epsilon_lower": eps})
        if best is None or eps > best[0]:
            best = (eps, rr, v, k_pos, k_neg)
    eps, r, v, k_pos, k_neg = best
    return AuditBound(
        epsilon_lower=eps, m=m, r=r, v=v, num_positive=k_pos, num_negative=k_neg,
        delta=delta, beta=beta, candidates=tuple(candidates),
    )
