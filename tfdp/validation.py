"""One rule per privacy quantity: C, σ, δ, ε, the divisor, step counts and user ids.

Every route that takes these values (`tfdp.DPSGD`, the privacy ledger and
accountant, `clipped_grad_sum`, the TF-Privacy compat optimizers, the
trainer's sources and Keras `fit(user_ids=...)`) checks them here, so a
value one route accepts is accepted by all, and a refused value gets the
same message everywhere.

Imports no TensorFlow (and nothing else of tfdp), so it is cheap to use from
the command-line accountant.
"""

import math
import numbers

import numpy as np


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


def validate_expected_batch_size(expected_batch_size):
    """The divisor of the noisy sum (the expected logical batch): a finite number > 0.

    Args:
        expected_batch_size: the value to check.

    Returns:
        The divisor as a float.
    """
    if not _finite(expected_batch_size) or expected_batch_size <= 0:
        raise ValueError(
            "expected_batch_size must be a finite number > 0. "
            f"Received: expected_batch_size={expected_batch_size!r}"
        )
    return float(expected_batch_size)


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


def _user_kind(value):
    """"number", "name" or None (not a user id) for one element of an object array."""
    if isinstance(value, (str, bytes)):
        return "name"
    if is_int(value):
        return "number"
    if _finite(value) and float(value).is_integer() and abs(value) < 2**63:
        return "number"
    return None


def validate_user_ids(user_ids, num_examples=None, name="user_ids"):
    """The user of each example: `[n]` integers, or `[n]` names.

    User-level privacy protects all the examples of one user, so an id that
    is missing or ambiguous would silently merge users (all NaN ids into one)
    or split one. Refused, in one error that counts the bad rows: None,
    NaN, ±inf, numbers that are not whole, other types (e.g. bools), and a
    mix of numbers and names (7 and "7" would be two users).

    Args:
        user_ids: array-like `[n]`: integers (floats holding whole numbers
            are taken as integers), or strings (bytes are decoded as UTF-8).
        num_examples: int or None. n, when the ids belong to n examples.
            Defaults to `None`.
        name: str. The argument's name, for the message. Defaults to
            `"user_ids"`.

    Returns:
        A `[n]` np.ndarray: int64 for numbers, str for names.

    Raises:
        ValueError: for another shape or length, no ids, or bad ids.
    """
    if isinstance(user_ids, (list, tuple)):
        # Keeps each element's own type: np.asarray([1, "a"]) would turn
        # the 1 into "1" and hide the mix.
        ids = np.empty(len(user_ids), dtype=object)
        ids[:] = list(user_ids)
    else:
        ids = np.asarray(user_ids)
    if ids.ndim != 1 or ids.shape[0] == 0 or (
            num_examples is not None and ids.shape[0] != num_examples):
        raise ValueError(
            f"`{name}` must hold one user per example, a non-empty [n] array. Received: "
            f"{name} of shape {ids.shape}"
            + ("" if num_examples is None else f" for {num_examples} examples"))
    n = ids.shape[0]
    if ids.dtype.kind in "iu":
        return ids.astype(np.int64)
    if ids.dtype.kind == "U":
        return ids
    if ids.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            whole = np.isfinite(ids) & (np.floor(ids) == ids) & (np.abs(ids) < 2**63)
        bad, names = np.flatnonzero(~whole), 0
    elif ids.dtype.kind in "SO":
        kinds = [_user_kind(v) for v in ids.tolist()]
        bad = np.flatnonzero([kind is None for kind in kinds])
        names = kinds.count("name")
    else:  # bool, complex, dates: not user ids.
        bad, names = np.arange(n), 0
    if bad.size:
        raise ValueError(
            f"`{name}` must be each example's user, an integer or a string: {bad.size} of "
            f"{n} rows are not (None, NaN, inf, a number that is not whole, or another "
            f"type), e.g. row {bad[0]}: {ids[bad[0]:bad[0] + 1].tolist()[0]!r}. Fix or drop those rows. "
            f"Received: {name} with {bad.size} bad rows of {n} (dtype {ids.dtype})")
    if 0 < names < n:
        raise ValueError(
            f"`{name}` mixes numbers and strings ({n - names} and {names} rows), so that "
            "7 and '7' would be different users: give one type. Received: "
            f"{name} with {n - names} number rows and {names} string rows")
    if names:
        return np.array([v.decode("utf-8", "replace") if isinstance(v, bytes) else v
                         for v in ids.tolist()], dtype=str)
    if ids.dtype.kind == "f":
        return ids.astype(np.int64)
    return np.array([int(v) for v in ids.tolist()], dtype=np.int64)
