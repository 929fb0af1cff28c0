"""Banded matrix factorization (BandMF): the strategy's coefficients and its accounting.

DP-SGD adds independent noise z_t ~ N(0, (σC)²) at every step t. Banded
matrix-factorization DP-SGD (Choquette-Choo et al., "(Amplified) Banded
Matrix Factorization", NeurIPS 2023) adds correlated noise instead: row t of
C⁻¹Z, where the strategy C is a b-banded lower-triangular Toeplitz matrix
with coefficients c_0 … c_{b-1} (C[t, t-j] = c_j) and Z's rows are the
independent draws. Step by step that is

    w_t = (z_t − Σ_{j=1}^{b-1} c_j w_{t-j}) / c_0,

so later steps partly cancel the noise of earlier ones and the model's noise
(the prefix sums of the w's) grows more slowly than DP-SGD's.

The guarantee holds when every column of C has norm at most 1 and each
example takes part only in steps that are at least b apart (the examples are
split into b groups and step t samples from group t mod b, see
`tfdp.samplers.BandedPoissonSampler`): the run is then accounted as DP-SGD
over ⌈T/b⌉ rounds of the Poisson-subsampled Gaussian at the rate within a
group (`amplified_dp_event`). With b = 1 and c_0 = 1 it is DP-SGD.

The default coefficients are the banded square root (Kalinin & Lampert,
"Banded Square Root Matrix Factorization for Differentially Private Model
Training", 2024): the first b coefficients of (1 − x)^(−1/2), scaled to norm
1. `optimized_coefficients` lowers the prefix-sum error for a known number
of steps further.

Imports no TensorFlow (`python -m tfdp.privacy` stays light).
"""

import math
import numbers

import dp_accounting
import numpy as np

# Column norms are allowed this far above 1: the float rounding of a
# normalisation, far below any change of the accounted σ.
_NORM_TOLERANCE = 1e-12


def validate_bands(bands):
    """`bands` as an int, or a clear error unless it is an integer >= 1."""
    if isinstance(bands, bool) or not isinstance(bands, numbers.Integral) or bands < 1:
        if not (isinstance(bands, float) and bands.is_integer() and bands >= 1):
            raise ValueError(f"`bands` must be an integer >= 1. Received: bands={bands!r}")
    return int(bands)


def square_root_coefficients(bands):
    """The banded square-root strategy: (1 − x)^(−1/2) truncated to `bands`, norm 1.

    The coefficients of (1 − x)^(−1/2) are a_0 = 1, a_k = a_{k-1}·(2k − 1)/(2k)
    (1, 1/2, 3/8, 5/16, …); the first `bands` of them are scaled so that
    their Euclidean norm, the largest column norm of C, is 1.

    Args:
        bands: int. b >= 1.

    Returns:
        A tuple of `bands` floats. `(1.0,)` for b = 1 (DP-SGD).
    """
    bands = validate_bands(bands)
    coefficients = [1.0]
    for k in range(1, bands):
        coefficients.append(coefficients[-1] * (2 * k - 1) / (2 * k))
    return normalize_coefficients(coefficients)


def check_coefficients(coefficients, bands=None):
    """Validated strategy coefficients: a tuple of finite floats, c_0 > 0, norm <= 1.

    Args:
        coefficients: sequence of floats. c_0 … c_{b-1}.
        bands: int or None. When given, the number of coefficients it must be.
            Defaults to None.

    Returns:
        A tuple of floats.
    """
    values = np.asarray(coefficients, dtype=np.float64).reshape(-1) if _is_sequence(
        coefficients) else None
    if values is None or values.size == 0 or not np.all(np.isfinite(values)):
        raise ValueError(
            "The banded strategy's coefficients must be a non-empty sequence of finite "
            f"numbers c_0 … c_(b-1). Received: coefficients={coefficients!r}"
        )
    if bands is not None and values.size != validate_bands(bands):
        raise ValueError(
            f"A {bands}-banded strategy has {bands} coefficients. "
            f"Received: {values.size} coefficients, bands={bands}"
        )
    if not values[0] > 0:
        raise ValueError(
            "The banded strategy's first coefficient c_0 must be > 0 (C must be "
            f"invertible). Received: c_0={values[0]!r}"
        )
    norm = float(np.sqrt(np.sum(values**2)))
    if norm > 1 + _NORM_TOLERANCE:
        raise ValueError(
            "The banded strategy's column norm (the coefficients' Euclidean norm) must be "
            "at most 1, which the accounting assumes; scale them with "
            f"`normalize_coefficients`. Received: norm={norm!r}"
        )
    return tuple(float(v) for v in values)


def normalize_coefficients(coefficients):
    """`coefficients` scaled to Euclidean norm 1 (every column norm of C then <= 1).

    Args:
        coefficients: sequence of floats, c_0 > 0.

    Returns:
        A tuple of floats.
    """
    values = np.asarray(coefficients, dtype=np.float64).reshape(-1) if _is_sequence(
        coefficients) else None
    if values is None or values.size == 0 or not np.all(np.isfinite(values)) or not values[0] > 0:
        raise ValueError(
            "Only finite coefficients with c_0 > 0 can be normalised. "
            f"Received: coefficients={coefficients!r}"
        )
    values = values / np.sqrt(np.sum(values**2))
    return check_coefficients(values)


def _is_sequence(value):
    return isinstance(value, (list, tuple, np.ndarray)) and not isinstance(value, str)


def strategy_matrix(coefficients, steps):
    """C, the `steps × steps` lower-triangular banded Toeplitz matrix (C[t, t-j] = c_j)."""
    c = np.asarray(coefficients, dtype=np.float64)
    matrix = np.zeros((steps, steps))
    for j, value in enumerate(c[:steps]):
        matrix += value * np.eye(steps, k=-j)
    return matrix


def _inverse_series(c, steps):
    """d with (Σ c_j x^j)(Σ d_k x^k) = 1 up to x^(steps-1): C⁻¹'s Toeplitz coefficients."""
    d = np.zeros(steps)
    bands = len(c)
    for k in range(steps):
        low = max(0, k - bands + 1)
        # c_j d_{k-j} over j = 1 … min(k, b-1), i.e. d_i for i = k-b+1 … k-1.
        tail = np.dot(c[k - low:0:-1], d[low:k]) if k else 0.0
        d[k] = ((1.0 if k == 0 else 0.0) - tail) / c[0]
    return d


def _error_terms(c, steps):
    """(C⁻¹'s coefficients d, their prefix sums e, weights T − k)."""
    d = _inverse_series(c, steps)
    e = np.cumsum(d)
    weights = steps - np.arange(steps)
    return d, e, weights


def prefix_sum_error(coefficients, steps):
    """The model's noise error per unit σC: RMS over steps of the prefix-sum noise.

    After t + 1 steps the model holds the sum of the noise w_0 + … + w_t,
    row t of A·C⁻¹·Z (A the lower-triangular matrix of ones). Its std per
    coordinate, in units of σC, is the norm of row t of A·C⁻¹; this is the
    root mean square of that over t = 0 … T−1, sqrt(‖A·C⁻¹‖²_F / T).
    DP-SGD (`(1.0,)`) gives sqrt((T + 1) / 2).

    Args:
        coefficients: sequence of floats. c_0 … c_{b-1} (`check_coefficients`).
        steps: int. T >= 1.

    Returns:
        A float.
    """
    c = np.asarray(check_coefficients(coefficients))
    steps = _validate_steps(steps)
    _, e, weights = _error_terms(c, steps)
    return float(math.sqrt(np.dot(weights, e**2) / steps))


def _validate_steps(steps):
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"`steps` must be an integer >= 1. Received: steps={steps!r}")
    return int(steps)


def _squared_error_and_gradient(theta, steps):
    """‖A·C(θ/‖θ‖)⁻¹‖²_F / T and its gradient in θ (the scale of θ drops out)."""
    norm2 = float(np.dot(theta, theta))
    _, e, weights = _error_terms(theta, steps)
    loss = float(np.dot(weights, e**2)) / steps
    # ∂d/∂c_j = −x^j·d², so ∂e_k/∂c_j = −P_{k-j}, P the prefix sums of d².
    d = _inverse_series(theta, steps)
    prefix = np.cumsum(np.convolve(d, d)[:steps])
    u = weights * e
    grad = np.array([-2.0 / steps * np.dot(u[j:], prefix[:steps - j]) for j in range(len(theta))])
    # The normalised loss is loss(θ)·‖θ‖² (the error scales as 1 / ‖c‖).
    return loss * norm2, grad * norm2 + 2.0 * loss * theta


def optimized_coefficients(bands, steps, iterations=300):
    """Coefficients of norm 1 that lower `prefix_sum_error` for `steps` steps.

    Starts from `square_root_coefficients(bands)` and descends the
    normalised squared error along its exact gradient (O(T·b + T²) per
    evaluation) with a backtracking line search, so it never returns
    anything worse than the banded square root. A few hundred milliseconds
    for T in the thousands.

    When T < b, C (T × T) holds only c_0 … c_{T-1}: the later coefficients
    would add to the norm and lower nothing, so they are 0 and the first T
    are the optimised T-banded strategy (T = 1 gives DP-SGD's (1, 0, …)).

    Args:
        bands: int. b >= 1.
        steps: int. T, the steps of the run.
        iterations: int. Gradient steps at most. Defaults to 300.

    Returns:
        A tuple of `bands` floats.
    """
    bands = validate_bands(bands)
    steps = _validate_steps(steps)
    used = min(bands, steps)
    padding = (0.0,) * (bands - used)
    theta = np.asarray(square_root_coefficients(used))
    if used == 1:
        return tuple(theta) + padding

    def evaluate(point):
        # A trial point whose C⁻¹ grows without bound overflows: it counts as
        # infinitely bad, and the line search backs off.
        with np.errstate(over="ignore", invalid="ignore"):
            loss, grad = _squared_error_and_gradient(point, steps)
        if not (point[0] > 0 and np.isfinite(loss) and np.all(np.isfinite(grad))):
            return np.inf, None
        return loss, grad

    loss, grad = evaluate(theta)
    rate = 0.1 / max(float(np.linalg.norm(grad)), 1e-300)
    for _ in range(int(iterations)):
        while rate > 1e-12:
            trial = theta - rate * grad
            trial = trial / np.linalg.norm(trial)  # The loss ignores the scale.
            trial_loss, trial_grad = evaluate(trial)
            if trial_loss < loss - 1e-4 * rate * float(np.dot(grad, grad)):
                break
            rate *= 0.5
        else:
            break
        if loss - trial_loss < 1e-12 * loss:
            theta, loss = trial, trial_loss
            break
        theta, loss, grad = trial, trial_loss, trial_grad
        rate *= 2.0
    return normalize_coefficients(theta) + padding


def rounds(steps, bands):
    """⌈T / b⌉: how many times one example can take part in T steps."""
    return -(-int(steps) // validate_bands(bands))


def amplified_dp_event(noise_multiplier, steps, *, bands, group_sampling_rate):
    """The `DpEvent` of amplified BandMF (column norms <= 1, b-separated groups).

    DP-SGD over ⌈T/b⌉ rounds: `SelfComposed(PoissonSampled(q, Gaussian(σ)),
    ⌈T/b⌉)` with q the rate within an example's group.

    Args:
        noise_multiplier: float. σ.
        steps: int. T.
        bands: int. b.
        group_sampling_rate: float. q = B / (N / b).

    Returns:
        A `dp_accounting.DpEvent`.
    """
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            group_sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)),
        rounds(steps, bands),
    )
