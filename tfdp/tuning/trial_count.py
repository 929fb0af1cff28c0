"""How many trials a private selection runs: a random count, drawn in secret.

Papernot & Steinke (ICLR 2022) bound the privacy of releasing only the best
of K runs when K is random and unknown to the adversary: Poisson with mean
μ (K = 0 then releases nothing), or the truncated negative binomial of shape
η ≥ 0 (η = 0 is the logarithmic distribution, η = 1 the geometric one),
whose support is K ≥ 1. `dp_accounting.RepeatAndSelectDpEvent(event, mean,
shape)` accounts both, with shape = ∞ for Poisson.

The count, like the noise, must stay secret: the bound holds for the best
run alone, not for the best run together with K, so `secret_generator`
draws from the OS's entropy and never from a public seed.
"""

import dataclasses
import math
import secrets

import numpy as np

POISSON = "poisson"
TRUNCATED_NEGATIVE_BINOMIAL = "truncated_negative_binomial"
DISTRIBUTIONS = (POISSON, TRUNCATED_NEGATIVE_BINOMIAL)


def secret_generator():
    """A numpy generator seeded with 128 bits of the OS's entropy (`secrets`).

    Draws the trial count and each trial's setting; nothing public (such as
    `--seed`) reaches it, and its seed is never written anywhere.
    """
    return np.random.default_rng(secrets.randbits(128))


def truncated_negative_binomial_mean(gamma, shape):
    """E[K] of the truncated negative binomial with parameters γ in (0, 1] and η ≥ 0.

    P[K = k] ∝ C(k + η − 1, k)·(1 − γ)^k for k ≥ 1 (Papernot & Steinke's
    Definition 1; γ is the halting probability); η = 0 is the logarithmic
    distribution, P[K = k] ∝ (1 − γ)^k / k.
    """
    if shape == 1:
        return 1 / gamma
    if gamma == 1:
        return 1.0
    if shape == 0:
        return (1 - 1 / gamma) / math.log(gamma)
    return shape * (1 / gamma - 1) / (1 - gamma ** shape)


def truncated_negative_binomial_gamma(shape, mean, tolerance=1e-9):
    """The halting probability γ whose truncated negative binomial has this mean.

    The same bisection as `dp_accounting`'s RDP accountant, which returns
    the lower end of its bracket; so the γ sampled from is the γ accounted.

    Args:
        shape: float. η ≥ 0.
        mean: float. E[K] ≥ 1.
        tolerance: float. Relative width of the final bracket. Defaults to
            1e-9.

    Returns:
        γ in (0, 1].
    """
    if shape == 1:
        return 1 / mean
    low, high = 0.0, min(1.0, 2 * (shape + 1) / mean)
    while high > low * (1 + tolerance):
        gamma = (low + high) / 2
        if truncated_negative_binomial_mean(gamma, shape) < mean:
            high = gamma
        else:
            low = gamma
    return low


@dataclasses.dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials of a private selection.

    Args:
        mean: float. E[K], at least 1 (what `dp_accounting` accounts).
        distribution: str. "poisson" (K = 0 is possible, with probability
            e^-mean: nothing is trained or released) or
            "truncated_negative_binomial" (K ≥ 1). Defaults to "poisson".
        shape: float or None. η ≥ 0 of the truncated negative binomial (0:
            logarithmic, 1: geometric; smaller η gives a smaller ε for the
            same mean, with a heavier tail of K); None for Poisson.
            Defaults to None.
    """

    mean: float
    distribution: str = POISSON
    shape: float = None

    def __post_init__(self):
        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"The trial count's distribution must be one of {DISTRIBUTIONS}. "
                             f"Received: distribution={self.distribution!r}")
        if (isinstance(self.mean, bool) or not isinstance(self.mean, (int, float))
                or not math.isfinite(self.mean) or self.mean < 1):
            raise ValueError("The mean number of trials must be a finite number >= 1 (the "
                             f"accounting's domain). Received: mean={self.mean!r}")
        if self.distribution == POISSON and self.shape is not None:
            raise ValueError("A shape is for the truncated negative binomial only; Poisson has "
                             f"none. Received: distribution='poisson', shape={self.shape!r}")
        if self.distribution == TRUNCATED_NEGATIVE_BINOMIAL and (
                isinstance(self.shape, bool) or not isinstance(self.shape, (int, float))
                or not math.isfinite(self.shape) or self.shape < 0):
            raise ValueError("The truncated negative binomial needs a finite shape >= 0 (0: "
                             "logarithmic, 1: geometric). "
                             f"Received: shape={self.shape!r}")

    @property
    def accounting_shape(self):
        """The `shape` of `dp_accounting.RepeatAndSelectDpEvent`: ∞ for Poisson."""
        return math.inf if self.distribution == POISSON else float(self.shape)

    def sample(self, generator):
        """Draws K.

        Args:
            generator: `numpy.random.Generator`. `secret_generator()` for a
                real selection; a seeded one only in tests.

        Returns:
            K, an int ≥ 0 (≥ 1 for the truncated negative binomial).
        """
        if self.distribution == POISSON:
            return int(generator.poisson(self.mean))
        gamma = truncated_negative_binomial_gamma(self.shape, self.mean)
        if gamma >= 1:  # Mean 1: K = 1 always.
            return 1
        if self.shape == 0:
            # numpy's logseries(p) has P[k] = -p^k / (k log(1 - p)), k >= 1.
            return int(generator.logseries(1 - gamma))
        while True:  # The negative binomial conditioned on K >= 1.
            count = int(generator.negative_binomial(self.shape, gamma))
            if count >= 1:
                return count

    def describe(self):
        """E.g. "Poisson(mean=4)" or "truncated negative binomial(mean=4, shape=1)"."""
        if self.distribution == POISSON:
            return f"Poisson(mean={self.mean:g})"
        return f"truncated negative binomial(mean={self.mean:g}, shape={self.shape:g})"

    def to_dict(self):
        """JSON fields: `distribution`, `mean` and, for the truncated negative binomial, `shape`."""
        out = {"distribution": self.distribution, "mean": self.mean}
        if self.distribution == TRUNCATED_NEGATIVE_BINOMIAL:
            out["shape"] = self.shape
        return out
