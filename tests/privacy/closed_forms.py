"""Privacy figures derived independently of dp_accounting, to check tfdp against.

tfdp's accounting (tfdp/privacy/accounting.py) is a thin layer over Google's
dp_accounting. A test that compares tfdp with a number that dp_accounting (or
tfdp) printed would copy a wrong accountant call into its expectation, so the
accounting tests compare with what is computed here instead: closed forms and
plain numpy/scipy sums written from the papers, importing nothing from
dp_accounting or tfdp.

Notation: σ is the noise multiplier (noise std over the L2 sensitivity), q the
Poisson sampling rate, T the number of compositions, α an RDP order.

- Gaussian mechanism, exact (ε, δ) (Balle and Wang 2018, "Improving the
  Gaussian mechanism for differential privacy", Theorem 8; Dong, Roth and Su
  2019, "Gaussian differential privacy", Corollary 2.13):
  δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), μ = 1/σ.
  T-fold composition of Gaussian mechanisms is the Gaussian mechanism with
  μ = √T/σ (the privacy loss of each is N(μ²/2, μ²); Dong, Roth and Su 2019,
  Corollary 3.3), so the formula is exact for it too. This is what a PLD
  accountant approximates from above.
- RDP of the Gaussian mechanism: α/(2σ²) (Mironov 2017, "Rényi differential
  privacy", its table of basic mechanisms); RDP composes additively (ibid.,
  Proposition 1).
- RDP of the Poisson-subsampled Gaussian (Mironov, Talwar and Zhang 2019,
  "Rényi differential privacy of the sampled Gaussian mechanism", Section 3):
  RDP(α) = log(A_α)/(α−1) with A_α = E_{z~N(0,σ²)}[((1−q) + q·e^{(2z−1)/(2σ²)})^α].
  For integer α this is the binomial sum
  A_α = Σ_{k=0}^{α} C(α,k) (1−q)^{α−k} q^k exp((k²−k)/(2σ²));
  for fractional α we integrate the expectation numerically (a Riemann sum
  over a grid of σ/20, in log space).
- RDP → (ε, δ): the conversion dp_accounting 0.6's RdpAccountant applies
  (Canonne, Kamath and Steinke 2020, "The discrete Gaussian for differential
  privacy", Proposition 12; Asoodeh et al. 2021, Equation 20):
  ε = min_α [RDP(α) + log((α−1)/α) − (log δ + log α)/(α−1)], floored at 0;
  and the classic one that TF-Privacy used until 2020 (Mironov 2017,
  Proposition 3): ε = min_α [RDP(α) − log δ/(α−1)].
- (ε, δ) of T Poisson-subsampled Gaussian steps, by composing the privacy
  loss distribution in numpy (Sommer, Meiser and Mohammadi 2019; Koskela,
  Jälkö and Honkela 2020): δ(ε) = E_P[(1 − e^{ε − L_T})_+] for the composed
  loss L_T, under add and under remove, the larger; with every loss rounded
  up, then down, the two results bracket the exact ε. For small T only.
"""

import functools
import math

import numpy as np
from scipy import optimize
from scipy import special

# The RDP orders tfdp documents (docs/PRIVACY.md, "RDP vs PLD": 1.1 … 10.9 in
# steps of 0.1, 11 … 63, 128, 256, 512, 1024), written out here rather than
# read from dp_accounting so that a change of orders shows.
TFDP_RDP_ORDERS = tuple(
    [round(1 + x / 10, 1) for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
)
TFDP_INTEGER_ORDERS = tuple(a for a in TFDP_RDP_ORDERS if float(a).is_integer())

# How close tfdp must come to these figures, and why.
#
# Gaussian compositions by RDP (shuffle, q = 1): the same sum count·α/(2σ²)
# and the same conversion, so only float rounding may differ.
RDP_GAUSSIAN_RTOL = 1e-12
# Gaussian compositions by PLD: dp_accounting discretises the Gaussian's
# privacy loss pessimistically (never below the exact ε); it lands within
# 1e-8 relative above the exact ε for every case tested.
PLD_GAUSSIAN_RTOL = 1e-6
# The Poisson-subsampled Gaussian by RDP. At integer orders dp_accounting's
# RDP is the binomial sum. At fractional orders its series for A_α
# (`_compute_log_a_frac`, dp_accounting 0.6) adds the absolute value of every
# term, although the generalised binomial coefficients C(α, i) alternate in
# sign for i > α: its RDP is above the exact one (5% at α = 1.1 for q = 0.01,
# σ = 1.1; 20% at α = 1.1 for the paper's q = 0.051, σ = 1.3127). That is
# conservative, and tfdp's ε, which is the smaller of the two orders' bounds,
# sits between the exact figure and at most this fraction above it (1.7e-3
# at worst in the cases tested, σ = 0.8, q = 0.1); and never above the
# integer orders' figure.
RDP_FRACTIONAL_SLACK = 2.5e-3


# --------------------------------------------------------------------------
# Gaussian mechanism, exact.
# --------------------------------------------------------------------------


def gaussian_mu(sigma, count=1):
    """μ of `count` composed Gaussian mechanisms with noise multiplier σ: √count/σ."""
    return math.sqrt(count) / sigma


def gaussian_delta(epsilon, mu):
    """Exact δ(ε) of the μ-Gaussian mechanism: Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2).

    The second term is formed in log space (e^ε times a tiny tail).
    """
    a = -epsilon / mu + mu / 2
    b = -epsilon / mu - mu / 2
    return float(special.ndtr(a) - math.exp(epsilon + special.log_ndtr(b)))


def gaussian_epsilon(delta, mu):
    """The smallest ε with `gaussian_delta(ε, μ) <= δ` (δ(ε) is decreasing in ε)."""
    if gaussian_delta(0.0, mu) <= delta:
        return 0.0
    hi = mu * mu / 2 + mu * math.sqrt(2 * math.log(1 / delta)) + 1.0
    while gaussian_delta(hi, mu) > delta:
        hi *= 2
    return optimize.brentq(lambda e: gaussian_delta(e, mu) - delta, 0.0, hi, xtol=1e-13, rtol=1e-14)


# --------------------------------------------------------------------------
# RDP.
# --------------------------------------------------------------------------


def gaussian_rdp(sigma, orders=TFDP_RDP_ORDERS):
    """RDP of one Gaussian mechanism at each order: α/(2σ²)."""
    return np.asarray(orders, dtype=float) / (2 * sigma**2)


def _log_a_integer(q, sigma, alpha):
    # log Σ_k C(α,k) (1−q)^{α−k} q^k exp((k²−k)/(2σ²)), every term in logs.
    k = np.arange(alpha + 1, dtype=float)
    log_binom = special.gammaln(alpha + 1) - special.gammaln(k + 1) - special.gammaln(alpha - k + 1)
    with np.errstate(divide="ignore"):
        log_terms = (log_binom + (alpha - k) * np.log1p(-q) + k * np.log(q)
                     + (k * k - k) / (2 * sigma**2))
    if q == 1.0:
        log_terms[:-1] = -np.inf
    return float(special.logsumexp(log_terms))


def _log_a_quadrature(q, sigma, alpha, points_per_sigma=20, width=15.0):
    # A_α = ∫ φ_σ(z) ((1−q) + q e^{(2z−1)/(2σ²)})^α dz. The integrand has a
    # bump of width σ at 0 and, for large z, behaves as a Gaussian of width σ
    # centred at z = α, so [−15σ, α + 15σ] holds all of it but e^−100 of it.
    # A Riemann sum of a smooth, fast-decaying integrand converges
    # geometrically in the grid (σ/20 here): against the binomial sums at
    # integer orders and mpmath at fractional ones it is within 1e-8 in RDP,
    # and finer grids only add rounding error.
    z = np.arange(-width * sigma, alpha + width * sigma, sigma / points_per_sigma)
    log_phi = -z * z / (2 * sigma**2) - math.log(sigma * math.sqrt(2 * math.pi))
    log_ratio = np.logaddexp(math.log1p(-q), math.log(q) + (2 * z - 1) / (2 * sigma**2))
    return float(special.logsumexp(log_phi + alpha * log_ratio) + math.log(sigma / points_per_sigma))


def poisson_gaussian_rdp(q, sigma, orders=TFDP_RDP_ORDERS, integer_by_quadrature=False):
    """RDP of one step of the Poisson-subsampled Gaussian at each order.

    Integer orders by the binomial sum, fractional ones by quadrature (or
    every order by quadrature, to cross-check the two). q = 1 is the plain
    Gaussian, α/(2σ²).
    """
    return np.array(_poisson_gaussian_rdp(float(q), float(sigma), tuple(orders),
                                          bool(integer_by_quadrature)))


@functools.lru_cache(maxsize=64)
def _poisson_gaussian_rdp(q, sigma, orders, integer_by_quadrature):
    out = []
    for alpha in orders:
        if q == 1.0:
            out.append(alpha / (2 * sigma**2))
        elif float(alpha).is_integer() and not integer_by_quadrature:
            out.append(_log_a_integer(q, sigma, int(alpha)) / (alpha - 1))
        else:
            out.append(_log_a_quadrature(q, sigma, float(alpha)) / (alpha - 1))
    return tuple(out)


def rdp_to_epsilon(orders, rdp, delta):
    """ε from an RDP curve by the improved conversion (CKS 2020, Prop. 12).

    ε = min_α [RDP(α) + log((α−1)/α) − (log δ + log α)/(α−1)], floored at 0.
    (dp_accounting also returns 0 where δ² > 1 − e^{−RDP}, which only
    happens at RDP of order δ², far below every case tested.)
    """
    a = np.asarray(orders, dtype=float)
    r = np.asarray(rdp, dtype=float)
    eps = r + np.log1p(-1 / a) - (math.log(delta) + np.log(a)) / (a - 1)
    return max(0.0, float(np.min(eps)))


def rdp_to_epsilon_classic(orders, rdp, delta):
    """ε by the classic conversion (Mironov 2017, Prop. 3): min_α RDP(α) − log δ/(α−1)."""
    a = np.asarray(orders, dtype=float)
    return float(np.min(np.asarray(rdp, dtype=float) - math.log(delta) / (a - 1)))


# --------------------------------------------------------------------------
# DP-SGD runs.
# --------------------------------------------------------------------------


def shuffle_passes(steps, dataset_size, batch_size):
    """Passes a shuffle run of `steps` touches: ⌈steps / (N // B)⌉ (docs/PRIVACY.md)."""
    return -(-steps // (dataset_size // batch_size))


def gaussian_composition_rdp_epsilon(sigma, count, delta, orders=TFDP_RDP_ORDERS):
    """ε of `count` Gaussian mechanisms by RDP: count·α/(2σ²), improved conversion."""
    return rdp_to_epsilon(orders, count * gaussian_rdp(sigma, orders), delta)


def gaussian_composition_exact_epsilon(sigma, count, delta):
    """Exact ε of `count` Gaussian mechanisms: the μ = √count/σ Gaussian's."""
    return gaussian_epsilon(delta, gaussian_mu(sigma, count))


def poisson_rdp_epsilon(sigma, steps, q, delta, orders=TFDP_RDP_ORDERS, conversion=rdp_to_epsilon):
    """ε of `steps` Poisson-subsampled Gaussian steps by RDP over `orders`."""
    return conversion(orders, steps * poisson_gaussian_rdp(q, sigma, orders), delta)


# --------------------------------------------------------------------------
# Poisson-subsampled Gaussian, (ε, δ) by direct numerical composition.
# --------------------------------------------------------------------------


def _loss_pmf(q, sigma, grid, direction, pessimistic, tail=1e-14):
    """One step's privacy loss on the grid {i·grid}, and its mass at +∞.

    "remove": P = (1−q)N(0,σ²) + qN(1,σ²) against Q = N(0,σ²), loss
    L(z) = log((1−q) + q·e^{(2z−1)/(2σ²)}) with z ~ P; "add": the pair
    swapped, loss −L(z) with z ~ Q. L is increasing in z, so the mass of a
    loss interval is that of a z interval, in closed form (Φ). Rounding each
    loss up (pessimistic) bounds δ(ε) from above, rounding down from below.
    The z-tail beyond 1 + σ·Φ⁻¹(1 − 10⁻¹⁴) is sent to loss +∞ (pessimistic,
    "remove"), to the lowest loss ("add") or dropped (optimistic).

    Returns:
        `(pmf, offset, infinite)`: pmf[i] is the mass at loss (offset + i)·grid.
    """
    lo = math.log1p(-q)
    z_hi = 1 + sigma * float(-special.ndtri(tail))
    hi = math.log((1 - q) + q * math.exp((2 * z_hi - 1) / (2 * sigma**2)))
    edges = np.arange(math.floor(lo / grid), math.ceil(hi / grid) + 1) * grid
    # z at which L(z) = l, for l > log(1 − q): e^l − (1 − q) = expm1(l) + q.
    z_inner = sigma**2 * (np.log(np.expm1(edges[1:-1]) + q) - math.log(q)) + 0.5
    z = np.concatenate([[-np.inf], z_inner, [z_hi]])
    if direction == "remove":
        cdf = (1 - q) * special.ndtr(z / sigma) + q * special.ndtr((z - 1) / sigma)
        values = edges[1:] if pessimistic else edges[:-1]   # L in (edges[i], edges[i+1]]
    else:
        cdf = special.ndtr(z / sigma)
        values = -edges[:-1] if pessimistic else -edges[1:]  # −L in [−edges[i+1], −edges[i])
    mass = np.diff(cdf)
    beyond = 1.0 - cdf[-1]
    offset = int(round(values.min() / grid))
    idx = np.round(values / grid).astype(int) - offset
    pmf = np.zeros(idx.max() + 1)
    np.add.at(pmf, idx, mass)
    infinite = 0.0
    if pessimistic and direction == "remove":
        infinite = beyond
    elif pessimistic:
        pmf[0] += beyond
    return pmf, offset, infinite


def _composed_losses(sigma, steps, q, grid, pessimistic):
    # Per direction: the `steps`-fold composed loss pmf (by FFT), its loss
    # values, and the mass at +∞.
    out = []
    for direction in ("remove", "add"):
        pmf, offset, infinite = _loss_pmf(q, sigma, grid, direction, pessimistic)
        n = steps * (len(pmf) - 1) + 1
        size = 1 << (n - 1).bit_length()
        composed = np.fft.irfft(np.fft.rfft(pmf, size) ** steps, size)[:n]
        losses = (steps * offset + np.arange(n)) * grid
        out.append((composed, losses, 1.0 - (1.0 - infinite) ** steps))
    return out


def _hockey_stick(epsilon, composed_losses):
    # δ(ε) = E_P[(1 − e^{ε − L_T})_+] (+ the mass at +∞), the larger direction.
    out = 0.0
    for composed, losses, infinite in composed_losses:
        keep = losses > epsilon
        finite = float(np.sum(composed[keep] * -np.expm1(epsilon - losses[keep])))
        out = max(out, finite + infinite)
    return out


def poisson_gaussian_delta(epsilon, sigma, steps, q, grid=1e-4, pessimistic=True):
    """δ(ε) of `steps` Poisson-subsampled Gaussian steps, add or remove (the larger).

    δ(ε) = ∫(P − e^ε Q)_+ = E_P[(1 − e^{ε − L_T})_+] for the composed loss
    L_T, a sum of `steps` independent one-step losses whose pmf is the
    one-step pmf convolved `steps` times, by FFT. With `pessimistic` an
    upper bound on the exact δ(ε), else a lower bound; in ε the two are
    steps·grid apart. The FFT has steps·(one step's loss range)/grid points:
    half a second at 20 steps for σ = 0.9, q = 0.05; the bracket widens with
    steps unless the grid shrinks, so this is for short runs.
    """
    return _hockey_stick(epsilon, _composed_losses(sigma, steps, q, grid, pessimistic))


def poisson_gaussian_epsilon(delta, sigma, steps, q, grid=1e-4, pessimistic=True):
    """The ε at which `poisson_gaussian_delta` falls to δ (an upper or a lower bound)."""
    composed = _composed_losses(sigma, steps, q, grid, pessimistic)
    f = lambda e: _hockey_stick(e, composed) - delta
    if f(0.0) <= 0:
        return 0.0
    hi = 1.0
    while f(hi) > 0:
        hi *= 2
    return optimize.brentq(f, 0.0, hi, xtol=grid / 10)


# --------------------------------------------------------------------------
# Assertions, for absltest / unittest test cases.
# --------------------------------------------------------------------------


class ClosedFormAssertions:
    """Mixin: tfdp's ε against the figures above, with the tolerances above."""

    def assertGaussianRdp(self, got, sigma, count, delta):
        """`got` is ε of `count` Gaussian(σ) mechanisms by RDP (α/(2σ²) each)."""
        expected = gaussian_composition_rdp_epsilon(sigma, count, delta)
        self.assertAlmostEqual(got, expected, delta=RDP_GAUSSIAN_RTOL * expected)

    def assertGaussianPld(self, got, sigma, count, delta):
        """`got` is the exact ε of `count` Gaussian(σ) mechanisms, from above."""
        expected = gaussian_composition_exact_epsilon(sigma, count, delta)
        self.assertGreaterEqual(got, expected * (1 - 1e-12))
        self.assertLessEqual(got, expected * (1 + PLD_GAUSSIAN_RTOL))

    def assertPoissonRdp(self, got, sigma, steps, q, delta):
        """`got` is ε of `steps` Poisson-subsampled Gaussian steps by RDP over tfdp's orders.

        Exact RDP (binomial sums and quadrature) at every order: `got` is
        not below it, and above it by at most RDP_FRACTIONAL_SLACK; integer
        orders only (the binomial sums alone): `got` is not above it.
        """
        exact = poisson_rdp_epsilon(sigma, steps, q, delta)
        integer = poisson_rdp_epsilon(sigma, steps, q, delta, orders=TFDP_INTEGER_ORDERS)
        self.assertGreaterEqual(got, exact * (1 - 1e-9))
        self.assertLessEqual(got, exact * (1 + RDP_FRACTIONAL_SLACK))
        self.assertLessEqual(got, integer * (1 + 1e-9))
