"""`weak_amplification_warning`: one line when sampling amplifies privacy little.

Privacy amplification by sampling is what makes DP-SGD's ε small: each
step sees a privacy unit (an example, or a user) with probability q only.
Once q is above one half, most steps see every unit and the amplification
is weak: ε approaches that of the Gaussian mechanism applied at every step.
Every route (the trainer, Keras `fit`) asks this one function and prints
its line once per run.

Pure Python: no TensorFlow, no accounting (the caller passes the run's ε).
"""

import numbers

# Above this q most steps hold each unit and amplification by sampling is weak.
WEAK_AMPLIFICATION_RATE = 0.5


def weak_amplification_warning(sampler_or_rate, unit="example", *, epsilon=None,
                               delta=None, max_examples_per_user=None):
    """A warning when the sampling probability q is above one half, else None.

    Args:
        sampler_or_rate: a `tfdp.samplers.Sampler` or a float. The sampler
            of the run (its `sampling_rate`, for samplers that amplify; one
            that does not, such as "shuffle", gets no warning), or q itself.
        unit: str. The privacy unit, "example" or "user" (a sampler's own
            `privacy_unit` wins). Defaults to "example".
        epsilon: float or None. The ε the run gets, to quote. Defaults to
            None (not quoted).
        delta: float or None. Its δ. Defaults to None.
        max_examples_per_user: int or None. k under `unit="user"`: where the
            batch size counts rows, a larger k draws fewer users per step.
            Defaults to the sampler's, else None.

    Returns:
        A one-line message (str), or None when q is at most one half.

    Raises:
        ValueError: for a q outside [0, 1] or an unknown unit.
    """
    if isinstance(sampler_or_rate, numbers.Real) and not isinstance(sampler_or_rate, bool):
        rate = float(sampler_or_rate)
    else:
        sampler = sampler_or_rate
        if not getattr(sampler, "amplified", False):
            return None
        rate = sampler.sampling_rate
        unit = sampler.privacy_unit
        if max_examples_per_user is None:
            max_examples_per_user = getattr(sampler, "max_examples_per_user", None)
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"The sampling probability q must be in [0, 1]. Received: q={rate}")
    if unit not in ("example", "user"):
        raise ValueError(f"The privacy unit must be 'example' or 'user'. Received: unit={unit!r}")
    if rate <= WEAK_AMPLIFICATION_RATE:
        return None
    units = "users" if unit == "user" else "examples"
    message = (f"Weak privacy amplification: each step samples every {unit} with "
               f"probability q={rate:.3g} (> {WEAK_AMPLIFICATION_RATE}), so most steps see "
               f"most {units}")
    if epsilon is not None:
        message += f"; this run gets epsilon={epsilon:.3g}"
        if delta is not None:
            message += f" at delta={delta:.3g}"
    fixes = [f"more {units} (a larger dataset)", "a smaller batch size"]
    if unit == "user":
        k = f" (now {max_examples_per_user})" if max_examples_per_user else ""
        fixes.append(f"a larger max_examples_per_user{k}, so that a batch holds fewer users")
    return message + ". For a smaller epsilon, use " + ", ".join(fixes[:-1]) + \
        f" or {fixes[-1]}."
