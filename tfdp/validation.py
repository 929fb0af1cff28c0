"""One rule per privacy quantity: C, σ, δ, ε, the divisor, step counts, user ids, labels,
and the `hardened_noise` switch.

Every route that takes these values (`tfdp.DPSGD`, the privacy ledger and
accountant, `clipped_grad_sum`, the TF-Privacy compat optimizers, the
trainer's sources and Keras `fit(user_ids=...)`, Keras `fit`'s labels and
targets) checks them here, so a
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


# √(largest float32): the engine forms each gradient's norm as the square
# root of a float32 sum of squares, so a norm above this is inf, and that
# example is dropped as non-finite. A bound above it can never clip anything
# more, and only scales the noise σ·C up towards float32 overflow (weights
# NaN/Inf after a step or two).
MAX_L2_NORM_CLIP = float(np.sqrt(np.finfo(np.float32).max))


def validate_l2_norm_clip(l2_norm_clip):
    """The clipping bound C: a finite number in (0, `MAX_L2_NORM_CLIP`].

    Args:
        l2_norm_clip: the value to check.

    Returns:
        C as a float.

    Raises:
        ValueError: for a C that is not a finite number, is <= 0, or is
            above `MAX_L2_NORM_CLIP` (about 1.8e19), whose square overflows
            float32.
    """
    if _number(l2_norm_clip, "l2_norm_clip") <= 0:
        raise ValueError(f"l2_norm_clip must be > 0. Received: l2_norm_clip={l2_norm_clip!r}")
    if l2_norm_clip > MAX_L2_NORM_CLIP:
        raise ValueError(
            f"l2_norm_clip must be at most {MAX_L2_NORM_CLIP:.3g}: gradient norms are "
            "formed from float32 squares, so a gradient whose norm is above that is "
            "already dropped as non-finite, and a larger C only makes the noise sigma*C "
            "overflow. For (nearly) no clipping use e.g. l2_norm_clip=1e9. "
            f"Received: l2_norm_clip={l2_norm_clip!r}")
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


def validate_hardened_noise(hardened_noise):
    """`hardened_noise` as a bool: True or False (a NumPy bool too), nothing else.

    A string such as "false" would read as true; it is refused instead.
    """
    if not isinstance(hardened_noise, (bool, np.bool_)):
        raise ValueError(
            f"hardened_noise must be True or False. Received: hardened_noise={hardened_noise!r}")
    return bool(hardened_noise)


DUPLICATES_POLICIES = ("refuse", "keep")


def validate_duplicates(duplicates):
    """What to do with exact copies in the training data: "refuse" or "keep".

    "keep" trains on rows that share their content as distinct records
    (`tfdp.data.duplicates`).
    """
    if duplicates not in DUPLICATES_POLICIES:
        raise ValueError(
            f"duplicates must be one of {DUPLICATES_POLICIES}: 'keep' trains on rows that "
            "share their content, as distinct records. Received: "
            f"duplicates={duplicates!r}")
    return duplicates


CLIPPING_RULES = ("standard", "automatic")
# Bu et al. 2023 ("Automatic clipping", AUTO-S): γ = 0.01 in every experiment.
DEFAULT_CLIPPING_GAMMA = 0.01


def validate_clipping(clipping):
    """How each unit's gradient is bounded: "standard" or "automatic".

    "standard" scales g by min(1, C/‖g‖); "automatic" by C/(‖g‖ + γ)
    (`tfdp.dp.clip_rule.clip_coefficients`). Both bound the contribution by C.
    """
    if clipping not in CLIPPING_RULES:
        raise ValueError(
            f"clipping must be one of {CLIPPING_RULES}. Received: clipping={clipping!r}")
    return clipping


def validate_clipping_gamma(clipping_gamma):
    """γ of automatic clipping: a finite number > 0 (it keeps ‖g‖ + γ away from 0)."""
    if not is_real(clipping_gamma) or not math.isfinite(clipping_gamma) or clipping_gamma <= 0:
        raise ValueError(
            "clipping_gamma must be a finite number > 0. "
            f"Received: clipping_gamma={clipping_gamma!r}")
    return float(clipping_gamma)


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


def _rows_where(bad, n):
    """The number of rows (first axis) with any bad element."""
    return int(np.count_nonzero(bad.reshape(n, -1).any(axis=1))) if n else 0


def validate_labels(labels, num_classes, name="labels"):
    """Class labels: whole numbers in [0, `num_classes`), checked before any step.

    A label of -1 would fail inside a training step after some updates were
    released (and TensorFlow's message would print the batch's labels); a
    label of `num_classes` would silently train an extra class on a one-hot
    or sparse loss. The message counts the bad rows and states the valid
    range; it never shows a label, since labels are private.

    Args:
        labels: array-like `[n]` or `[n, ...]` (e.g. `[n, 1]`): one label per
            element; integers, or floats holding whole numbers.
        num_classes: int >= 1. The number of classes (for a Keras model,
            the width of its output).
        name: str. The argument's name, for the message. Defaults to
            `"labels"`.

    Returns:
        The labels as an int64 `np.ndarray` of the same shape.

    Raises:
        ValueError: for a bad `num_classes`, no labels, or rows holding a
            label that is negative, at least `num_classes`, not whole, NaN,
            inf or not a number.
    """
    if not is_int(num_classes) or num_classes < 1:
        raise ValueError(
            f"num_classes must be an integer >= 1. Received: num_classes={num_classes!r}")
    values = np.asarray(labels)
    if values.ndim == 0 or values.shape[0] == 0:
        raise ValueError(
            f"`{name}` must hold one label per example, a non-empty array. Received: "
            f"{name} of shape {values.shape}")
    n = values.shape[0]
    if values.dtype.kind in "iub":
        ints = values.astype(np.int64)
        below, above, other = ints < 0, ints >= num_classes, np.zeros(values.shape, bool)
    elif values.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            whole = np.isfinite(values) & (np.floor(values) == values)
            below = whole & (values < 0)
            above = whole & (values >= num_classes)
        other = ~whole
        ints = np.where(whole & ~below & ~above, values, 0).astype(np.int64)
    else:  # Strings, objects, dates: not class indices.
        ints = None
        below = above = np.zeros(values.shape, bool)
        other = np.ones(values.shape, bool)
    bad = _rows_where(below | above | other, n)
    if bad:
        raise ValueError(
            f"`{name}` must be class indices, whole numbers in [0, num_classes={num_classes}): "
            f"{bad} of {n} rows are not ({_rows_where(below, n)} below 0, "
            f"{_rows_where(above, n)} at or above {num_classes}, {_rows_where(other, n)} not "
            "a whole finite number). Fix or drop those rows, or give the model as many "
            f"outputs as classes. Received: {name} with {bad} bad rows of {n} "
            f"(dtype {values.dtype})")
    return ints


def validate_targets(targets, row_shape=None, name="targets"):
    """Float targets (one-hot, soft labels, regression): finite, of the output's shape.

    A NaN or inf target makes that example's gradient non-finite, and a
    target of another shape than the model's output broadcasts silently in
    the loss. The message counts the bad rows; it never shows a value.

    Args:
        targets: array-like `[n, ...]`.
        row_shape: tuple or None. The shape of one example's target (the
            model's output without its batch axis), or None: not checked.
            A `[n]` target matches an output row of shape `(1,)`.
        name: str. The argument's name, for the message. Defaults to
            `"targets"`.

    Returns:
        The targets as an `np.ndarray`.

    Raises:
        ValueError: for no targets, another shape, or rows holding a value
            that is NaN, inf or not a number.
    """
    values = np.asarray(targets)
    if values.ndim == 0 or values.shape[0] == 0:
        raise ValueError(
            f"`{name}` must hold one target per example, a non-empty array. Received: "
            f"{name} of shape {values.shape}")
    n = values.shape[0]
    if row_shape is not None:
        row = tuple(values.shape[1:])
        expected = tuple(row_shape)
        if row != expected and not (row == () and expected == (1,)):
            raise ValueError(
                f"`{name}` must have one row per example of the model's output shape "
                f"{expected} (e.g. one-hot rows of one value per class). Received: {name} "
                f"of shape {values.shape}")
    if values.dtype.kind not in "iubf":
        raise ValueError(
            f"`{name}` must be numbers. Received: {name} of dtype {values.dtype}")
    if values.dtype.kind == "f":
        bad = _rows_where(~np.isfinite(values), n)
        if bad:
            raise ValueError(
                f"`{name}` must be finite: {bad} of {n} rows hold NaN or inf. Fix or drop "
                f"those rows. Received: {name} with {bad} non-finite rows of {n}")
    return values
