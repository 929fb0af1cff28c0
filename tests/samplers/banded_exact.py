"""The exact privacy loss of banded MF over b groups, on tiny datasets.

A test helper. Each unit contributes one scalar per step it is drawn in
(its clipped gradient, |v| <= C = 1). The release of T steps is, up to an
invertible post-processing, Y = C s + Z with s_t the step's sum, C the
banded strategy and Z ~ N(0, sigma^2 I_T). Over the groups and the Poisson
draws, Y is a mixture of N(C s, sigma^2 I): `output_mixture` enumerates its
means and weights for a rule that assigns the groups, and `hockey_stick`
integrates delta(eps) = int (P - e^eps Q)_+ between two such mixtures on a
fine grid.
"""
import itertools
import math
from collections import defaultdict

import numpy as np
from scipy import special


def strategy(coefficients, steps):
    """The T x T lower-triangular banded Toeplitz matrix of the coefficients."""
    c = np.zeros((steps, steps))
    for t in range(steps):
        for j, cj in enumerate(coefficients):
            if t - j >= 0:
                c[t, t - j] = cj
    return c


def _convolve(a, b):
    out = defaultdict(float)
    for ka, pa in a.items():
        for kb, pb in b.items():
            out[tuple(x + y for x, y in zip(ka, kb))] += pa * pb
    return out


def unit_sums(value, group, bands, steps, q):
    """{one unit's per-step contributions: probability}, given its group."""
    mine = [t for t in range(steps) if t % bands == group]
    out = defaultdict(float)
    for taken in itertools.product((0, 1), repeat=len(mine)):
        p = 1.0
        s = [0.0] * steps
        for t, k in zip(mine, taken):
            p *= q if k else 1 - q
            if k:
                s[t] = value
        if p > 0:
            out[tuple(s)] += p
    return out


def sums_given_groups(values, groups, bands, steps, q):
    """{the steps' sums: probability} for fixed groups, over the Poisson draws."""
    dist = {tuple([0.0] * steps): 1.0}
    for v, g in zip(values, groups):
        dist = _convolve(dist, unit_sums(v, g, bands, steps, q))
    return dist


def independent_assignments(n, bands):
    """Each unit's group uniform and independent of the others' (tfdp's rule)."""
    for groups in itertools.product(range(bands), repeat=n):
        yield groups, bands ** -n


def balanced_assignments(n, bands):
    """The old rule: a uniformly random balanced labelled partition."""
    sizes = [n // bands + (1 if g < n % bands else 0) for g in range(bands)]
    parts = []
    for labels in set(itertools.permutations(sizes)):
        base = [g for g, k in enumerate(labels) for _ in range(k)]
        parts.extend(set(itertools.permutations(base)))
    parts = sorted(set(parts))
    for groups in parts:
        yield groups, 1.0 / len(parts)


def independent_mixture(values, bands, steps, q):
    """`output_mixture` under `independent_assignments`, unit by unit (faster)."""
    dist = {tuple([0.0] * steps): 1.0}
    for v in values:
        unit = defaultdict(float)
        for g in range(bands):
            for s, p in unit_sums(v, g, bands, steps, q).items():
                unit[s] += p / bands
        dist = _convolve(dist, unit)
    return dist


def output_mixture(values, bands, steps, q, assignments):
    """{the steps' sums: probability}, over the groups and the Poisson draws."""
    mix = defaultdict(float)
    for groups, p in assignments(len(values), bands):
        for s, ps in sums_given_groups(values, groups, bands, steps, q).items():
            mix[s] += p * ps
    return mix


def hockey_stick(p_mix, q_mix, coefficients, sigma, epsilon, per_sigma=10, width=9.0):
    """max over both directions of ∫ (P − e^ε Q)_+ for mixtures of N(C s, σ² I).

    A midpoint sum on a grid of spacing σ / per_sigma, the densities built
    from one-dimensional Gaussian factors (the noise is isotropic).
    """
    steps = len(next(iter(p_mix)))
    c = strategy(coefficients, steps)
    mp = np.array([c @ np.array(k) for k in p_mix]); wp = np.array(list(p_mix.values()))
    mq = np.array([c @ np.array(k) for k in q_mix]); wq = np.array(list(q_mix.values()))
    allm = np.concatenate([mp, mq])
    h = sigma / per_sigma
    axes = [np.arange(allm[:, d].min() - width * sigma, allm[:, d].max() + width * sigma, h)
            for d in range(steps)]
    norm = math.sqrt(2 * math.pi) * sigma

    def density(means, weights, first):
        # Σ_k w_k Π_d φ(y_d − μ_kd), y_0 over `first`, the rest over the axes.
        factors = [np.exp(-(first[None, :] - means[:, :1]) ** 2 / (2 * sigma**2)) / norm]
        for d in range(1, steps):
            factors.append(np.exp(-(axes[d][None, :] - means[:, d:d + 1]) ** 2
                                  / (2 * sigma**2)) / norm)
        rest = np.ones((len(means), 1))
        for f in factors[1:]:
            rest = (rest[:, :, None] * f[:, None, :]).reshape(len(means), -1)
        return (factors[0] * weights[:, None]).T @ rest

    out = [0.0, 0.0]
    for i in range(0, len(axes[0]), 16):
        first = axes[0][i:i + 16]
        p, q = density(mp, wp, first), density(mq, wq, first)
        out[0] += np.clip(p - math.exp(epsilon) * q, 0, None).sum()
        out[1] += np.clip(q - math.exp(epsilon) * p, 0, None).sum()
    return max(out) * h**steps
