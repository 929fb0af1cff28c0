"""Inverting the accountant: noise for a budget, steps within a budget."""

import math

from tfdp.privacy import accounting

# Calibration searches sigma in this range. Below the floor a run gives no
# meaningful privacy. Near the ceiling RDP's finite order grid (largest
# order 1024) makes epsilon stall around (log(1/delta) - log(1024)) / 1023
# (about 0.0045 at delta=1e-5) until the RDP is small enough for the KL
# bound to give 0, so tiny targets are refused rather than chased.
MIN_NOISE_MULTIPLIER = 1e-3
MAX_NOISE_MULTIPLIER = 1e4

# `max_steps_within` doubles up to this many steps before giving up.
MAX_STEPS = 2**48


def _validate_target(target_epsilon):
    if (
        not accounting._is_real(target_epsilon)
        or math.isnan(target_epsilon)
        or target_epsilon <= 0
    ):
        raise ValueError(
            "`target_epsilon` must be > 0. "
            f"Received: target_epsilon={target_epsilon!r}"
        )
    return float(target_epsilon)


def calibrate_noise(
    target_epsilon,
    delta,
    *,
    steps,
    sampling_rate=None,
    dataset_size=None,
    batch_size=None,
    accountant="rdp",
    sampling="poisson",
    tolerance=1e-3,
):
    """Returns the smallest noise multiplier whose epsilon meets a target.

    Epsilon decreases monotonically in `sigma`, so the answer is found by
    bracketing (doubling/halving from `sigma = 1`) and then bisection. The
    returned `sigma` satisfies `epsilon(sigma) <= target_epsilon` (it was
    evaluated), and bisection stops only once a `sigma_lo >= sigma * (1 -
    tolerance)` has been evaluated with `epsilon(sigma_lo) > target_epsilon`.
    So `sigma` is within a relative `tolerance` of the exact smallest
    noise multiplier, and never below it. (For PLD, "monotone" holds up to
    its discretisation, which is pessimistic.)

    The search range is `[1e-3, 1e4]`: if even `sigma = 1e-3` meets the
    target, `1e-3` is returned; if `sigma = 1e4` does not, a `ValueError`
    says the target is unreachable. (With RDP, epsilon stalls around
    `(log(1/delta) - log(1024)) / 1023`, about 0.0045 at `delta = 1e-5`,
    once the best order is the largest one, 1024; targets below that need
    enormous `sigma`.) With `accountant="pld"` the search starts from the
    RDP answer, because PLD evaluations are slow.

    Args:
        target_epsilon: float. Privacy budget, `> 0`.
        delta: float. Target delta in `(0, 1)`.
        steps: int. Number of optimizer steps. With `steps == 0` nothing is
            released, and `0.0` is returned.
        sampling_rate: float or None. `q`. Defaults to `None`.
        dataset_size: int or None. `N`. Defaults to `None`.
        batch_size: int or None. `B`. Defaults to `None`.
        accountant: str. `"rdp"` or `"pld"`. Defaults to `"rdp"`.
        sampling: str. `"poisson"` or `"shuffle"` (see
            `tfdp.privacy.epsilon`). Defaults to `"poisson"`.
        tolerance: float. Relative precision of the returned `sigma`, in
            `(0, 1)`. Defaults to `1e-3`.

    Returns:
        The noise multiplier, a float.
    """
    target = _validate_target(target_epsilon)
    if not accounting._is_real(tolerance) or not 0 < tolerance < 1:
        raise ValueError(
            f"`tolerance` must be in (0, 1). Received: tolerance={tolerance!r}"
        )
    _, steps, delta, q, n, b = accounting._validate_all(
        1.0,
        steps,
        delta,
        sampling_rate,
        dataset_size,
        batch_size,
        accountant,
        sampling,
    )
    accounting.check_delta_against_dataset(delta, n)
    if steps == 0:
        return 0.0

    def eps(sigma):
        return accounting._epsilon(
            sigma, steps, delta, q, n, b, accountant, sampling
        )

    guess, factor = 1.0, 2.0
    if accountant == "pld":
        # PLD evaluations are slow (seconds at small sigma), so start from
        # the cheap RDP answer: PLD is the tighter accountant, so its sigma
        # is usually a few percent below RDP's and a narrow bracket holds.
        try:
            guess = calibrate_noise(
                target,
                delta,
                steps=steps,
                sampling_rate=q,
                accountant="rdp",
                tolerance=tolerance,
            )
            factor = 1.1
        except ValueError:
            pass
    where = (
        f"{accountant}, {sampling}, steps={steps}, q={q:.6g}, delta={delta:g}"
    )
    return _smallest_sigma(eps, target, tolerance, guess, factor, where)


def _smallest_sigma(eps, target, tolerance, guess, factor, where):
    """Bracket, then bisect, the smallest sigma with `eps(sigma) <= target`.

    `eps` is non-increasing in sigma. Keeps `eps(lo) > target >= eps(hi)`
    and returns `hi` once `hi - lo <= tolerance * hi`.
    """
    hi = min(max(guess, MIN_NOISE_MULTIPLIER), MAX_NOISE_MULTIPLIER)
    if eps(hi) <= target:
        while True:
            if hi <= MIN_NOISE_MULTIPLIER:
                return MIN_NOISE_MULTIPLIER
            lo = max(hi / factor, MIN_NOISE_MULTIPLIER)
            if eps(lo) > target:
                break
            hi = lo
    else:
        lo = hi
        while True:
            if lo >= MAX_NOISE_MULTIPLIER:
                raise ValueError(
                    "target_epsilon is unreachable with noise_multiplier <= "
                    f"{MAX_NOISE_MULTIPLIER:g} ({where}). "
                    f"Received: target_epsilon={target!r}"
                )
            hi = min(lo * factor, MAX_NOISE_MULTIPLIER)
            if eps(hi) <= target:
                break
            lo = hi
    while hi - lo > tolerance * hi:
        mid = 0.5 * (lo + hi)
        if eps(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi


def _max_steps_within(target, epsilon_of_steps):
    """Largest `t >= 0` with `epsilon_of_steps(t) <= target` (monotone)."""
    if epsilon_of_steps(1) > target:
        return 0
    lo, hi = 1, 2
    # Invariant: eps(lo) <= target; find hi with eps(hi) > target.
    while epsilon_of_steps(hi) <= target:
        lo = hi
        if hi >= MAX_STEPS:
            raise ValueError(
                f"target_epsilon allows more than {MAX_STEPS} steps. "
                f"Received: target_epsilon={target!r}"
            )
        hi *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if epsilon_of_steps(mid) <= target:
            lo = mid
        else:
            hi = mid
    return lo


def max_steps_within(
    target_epsilon,
    noise_multiplier,
    delta,
    *,
    sampling_rate=None,
    dataset_size=None,
    batch_size=None,
    accountant="rdp",
    sampling="poisson",
):
    """Returns the largest step count whose epsilon is `<= target_epsilon`.

    Found by doubling, then integer bisection, on the monotone map from
    steps to epsilon. Returns `0` when even one step exceeds the budget
    (e.g. `noise_multiplier == 0`).

    Args:
        target_epsilon: float. Privacy budget, `>= 0`.
        noise_multiplier: float. Noise multiplier `sigma`.
        delta: float. Target delta in `(0, 1)`.
        sampling_rate: float or None. `q`. Defaults to `None`.
        dataset_size: int or None. `N`. Defaults to `None`.
        batch_size: int or None. `B`. Defaults to `None`.
        accountant: str. `"rdp"` or `"pld"`. Defaults to `"rdp"`.
        sampling: str. `"poisson"` or `"shuffle"`. Defaults to `"poisson"`.

    Returns:
        The number of steps, an int.
    """
    target = _validate_budget(target_epsilon)
    sigma, _, delta, q, n, b = accounting._validate_all(
        noise_multiplier,
        0,
        delta,
        sampling_rate,
        dataset_size,
        batch_size,
        accountant,
        sampling,
    )
    accounting.check_delta_against_dataset(delta, n)
    return _max_steps_within(
        target,
        lambda t: accounting._epsilon(
            sigma, t, delta, q, n, b, accountant, sampling
        ),
    )


def _validate_budget(target_epsilon):
    if (
        not accounting._is_real(target_epsilon)
        or math.isnan(target_epsilon)
        or target_epsilon < 0
    ):
        raise ValueError(
            "`target_epsilon` must be >= 0. "
            f"Received: target_epsilon={target_epsilon!r}"
        )
    return float(target_epsilon)
