"""`PrivacyLedger`: the privacy state a training checkpoint carries."""

import json
import math

from tfdp import samplers
from tfdp import validation
from tfdp.privacy import accounting
from tfdp.privacy import banded_mf
from tfdp.privacy import calibration
from tfdp.privacy import noise_accounting

_FORMAT_VERSION = 1
_FIELDS = (
    "noise_multiplier",
    "sampling_rate",
    "steps",
    "sampler",
    "delta",
    "accountant",
    "dataset_size",
    "batch_size",
    "l2_norm_clip",
    "sensitivity",
    "bands",
    "band_coefficients",
    "noise_scheme",
)
# Left out of `to_dict` at these values, so that the ledgers of per-example
# clipping and of DP-SGD read and write exactly as ledgers that predate the
# fields.
_DEFAULTS = {"sensitivity": 1, "bands": 1, "band_coefficients": None}
# What a run fixes for its whole life; only `steps` moves.
CONFIGURATION_FIELDS = tuple(name for name in _FIELDS if name != "steps")


class PrivacyLedger:
    """Serialisable record of a DP-SGD run's privacy parameters and progress.

    The ledger holds what is needed to recompute epsilon at any time: the
    noise multiplier, how batches are sampled, delta, the accountant, and
    the number of optimizer steps taken so far. It is plain data (no
    TensorFlow), and `to_json` / `from_json` round-trip it exactly, so a
    trainer can store it beside every checkpoint and resume counting.

    Example:

    ```python
    ledger = PrivacyLedger(
        1.3127, dataset_size=1281167, batch_size=65536, delta=1e-6
    )
    while ledger.epsilon_after(ledger.steps + 1) <= 10.0:
        train_step()
        ledger.record_step()
    ```

    With `accountant="pld"` each new step count costs a PLD composition
    (up to seconds); for per-step budget checks call `max_steps_within`
    once and compare `steps` to it. RDP queries are cheap.

    Args:
        noise_multiplier: float. Noise std over the clipping norm on the
            logical batch, `>= 0`.
        sampling_rate: float or None. Poisson rate `q` in `(0, 1]`; derived
            as `batch_size / dataset_size` when `None`. Defaults to `None`.
        delta: float. Target delta in `(0, 1)`. Required, keyword-only.
        steps: int. Optimizer steps already taken. Defaults to `0`.
        sampler: str. `"poisson"` or `"shuffle"` (fixed-size batches; see
            `tfdp.privacy.epsilon`). Defaults to `"poisson"`.
        accountant: str. `"rdp"` or `"pld"`. Defaults to `"rdp"`.
        dataset_size: int or None. `N`. Defaults to `None`.
        batch_size: int or None. `B`. Defaults to `None`.
        l2_norm_clip: float or None. The clipping bound C, recorded so that
            a resumed run can check that it clips as the run it continues.
            Defaults to `None`.
        sensitivity: float. How far one privacy unit can move the clipped
            sum that one Gaussian mechanism of the sampler releases, under
            the sampler's relation, in units of C: 1 where each unit is
            clipped alone; 2 where several examples are clipped together
            (TF-Privacy's microbatches: one example moves its microbatch's
            clipped mean from one vector of norm <= C to another). Epsilon
            is that of the effective noise multiplier
            `noise_multiplier / sensitivity`. Defaults to `1`.
        bands: int. b >= 1, the bands of a banded matrix-factorization
            strategy (`tfdp.privacy.banded_mf`); b > 1 needs a sampler whose
            steps of one unit are b apart ("banded_poisson",
            "banded_user_poisson"), and is
            accounted as that sampler's ⌈T/b⌉ rounds. Defaults to `1`
            (DP-SGD).
        band_coefficients: sequence of floats or None. The strategy's
            coefficients c_0 … c_{b-1} (column norm <= 1), recorded so that
            a resumed run continues the same noise correlation; None where
            not recorded, and at b = 1. Defaults to `None`.
        noise_scheme: str or None. The noise scheme of the run
            (`tfdp.DPSGDConfig.noise_scheme`), accounted by its entry in
            `tfdp.privacy.noise_accounting`; recorded so that a run resumes
            only under the same noise. None: "banded" at b > 1, else
            "gaussian" (written out only when it is neither). Defaults to
            `None`.
    """

    def __init__(
        self,
        noise_multiplier,
        sampling_rate=None,
        *,
        delta,
        steps=0,
        sampler="poisson",
        accountant="rdp",
        dataset_size=None,
        batch_size=None,
        l2_norm_clip=None,
        sensitivity=1,
        bands=1,
        band_coefficients=None,
        noise_scheme=None,
    ):
        if (isinstance(sensitivity, bool) or not isinstance(sensitivity, (int, float))
                or not 1 <= sensitivity <= 2):
            # Clipped vectors have norm <= C, so no unit moves one by more than 2C.
            raise ValueError(
                "sensitivity must be a number in [1, 2] (units of the clipping bound C). "
                f"Received: sensitivity={sensitivity!r}"
            )
        self._sensitivity = sensitivity
        self._bands = banded_mf.validate_bands(bands)
        self._band_coefficients = self._check_band_coefficients(band_coefficients, self._bands)
        self._noise_scheme = noise_accounting.validate_noise_scheme(noise_scheme, self._bands)
        if not noise_accounting.accounting_for(self._noise_scheme).by_sampler:
            # The query below composes the sampler's event.
            raise ValueError(
                "PrivacyLedger accounts the noise schemes accounted by their sampler's "
                f"event. Received: noise_scheme={self._noise_scheme!r}")
        self._noise_multiplier = validation.validate_noise_multiplier(noise_multiplier)
        self._query = accounting.PrivacyQuery(
            self._noise_multiplier / sensitivity, steps, delta, sampling_rate=sampling_rate,
            dataset_size=dataset_size, batch_size=batch_size, accountant=accountant,
            sampler=self._banded_sampler(sampler, sampling_rate, dataset_size, batch_size),
            stacklevel=3,
        )
        self._sampling_rate = self._query.sampling_rate
        self._delta = self._query.delta
        self._sampler = sampler
        self._accountant = accountant
        self._dataset_size = self._query.dataset_size
        self._batch_size = self._query.batch_size
        self._l2_norm_clip = (None if l2_norm_clip is None
                              else validation.validate_l2_norm_clip(l2_norm_clip))
        self._steps = self._query.steps

    @staticmethod
    def _check_band_coefficients(coefficients, bands):
        if coefficients is None:
            return None
        coefficients = banded_mf.check_coefficients(coefficients, bands)
        # At b = 1 the only strategy of norm 1 is DP-SGD's: recorded as none.
        return None if bands == 1 and coefficients == (1.0,) else coefficients

    def _banded_sampler(self, sampler, sampling_rate, dataset_size, batch_size):
        """The sampler to account: `sampler` itself at b = 1, else its b-band version."""
        if self._bands == 1:
            return sampler
        accounting.validate_sampler(sampler)
        if isinstance(sampler, samplers.Sampler):
            accounted = sampler
        elif samplers.sampler_class(sampler).takes_bands:
            q, n, b = accounting.resolve_sampling_rate(sampling_rate, dataset_size, batch_size)
            accounted = samplers.for_accounting(sampler, q, n, b, bands=self._bands)
        else:
            accounted = None
        if accounted is None or accounted.bands != self._bands:
            raise ValueError(
                f"bands={self._bands} needs a sampler that keeps each unit's steps "
                "`bands` apart (sampler='banded_poisson' or 'banded_user_poisson'). "
                f"Received: sampler={sampler!r}, bands={self._bands}"
            )
        return accounted

    # The parameters are fixed for a ledger's life (changing them would make
    # the accumulated steps mean something else); only `steps` moves.
    noise_multiplier = property(lambda self: self._noise_multiplier)
    sampling_rate = property(lambda self: self._sampling_rate)
    delta = property(lambda self: self._delta)
    sampler = property(lambda self: self._sampler)
    accountant = property(lambda self: self._accountant)
    dataset_size = property(lambda self: self._dataset_size)
    batch_size = property(lambda self: self._batch_size)
    l2_norm_clip = property(lambda self: self._l2_norm_clip)
    steps = property(lambda self: self._steps)
    sensitivity = property(lambda self: self._sensitivity)
    bands = property(lambda self: self._bands)
    band_coefficients = property(lambda self: self._band_coefficients)
    noise_scheme = property(lambda self: self._noise_scheme)

    @property
    def effective_noise_multiplier(self):
        """The noise std over the sensitivity: `noise_multiplier / sensitivity`, what is accounted."""
        return self._query.noise_multiplier

    def record_step(self, n=1):
        """Records `n` more optimizer steps and returns the new total.

        Args:
            n: int. Number of steps taken, `>= 0`. Defaults to `1`.

        Returns:
            The total number of steps, an int.
        """
        n = accounting.validate_steps(n, name="n")
        self._steps += n
        return self._steps

    def _epsilon(self, steps, noise_multiplier=None):
        # `noise_multiplier` is an effective one (over the sensitivity).
        return self._query.epsilon(steps=steps, noise_multiplier=noise_multiplier)

    def epsilon(self):
        """Returns epsilon after the steps recorded so far."""
        return self._epsilon(self._steps)

    def epsilon_after(self, steps):
        """Returns epsilon if `steps` steps in total had been taken.

        Call with `ledger.steps + 1` before a step to stop before it would
        overspend a budget.

        Args:
            steps: int. Total number of steps, `>= 0`.

        Returns:
            Epsilon, a float.
        """
        return self._epsilon(accounting.validate_steps(steps))

    # ------------------------------------------------------------------
    # The neighbouring relation the epsilon holds for (the sampler's).
    # ------------------------------------------------------------------

    @property
    def adjacency(self):
        """The name of the neighbouring relation `epsilon()` holds for.

        The sampler's (`tfdp.samplers.Sampler.adjacency`): "add_or_remove_one"
        for Poisson, "zero_out" for shuffled or fixed-order batches.
        """
        return samplers.sampler_class(self._sampler).adjacency

    @property
    def adjacency_description(self):
        """The neighbouring relation of `adjacency`, in words."""
        return samplers.sampler_class(self._sampler).adjacency_description

    @property
    def privacy_unit(self):
        """What `epsilon()` protects: "example", or "user" (all of one user's data).

        The sampler's (`tfdp.samplers.Sampler.privacy_unit`); with "user",
        `dataset_size` and `batch_size` count users.
        """
        return samplers.sampler_class(self._sampler).privacy_unit

    def epsilon_replace_one(self, steps=None):
        """Epsilon under replace-one adjacency, or None where not reported.

        Reported for the samplers whose bound holds for a weaker relation
        than add/remove-one (`Sampler.replace_one_sensitivity`; shuffled and
        fixed-order batches): replacing one example moves a pass's sum by
        2C, so this is the epsilon of the same run with σ / 2. With a
        `sensitivity` of 2 (microbatches) that is also the zero-out figure:
        either change moves one clipped vector of norm <= C to another.

        Args:
            steps: int or None. Total steps. Defaults to the steps recorded.

        Returns:
            A float, or None.
        """
        factor = samplers.sampler_class(self._sampler).replace_one_sensitivity
        if factor is None:
            return None
        steps = self._steps if steps is None else accounting.validate_steps(steps)
        return self._epsilon(steps, self._noise_multiplier / max(factor, self._sensitivity))

    def describe_epsilon(self, epsilon=None, steps=None, brief=False):
        """One line: epsilon, delta and the relation (and replace-one epsilon).

        E.g. `epsilon=19.05 at delta=1e-05 (zero_out adjacency: ...;
        replace-one epsilon=48.80)`. Every printed epsilon of a run uses it.

        Args:
            epsilon: float or None. An epsilon already computed for `steps`.
            steps: int or None. Total steps. Defaults to the steps recorded.
            brief: bool. Name the relation without its description, for
                lines that repeat (a run states the description once).
                Defaults to False.

        Returns:
            A str.
        """
        steps = self._steps if steps is None else steps
        if epsilon is None:
            epsilon = self._epsilon(accounting.validate_steps(steps))
        text = (f"epsilon={accounting.format_epsilon(epsilon)} at delta={self._delta:g} "
                f"({self.adjacency} adjacency"
                + ("" if brief else f": {self.adjacency_description}"))
        if self._sensitivity != 1:
            text += (f"; sensitivity {self._sensitivity:g}C, so noise multiplier "
                     f"{self._noise_multiplier:g} counts as {self.effective_noise_multiplier:g}")
        replace_one = self.epsilon_replace_one(steps)
        if replace_one is not None:
            text += f"; replace-one epsilon={accounting.format_epsilon(replace_one)}"
        return text + ")"

    def max_steps_within(self, target_epsilon):
        """Returns the largest total step count with epsilon `<= target`.

        Args:
            target_epsilon: float. Privacy budget, `>= 0`.

        Returns:
            The number of steps (in total, not remaining), an int.
        """
        return calibration.max_steps_for_query(target_epsilon, self._query)

    def differences(self, other):
        """The fixed parameters (all but `steps`) on which two ledgers differ.

        Args:
            other: `PrivacyLedger`.

        Returns:
            A dict `{name: (self's value, other's value)}`; empty when a run
            with `other`'s configuration may continue this ledger.
        """
        return {
            name: (getattr(self, name), getattr(other, name))
            for name in CONFIGURATION_FIELDS + ("privacy_unit",)
            if getattr(self, name) != getattr(other, name)
        }

    def to_dict(self):
        """Returns the ledger as a dict of JSON-compatible values."""
        out = {"version": _FORMAT_VERSION}
        out.update({name: getattr(self, name) for name in _FIELDS
                    if name not in _DEFAULTS or getattr(self, name) != _DEFAULTS[name]})
        if self._noise_scheme == noise_accounting.validate_noise_scheme(None, self._bands):
            del out["noise_scheme"]  # The default of its bands: as ledgers without the field.
        if "band_coefficients" in out:
            out["band_coefficients"] = list(out["band_coefficients"])
        return out

    @classmethod
    def from_dict(cls, config):
        """Rebuilds a ledger from `to_dict()` output, validating it.

        Args:
            config: dict. As returned by `to_dict`.

        Returns:
            A `PrivacyLedger`.
        """
        if not isinstance(config, dict):
            raise ValueError(
                "Ledger config must be a dict. "
                f"Received: config={type(config).__name__}"
            )
        config = dict(config)
        version = config.pop("version", _FORMAT_VERSION)
        if version != _FORMAT_VERSION:
            raise ValueError(
                f"Unsupported ledger version (expected {_FORMAT_VERSION}). "
                f"Received: version={version!r}"
            )
        unknown = sorted(set(config) - set(_FIELDS))
        missing = sorted(
            {"noise_multiplier", "delta", "steps"} - set(config)
        )
        if unknown or missing:
            raise ValueError(
                "Ledger config has unknown or missing keys. "
                f"Received: unknown={unknown}, missing={missing}"
            )
        noise_multiplier = config.pop("noise_multiplier")
        sampling_rate = config.pop("sampling_rate", None)
        return cls(noise_multiplier, sampling_rate, **config)

    def to_json(self):
        """Returns the ledger as a JSON string (exact float round-trip)."""
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, text):
        """Rebuilds a ledger from `to_json()` output.

        Args:
            text: str or bytes. The JSON text.

        Returns:
            A `PrivacyLedger`.
        """
        try:
            config = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(
                f"Ledger JSON could not be parsed ({e}). "
                f"Received: text={text!r:.80}"
            ) from None
        return cls.from_dict(config)

    def __eq__(self, other):
        if not isinstance(other, PrivacyLedger):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    # Mutable (steps advance), so not hashable.
    __hash__ = None

    def __repr__(self):
        shown = self.to_dict()
        args = ", ".join(
            f"{name}={getattr(self, name)!r}"
            for name in _FIELDS
            if name in shown and getattr(self, name) is not None
        )
        return f"PrivacyLedger({args})"

    def __str__(self):
        eps = self.epsilon()
        shown = "inf" if math.isinf(eps) else f"{eps:.4f}"
        return (
            f"PrivacyLedger(steps={self._steps}, epsilon={shown} at "
            f"delta={self._delta:g}, sigma={self._noise_multiplier:g}, "
            + ("" if self._sensitivity == 1 else f"sensitivity={self._sensitivity:g}C, ")
            + f"q={self._sampling_rate:.6g}, {self._sampler}, "
            + ("" if self._bands == 1 else f"bands={self._bands}, ")
            + f"{self._accountant}, {self.adjacency} adjacency)"
        )
