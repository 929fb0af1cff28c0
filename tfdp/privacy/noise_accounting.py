"""How each noise scheme is accounted: its DP event over the run's sampler.

A noise scheme (`tfdp.dp.noise_schemes`) draws the noise of a logical step
with TensorFlow; how its releases compose into (ε, δ) is written here, once,
without TensorFlow, so that the privacy ledger (`tfdp.privacy.PrivacyLedger`),
a request's validation (`tfdp.DPSGDConfig.noise_scheme`) and the privacy
command line read it as the engine does. `NoiseScheme.dp_event` asks this
module, and `tfdp.dp.noise_schemes.register` refuses a scheme with no entry
here, so the noise a run draws and the ε it prints cannot come from two
places.

- "gaussian" (DP-SGD) and "banded" (banded matrix factorization) are
  accounted by the sampler's own event (`tfdp.samplers.Sampler.dp_event`):
  DP-SGD directly, banded noise over a sampler whose units' steps are at
  least b apart, which accounts its ⌈T/b⌉ rounds.
- "tree" (DP-FTRL's tree aggregation) by `tfdp.privacy.tree_aggregation`'s
  event over the shuffle sampler's passes. It needs its restarts, which no
  request of `tfdp.DPSGDConfig` carries: its route is TF-Privacy's DP-FTRL
  (`tfdp.compat.tensorflow_privacy`), with its own ledger.

Adding a scheme is one `register(SchemeAccounting(...))` here, beside its
noise module.

Imports no TensorFlow.
"""

import dataclasses

from tfdp.privacy import tree_aggregation


@dataclasses.dataclass(frozen=True)
class SchemeAccounting:
    """The accounting of one noise scheme.

    Args:
        name: str. The scheme's registered name (`NoiseScheme.name`).
        description: str. One line for logs and errors.
        by_sampler: bool. Whether the run is accounted by the sampler's own
            event (the scheme's releases compose as DP-SGD's over it).
        selectable: bool. Whether a `tfdp.DPSGDConfig` may name the scheme
            (`noise_scheme=`); False for a scheme whose options no request
            carries. Defaults to True.
        takes_bands: bool. Whether the scheme is a b-banded strategy
            (b > 1, over a sampler whose units' steps are b apart); the
            others need b = 1. Defaults to False.
        event: callable or None. `event(sampler, noise_multiplier, steps,
            **options)` -> `DpEvent`, for a scheme not accounted by the
            sampler. Defaults to None.
    """

    name: str
    description: str
    by_sampler: bool
    selectable: bool = True
    takes_bands: bool = False
    event: object = None

    def check_sampler(self, sampler, bands=1):
        """Refuses a sampler that does not keep the units' steps `bands` apart.

        Args:
            sampler: `tfdp.samplers.Sampler`.
            bands: int. The strategy's b (1 but for banded noise).

        Raises:
            ValueError: naming the sampler and the bands.
        """
        if sampler.bands < bands:
            raise ValueError(
                f"A {bands}-banded strategy is accounted over a sampler whose units' steps "
                f"are at least {bands} apart (e.g. 'banded_poisson'). Received: "
                f"sampler={sampler.name!r} with bands={sampler.bands}")

    def dp_event(self, sampler, noise_multiplier, steps, *, bands=1, **options):
        """The `DpEvent` of `steps` logical steps of this scheme drawn by `sampler`.

        Args:
            sampler: `tfdp.samplers.Sampler`. How the steps were drawn.
            noise_multiplier: float. σ.
            steps: int. Logical steps released.
            bands: int. The strategy's b (banded noise). Defaults to 1.
            **options: the scheme's own accounting options (tree: its
                `restarts` and `leaves_per_step`).

        Returns:
            A `dp_accounting.DpEvent`.
        """
        if self.by_sampler:
            self.check_sampler(sampler, bands)
            return sampler.dp_event(noise_multiplier, steps)
        return self.event(sampler, noise_multiplier, steps, **options)


_REGISTRY = {}


def register(accounting):
    """Makes `accounting` (a `SchemeAccounting`) the accounting of its scheme.

    Args:
        accounting: `SchemeAccounting`.

    Returns:
        `accounting`.

    Raises:
        ValueError: for another object, or a name already registered.
    """
    if not isinstance(accounting, SchemeAccounting):
        raise ValueError(
            f"Only a SchemeAccounting can be registered. Received: {accounting!r}")
    if not accounting.name or accounting.name in _REGISTRY:
        raise ValueError(
            "A noise scheme's accounting needs a new, unique name. Received: "
            f"name={accounting.name!r}")
    if not accounting.by_sampler and accounting.event is None:
        raise ValueError(
            "A scheme not accounted by its sampler needs its event. Received: "
            f"name={accounting.name!r}, event=None")
    _REGISTRY[accounting.name] = accounting
    return accounting


def names():
    """The noise schemes with an accounting."""
    return tuple(_REGISTRY)


def accounting_for(name):
    """The `SchemeAccounting` of `name`, or a clear error for an unknown one."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown noise scheme. Expected one of {names()}. Received: noise_scheme={name!r}"
        ) from None


def validate_noise_scheme(name, bands=1):
    """The scheme a request names, checked against its bands.

    Args:
        name: str or None. A selectable scheme's name; None: "banded" at
            b > 1, else "gaussian".
        bands: int. The request's b.

    Returns:
        str: the scheme's name.

    Raises:
        ValueError: for an unknown or unselectable scheme, or one whose
            bands disagree (banded noise needs b > 1, the others b = 1).
    """
    if name is None:
        return "banded" if bands > 1 else "gaussian"
    accounting = accounting_for(name)
    if not accounting.selectable:
        selectable = tuple(n for n in names() if _REGISTRY[n].selectable)
        raise ValueError(
            f"The {name!r} noise scheme ({accounting.description}) cannot be asked for "
            f"here; one of {selectable} can. Received: noise_scheme={name!r}")
    if accounting.takes_bands != (bands > 1):
        raise ValueError(
            f"noise_scheme={name!r} " + ("needs bands > 1" if accounting.takes_bands
                                          else "takes no bands") +
            f". Received: noise_scheme={name!r}, bands={bands}")
    return name


def dp_event(name, sampler, noise_multiplier, steps, **options):
    """`accounting_for(name).dp_event(sampler, noise_multiplier, steps, **options)`."""
    return accounting_for(name).dp_event(sampler, noise_multiplier, steps, **options)


def _tree_event(sampler, noise_multiplier, steps, *, restarts, leaves_per_step=1):
    """`tree_dp_event` of `steps` steps of k leaves over `sampler`'s N // B batches.

    As `TreeAggregationLedger.dp_event` (zero-out adjacency): the restarts
    and a pass count leaves.
    """
    k = leaves_per_step
    steps_per_epoch = sampler.dataset_size // sampler.logical_batch_size
    return tree_aggregation.tree_dp_event(
        noise_multiplier, int(steps) * k, steps_per_epoch * k, restarts)


register(SchemeAccounting(
    "gaussian", "DP-SGD's independent Gaussian noise each step", by_sampler=True))
register(SchemeAccounting(
    "banded", "banded matrix factorization, noise correlated over b steps", by_sampler=True,
    takes_bands=True))
register(SchemeAccounting(
    "tree", "DP-FTRL's tree aggregation; TF-Privacy's DP-FTRL optimizers "
    "(tfdp.compat.tensorflow_privacy) run it", by_sampler=False, selectable=False,
    event=_tree_event))
