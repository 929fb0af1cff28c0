"""One rule per privacy quantity: C, σ, δ, ε and step counts.

Every route that takes these values (`tfdp.DPSGD`, the privacy ledger and
accountant, `clipped_grad_sum`, the TF-Privacy compat optimizers) checks them
here, so a value one route accepts is accepted by all, and a refused value
gets the same message everywhere.

Imports no TensorFlow (and nothing else of tfdp), so it is cheap to use from
the command-line accountant.
"""

import math
import numbers


def is_real(value):
    """Whether `value` is a real number (a Python or NumPy scalar), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value):
    """Whether `value` is an integer (a Python or NumPy scalar), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _finite(value):
    return is_real(value) and math.isfinite(value)


def _number(value, name):
    if not _finite(value):
        raise ValueError(f"{name} must be a finite number. Received: {name}={value!r}")
    return float(value)


def validate_l2_norm_clip(l2_norm_clip):
    """The clipping bound C: a finite number > 0.

    Args:
        l2_norm_clip: the value to check.

    Returns:
        C as a float.
    """
    if _number(l2_norm_clip, "l2_norm_clip") <= 0:
        raise ValueError(f"l2_norm_clip must be > 0. Received: l2_norm_clip={l2_norm_clip!r}")
    return float(l2_norm_clip)


def validate_noise_multiplier(noise_multiplier):
    """The noise multiplier σ: a finite number >= 0 (0 is no noise, ε = inf).

    Args:
        noise_multiplier: the value to check.

    Returns:
        σ as a float.
    """
    if _number(noise_multiplier, "noise_multiplier") < 0:
        raise ValueError(
            f"noise_multiplier must be >= 0. Received: noise_multiplier={noise_multiplier!r}"
        )
    return float(noise_multiplier)


def validate_delta(delta):
    """δ of a guarantee: a number in (0, 1).

    Args:
        delta: the value to check.

    Returns:
        δ as a float.
    """
    if not is_real(delta) or not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1). Received: delta={delta!r}")
    return float(delta)


def validate_epsilon(epsilon, name="target_epsilon", allow_zero=False):
    """A privacy budget ε: a finite number > 0 (>= 0 with `allow_zero`).

    Args:
        epsilon: the value to check.
        name: str. The argument's name, for the message. Defaults to
            "target_epsilon".
        allow_zero: bool. Whether 0 is a valid budget (e.g. for the steps
            within a budget, where it allows none). Defaults to False.

    Returns:
        ε as a float.
    """
    if not _finite(epsilon) or epsilon < 0 or (epsilon == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}. Received: {name}={epsilon!r}")
    return float(epsilon)


def validate_steps(steps, name="steps"):
    """A count of steps (or another count): an integer >= 0.

    Args:
        steps: the value to check.
        name: str. The argument's name, for the message. Defaults to "steps".

    Returns:
        The count as an int.
    """
    if not is_int(steps) or steps < 0:
        raise ValueError(f"{name} must be an integer >= 0. Received: {name}={steps!r}")
    return int(steps)
