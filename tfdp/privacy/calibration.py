"""Inverting the accountant: noise for a budget, steps within a budget."""

import math

from tfdp import validation
from tfdp.privacy import accounting

# Calibration searches sigma in this range. Below the floor a run gives no
# meaningful privacy. Near the ceiling RDP's finite order grid (largest
# order 1024) makes epsilon stall near (log(1/delta) - log(1024)) / 1023
# (about 0.0035 at delta=1e-5, after the conversion's small correction)
# until the RDP is small enough for the KL bound to give 0, so tiny targets
# are refused rather than chased.
MIN_NOISE_MULTIPLIER = 1e-3
MAX_NOISE_MULTIPLIER = 1e4

# `max_steps_within` doubles up to this many steps before giving up.
MAX_STEPS = 2**48


def calibrate_noise(
    target_epsilon,
    delta,
    *,
    steps,
    sampling_rate=None,
    dataset_size=None,
    batch_size=None,
    accountant="rdp",
    sampler="poisson",
    tolerance=1e-3,
):
    """Returns the smallest noise multiplier whose epsilon meets a target.

    Epsilon is non-increasing in `sigma`. The search keeps a bracket
    `epsilon(lo) > target_epsilon >= epsilon(hi)`: it brackets by doubling
    or halving from `sigma = 1`, then shrinks the bracket by log-log
    interpolation (falling back to bisection whenever that stops halving
    it), and returns `hi` once `hi - lo <= tolerance * hi`. So the returned
    `sigma` satisfies `epsilon(sigma) <= target_epsilon` (it was evaluated),
    and some `sigma_lo >= sigma * (1 - tolerance)` was evaluated with
    `epsilon(sigma_lo) > target_epsilon`: `sigma` is within a relative
    `tolerance` above the exact smallest noise multiplier, never below it.
    (For PLD, monotonicity holds up to its pessimistic discretisation.)

    The search range is `[1e-3, 1e4]`: if even `sigma = 1e-3` meets the
    target, `1e-3` is returned; if `sigma = 1e4` does not, a `ValueError`
    says the target is unreachable. (With RDP, epsilon stalls around
    `(log(1/delta) - log(1024)) / 1023`, about 0.0035 at `delta = 1e-5`,
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
        sampler: str or `tfdp.samplers.Sampler`. `"poisson"` or
            `"shuffle"`, or a sampler instance (see `tfdp.privacy.epsilon`).
            Defaults to `"poisson"`.
        tolerance: float. Relative precision of the returned `sigma`, in
            `(0, 1)`. Defaults to `1e-3`.

    Returns:
        The noise multiplier, a float.
    """
    target = validation.validate_epsilon(target_epsilon)
    if not validation.is_real(tolerance) or not 0 < tolerance < 1:
        raise ValueError(
            f"`tolerance` must be in (0, 1). Received: tolerance={tolerance!r}"
        )
    # σ = 1 stands in for the σ being searched; `eps` asks for each one.
    query = accounting.PrivacyQuery(
        1.0, steps, delta, sampling_rate=sampling_rate, dataset_size=dataset_size,
        batch_size=batch_size, accountant=accountant, sampler=sampler, stacklevel=3,
    )
    steps, delta, q = query.steps, query.delta, query.sampling_rate
    if steps == 0:
        return 0.0

    def eps(sigma):
        return query.epsilon(noise_multiplier=sigma)

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
            factor = 1.25
        except ValueError:
            pass
        if guess <= MIN_NOISE_MULTIPLIER:
            # A PLD at sigma = 1e-3 is enormous; PLD is not looser than RDP,
            # so the floor meets the target there too.
            return MIN_NOISE_MULTIPLIER
    where = (
        f"{accountant}, {sampler}, steps={steps}, q={q:.6g}, delta={delta:g}"
    )
    return _smallest_sigma(eps, target, tolerance, guess, factor, where)


def _smallest_sigma(eps, target, tolerance, guess, factor, where):
    """Bracket, then shrink, the smallest sigma with `eps(sigma) <= target`.

    `eps` is non-increasing in sigma. Keeps `eps(lo) > target >= eps(hi)`
    and returns `hi` once `hi - lo <= tolerance * hi`.
    """
    hi = min(max(guess, MIN_NOISE_MULTIPLIER), MAX_NOISE_MULTIPLIER)
    e_hi = eps(hi)
    if e_hi <= target:
        while True:
            if hi <= MIN_NOISE_MULTIPLIER:
                return MIN_NOISE_MULTIPLIER
            lo = max(hi / factor, MIN_NOISE_MULTIPLIER)
            e_lo = eps(lo)
            if e_lo > target:
                break
            hi, e_hi = lo, e_lo
    else:
        lo, e_lo = hi, e_hi
        while True:
            if lo >= MAX_NOISE_MULTIPLIER:
                raise ValueError(
                    "target_epsilon is unreachable with noise_multiplier <= "
                    f"{MAX_NOISE_MULTIPLIER:g} ({where}). "
                    f"Received: target_epsilon={target!r}"
                )
            hi = min(lo * factor, MAX_NOISE_MULTIPLIER)
            e_hi = eps(hi)
            if e_hi <= target:
                break
            lo, e_lo = hi, e_hi
    # Shrinking: log(eps) is close to linear in log(sigma), so interpolate
    # for the root and probe just either side of it (a bracket of relative
    # width `tolerance` then closes in two evaluations, which matters for
    # PLD at seconds per evaluation). Bisect whenever that stops halving
    # the bracket, so the worst case stays bisection's.
    checkpoint_width, interpolated = hi - lo, 0
    while hi - lo > tolerance * hi:
        mid = None
        if interpolated < 2:
            mid = _probe(lo, hi, e_lo, e_hi, target, tolerance)
        if mid is None:
            mid = 0.5 * (lo + hi)
            checkpoint_width, interpolated = hi - lo, 0
        else:
            interpolated += 1
        e_mid = eps(mid)
        if e_mid <= target:
            hi, e_hi = mid, e_mid
        else:
            lo, e_lo = mid, e_mid
        if interpolated == 2 and hi - lo <= 0.5 * checkpoint_width:
            checkpoint_width, interpolated = hi - lo, 0
    return hi


def _probe(lo, hi, e_lo, e_hi, target, tolerance):
    """Next sigma to try, from log-log interpolation; None to bisect."""
    if not (math.isfinite(e_lo) and e_hi > 0 and e_lo > e_hi):
        return None
    x_lo, x_hi = math.log(lo), math.log(hi)
    slope = (math.log(e_hi) - math.log(e_lo)) / (x_hi - x_lo)
    root = math.exp(x_lo + (math.log(target) - math.log(e_lo)) / slope)
    # Move the endpoint farther from the estimate: to just above the root
    # if that is `hi`, else to just below it.
    if hi - root > root - lo:
        probe = root * (1 + 0.4 * tolerance)
    else:
        probe = root * (1 - 0.4 * tolerance)
    return probe if lo < probe < hi else None


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
    sampler="poisson",
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
        sampler: str or `tfdp.samplers.Sampler`. `"poisson"` or
            `"shuffle"`, or a sampler instance. Defaults to `"poisson"`.

    Returns:
        The number of steps, an int.
    """
    target = validation.validate_epsilon(target_epsilon, allow_zero=True)
    query = accounting.PrivacyQuery(
        noise_multiplier, 0, delta, sampling_rate=sampling_rate, dataset_size=dataset_size,
        batch_size=batch_size, accountant=accountant, sampler=sampler, stacklevel=3,
    )
    return max_steps_for_query(target, query)


def max_steps_for_query(target_epsilon, query):
    """The largest step count whose epsilon under `query` is `<= target_epsilon`.

    Args:
        target_epsilon: float. Privacy budget, `>= 0`.
        query: `tfdp.privacy.accounting.PrivacyQuery`. The run; its own
            step count is ignored.

    Returns:
        The number of steps, an int.
    """
    target = validation.validate_epsilon(target_epsilon, allow_zero=True)
    return _max_steps_within(target, lambda t: query.epsilon(steps=t))
