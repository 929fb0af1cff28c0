"""δ: the default of a run, the check against N, and what the noise sampler adds.

No TensorFlow is imported here, so `python -m tfdp.privacy` starts quickly.
"""

import math
import warnings

from tfdp.validation import validate_hardened_noise
from tfdp.validation import validate_steps

# The largest default δ: training sets of fewer than 100,000 examples get it.
MAX_DEFAULT_DELTA = 1e-5


def default_delta(dataset_size=None):
    """The δ every route uses when none is given: min(1e-5, the largest power of ten below 1/N).

    1e-5 for N < 100,000 (the default run: N = 4,000), 1e-6 for N < 10⁶,
    1e-7 for ImageNet's 1.28 M; 1e-5 while N is unknown.

    Args:
        dataset_size: int or None. N (examples, or users at user level).

    Returns:
        A float.
    """
    if dataset_size is None or dataset_size < 1:
        return MAX_DEFAULT_DELTA
    return min(MAX_DEFAULT_DELTA, 10.0 ** -(math.floor(math.log10(dataset_size)) + 1))


def check_delta_against_dataset(delta, dataset_size, stacklevel=3):
    """Warns when `delta >= 1 / dataset_size`.

    A mechanism that publishes one random example outright is
    `(0, 1/N)`-DP, so `delta` should be well below `1/N` to mean anything.
    """
    if dataset_size is not None and delta >= 1.0 / dataset_size:
        warnings.warn(
            f"delta={delta:g} is >= 1/dataset_size = {1.0 / dataset_size:.3g} "
            f"(N={dataset_size}): such a delta permits leaking whole examples. Prefer "
            f"delta << 1/N, e.g. {default_delta(dataset_size):g} (the default for this N).",
            UserWarning,
            stacklevel=stacklevel,
        )


# tfdp's Gaussian sampler (`tfdp.dp.noise`) draws each pair of normals from
# one radius R = sqrt(-2 ln u1), with u1 a 64-bit uniform never below 2^-65:
# R never exceeds sqrt(130 ln 2) ≈ 9.49, and P(R > 9.49) = 2^-65 for an exact
# Gaussian. That tail is all the truncation there is.
NOISE_TAIL_MASS_PER_PAIR = 2.0**-65
# The hardened sampler sums two draws per coordinate, each pair of them from
# a 96-bit u1 never below 2^-97 (radius at most sqrt(194 ln 2) ≈ 11.6): two
# tails of 2^-97 per pair of coordinates.
HARDENED_NOISE_TAIL_MASS_PER_PAIR = 2 * 2.0**-97


def noise_truncation_delta(steps, num_parameters, hardened_noise=False):
    """δ added by the noise sampler's largest attainable draw (9.49σ).

    The run's noise differs from exact Gaussian noise only where an exact
    pair's radius would exceed the cap, so the two differ in total variation
    by at most ⌈d/2⌉·2⁻⁶⁵ per step, and T·⌈d/2⌉·2⁻⁶⁵ over the run. An
    (ε, δ)-DP guarantee of the exact mechanism is then an (ε, δ + that)
    guarantee of the run (docs/PRIVACY.md, "Floating-point noise"). With
    hardened noise, 2·2⁻⁹⁷ per pair instead.

    Args:
        steps: int. Noisy steps T.
        num_parameters: int. Noised coordinates per step d.
        hardened_noise: bool. The hardened sampler's bound. Defaults to
            False.

    Returns:
        The added δ, a float.
    """
    steps = validate_steps(steps)
    num_parameters = validate_steps(num_parameters, name="num_parameters")
    mass = (HARDENED_NOISE_TAIL_MASS_PER_PAIR if validate_hardened_noise(hardened_noise)
            else NOISE_TAIL_MASS_PER_PAIR)
    return steps * math.ceil(num_parameters / 2) * mass


