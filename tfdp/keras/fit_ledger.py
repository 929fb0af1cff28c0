"""The privacy ledger of a private Keras `fit`: what it drew, accounted.

The mechanism that accounts a `fit` is the one that drew its batches: the
route's sampler with its N and B, at the bound σ (perhaps calibrated), also
where the noise was divided by another public divisor, at the optimizer's
`sensitivity`. For a streamed input the steps are at least one whole pass per
epoch that released a step (`PrivacyAccount.accounted_steps`).
"""

from tfdp import engine as engine_lib
from tfdp import privacy
from tfdp import samplers
from tfdp.privacy import deltas as privacy_deltas


def accounting_mechanism(builder, dataset_size=None, delta=None):
    """The `tfdp.DPSGD` to account, with N or δ overridden if asked.

    Args:
        builder: `tfdp.keras.mechanism_builder.MechanismBuilder`. The
            optimizer's request and the route of its last `fit`.
        dataset_size: int or None. Overrides N (privacy units).
        delta: float or None. Overrides δ.

    Returns:
        A `tfdp.DPSGD` with a sampler.

    Raises:
        ValueError: before the logical batch size or N is known.
    """
    mech = builder.current
    if mech is None:
        raise ValueError(
            "The privacy ledger needs the logical batch size; pass "
            "`expected_batch_size=` to the DPOptimizer, or "
            "`batch_size=` to `fit`, or a dataset with a static batch size."
        )
    if mech.sampler is not None and not dataset_size and not delta:
        return mech
    # A mechanism without a sampler (a stream, or a divisor other than B):
    # the route's sampler drew the batches, if there is one.
    sampler = mech.sampler or (builder.fit_route.sampler if builder.fit_route else None)
    n = dataset_size or (sampler.dataset_size if sampler else builder.dataset_size)
    if not n:
        raise ValueError(
            "The privacy ledger needs the dataset size N. Pass "
            "`dataset_size=` to the DPOptimizer or the callback (it is "
            "only inferred when `fit` is given arrays)."
        )
    n = int(n)
    if sampler is not None:
        name, batch = sampler.name, sampler.logical_batch_size
    else:
        name = builder.fit_route.sampler_name
        batch = (builder.planned_batch_size if builder.planned_batch_size is not None
                 else int(round(mech.expected_batch_size)))
    delta = delta or builder.delta or privacy_deltas.default_delta(n)
    # The bound σ (perhaps calibrated) on the accounted sampler, with the
    # contract's budget (`budget_steps`).
    request = mech.config.replace(noise_multiplier=mech.noise_multiplier,
                                  target_epsilon=mech.target_epsilon, delta=delta)
    return engine_lib.make_engine(
        request, sampler=samplers.for_accounting(
            name, None, dataset_size=n, batch_size=min(batch, n),
            **({"bands": mech.bands} if samplers.sampler_class(name).takes_bands else {})),
        key=mech.secret_key,
    ).mechanism


def ledger(optimizer, *, dataset_size=None, delta=None, steps=None):
    """The `tfdp.privacy.PrivacyLedger` of a `DPOptimizer`'s run so far.

    Args:
        optimizer: `tfdp.DPOptimizer`.
        dataset_size: int or None. Overrides N (privacy units).
        delta: float or None. Overrides δ.
        steps: int or None. Defaults to the accounted steps (the noisy
            updates; see `DPOptimizer.accounted_steps`).

    Returns:
        A `PrivacyLedger` whose `epsilon()` is ε after `steps`, for the
        neighbouring relation of its sampler (`ledger.privacy_unit` says what
        it protects), at the optimizer's `sensitivity`.
    """
    mech = accounting_mechanism(optimizer.mechanism_builder, dataset_size, delta)
    if steps is None:
        steps = optimizer.accounted_steps(mech.sampler.steps_per_epoch)
    return mech.ledger(steps, sensitivity=optimizer.sensitivity)


def target_epsilon(optimizer):
    """The target ε of the optimizer's contract (the mechanism's), or None."""
    mech = optimizer.mechanism_builder.current
    return None if mech is None else mech.target_epsilon


def budget_steps(optimizer, planned_steps):
    """The accounted steps a `fit` may reach under the contract's target ε.

    `tfdp.DPSGD.budget_steps` of the mechanism that accounts the fit (the
    route's sampler, N and B, at the optimizer's `sensitivity`): for Poisson
    steps, shuffled passes, or a stream's passes (whose accounted steps are
    whole passes, `PrivacyAccount.accounted_steps`).

    Args:
        optimizer: `tfdp.DPOptimizer`, after `route_fit`.
        planned_steps: int. The accounted steps the fit would reach, in all.

    Returns:
        An int, or None without a target ε.

    Raises:
        ValueError: without the dataset size N (a stream), which the budget
            needs.
    """
    if target_epsilon(optimizer) is None:
        return None
    mech = accounting_mechanism(optimizer.mechanism_builder)
    return mech.budget_steps(int(planned_steps), sensitivity=optimizer.sensitivity)


def describe_epsilon(ledger, max_examples_per_user=None, *, epsilon=None, brief=False):
    """One line: ε, δ, the neighbouring relation and, for users, the unit's bounds.

    Args:
        ledger: `tfdp.privacy.PrivacyLedger`.
        max_examples_per_user: int or None. k, under users.
        epsilon: float or None. ε already computed for the ledger's steps.
        brief: bool. Name the relation without its description.

    Returns:
        A str, e.g. `epsilon=2.01 at delta=1e-05 (add_or_remove_one_user
        adjacency: ...); privacy unit: user (N=500 users, at most 4 examples
        of a user per step); for comparison, example-level accounting with
        group privacy for 4 examples would claim epsilon=... at delta=...`
        (the comparison not when `brief`, nor for a banded run, for which
        group privacy is not established).
    """
    text = ledger.describe_epsilon(epsilon, brief=brief)
    unit = ledger.privacy_unit
    if unit == "example":
        return text
    text = (f"{text}; privacy unit: {unit} (N={ledger.dataset_size} {unit}s, at most "
            f"{max_examples_per_user} examples of a {unit} per step)")
    if brief or ledger.bands > 1:
        return text
    claim = privacy.example_level_claim(ledger, max_examples_per_user)
    return f"{text}; for comparison, {privacy.describe_example_level_claim(claim)}"


def example_level_claim(optimizer, *, dataset_size=None, delta=None, steps=None):
    """Under users: what example-level accounting would claim for a user.

    Example-level DP-SGD at the same σ, steps and sampling rate, at the
    ledger's δ, converted by group privacy for `max_examples_per_user`
    examples (`tfdp.privacy.example_level_claim`): the figure a user-level
    run improves on.

    Args:
        optimizer: `tfdp.DPOptimizer` of a user-level run.
        dataset_size, delta, steps: as `ledger`.

    Returns:
        The dict of `tfdp.privacy.example_level_claim`.

    Raises:
        ValueError: under `privacy_unit="example"`, or with `bands` > 1
            (no group-privacy comparison holds for banded runs).
    """
    if optimizer.privacy_unit != "user":
        raise ValueError(
            "example_level_claim compares a user-level run with example-level "
            f"accounting. Received: privacy_unit={optimizer.privacy_unit!r}")
    run_ledger = ledger(optimizer, dataset_size=dataset_size, delta=delta, steps=steps)
    return privacy.example_level_claim(run_ledger, optimizer.max_examples_per_user)
