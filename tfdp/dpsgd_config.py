"""`DPSGDConfig`: what a user asks of DP-SGD, validated once where it is given."""

import dataclasses

from tfdp import samplers
from tfdp import validation
from tfdp.privacy import accounting
from tfdp.privacy import banded_mf
from tfdp.privacy import deltas
from tfdp.privacy import noise_accounting


def privacy_units():
    """The privacy units of the registered samplers, e.g. `("example", "user")`."""
    return tuple(sorted({samplers.sampler_class(name).privacy_unit
                         for name in samplers.names()}))


@dataclasses.dataclass(frozen=True)
class DPSGDConfig:
    """The privacy request of a DP-SGD run, before a route binds it.

    It holds what the user decides (C, σ or a target ε, δ, the sampler
    kind, the privacy unit, the accountant), each checked here by its rule in
    `tfdp.validation`, once. What only a route knows (its sampler, planned
    steps, secret key and divisor) binds it into the run's contract:
    `tfdp.DPSGD.from_config(config, sampler=..., steps=..., secret_key=...)`.
    Every route inside tfdp (the trainer, Keras `fit`, the TensorFlow Privacy
    compat layer, the audit, the bench) gets its `DPSGD` that way, so C, σ and
    δ are validated and read in one place.

    Args:
        l2_norm_clip: float. C > 0, the per-example clipping bound.
        noise_multiplier: float or None. σ >= 0. If None, σ is calibrated
            from `target_epsilon` when the route binds the steps and sampler.
            Defaults to None.
        target_epsilon: float or None. A budget: calibrates σ when σ is
            None, and stops training before it would be exceeded. Defaults
            to None.
        delta: float or None. δ of the guarantee, in (0, 1); None:
            `tfdp.privacy.default_delta(N)` once the route knows N. Defaults
            to None.
        accountant: str. "rdp" or "pld". Defaults to "rdp".
        sampler: str or None. A registered sampler name; None: the route's
            default. Defaults to None.
        privacy_unit: str. What ε protects: "example" or "user". Defaults to
            "example".
        max_examples_per_user: int or None. k, under `privacy_unit="user"`:
            the most examples of one user in a logical step. Defaults to None.
        bands: int. b >= 1: banded matrix-factorization DP-SGD with a
            b-banded strategy (`tfdp.privacy.banded_mf`), which needs a
            sampler whose steps of one privacy unit are b apart
            ("banded_poisson" for examples, "banded_user_poisson" for
            users). Defaults to 1 (DP-SGD).
        band_coefficients: sequence of b floats or None. The strategy's
            coefficients c_0 … c_{b-1}: c_0 > 0 and Euclidean norm <= 1
            (`banded_mf.normalize_coefficients` scales them). None: the
            banded square root (`banded_mf.square_root_coefficients`).
            Defaults to None.
        hardened_noise: bool. Draw the noise against floating-point attacks
            (`tfdp.dp.noise`): float64, the sum of two draws, added to the
            sum in float64 on a public grid and rounded once. The same
            std σC, the same ε, at several times the noise draw's time per
            logical step (docs/PRIVACY.md, "Floating-point noise").
            Defaults to False.
        clipping: str. How each unit's gradient g is bounded: "standard",
            min(1, C/‖g‖)·g; or "automatic" (Bu et al. 2023, AUTO-S),
            C·g/(‖g‖ + γ), of norm below C, so the same sensitivity and ε,
            and C only scales the update. Defaults to "standard".
        clipping_gamma: float. γ > 0 of automatic clipping. Defaults to
            0.01, the paper's.
        noise_scheme: str or None. The noise a logical step releases: a
            noise scheme registered in `tfdp.dp.noise_schemes` with its
            accounting in `tfdp.privacy.noise_accounting`, e.g. "gaussian"
            (DP-SGD) or "banded" (needs bands > 1). None: "banded" at
            bands > 1, else "gaussian". Defaults to None.

    Example:

    ```python
    config = tfdp.DPSGDConfig(l2_norm_clip=1.0, target_epsilon=3.0, delta=1e-5)
    mechanism = tfdp.DPSGD.from_config(config, sampler=sampler, steps=1000)
    ```
    """

    l2_norm_clip: float
    noise_multiplier: object = None
    target_epsilon: object = None
    delta: object = None
    accountant: str = "rdp"
    sampler: object = None
    privacy_unit: str = "example"
    max_examples_per_user: object = None
    bands: int = 1
    band_coefficients: object = None
    hardened_noise: bool = False
    clipping: str = "standard"
    clipping_gamma: float = validation.DEFAULT_CLIPPING_GAMMA
    noise_scheme: object = None

    def __post_init__(self):
        def set_field(name, value):  # The dataclass is frozen.
            object.__setattr__(self, name, value)

        set_field("l2_norm_clip", validation.validate_l2_norm_clip(self.l2_norm_clip))
        if self.delta is not None:
            set_field("delta", validation.validate_delta(self.delta))
        accounting.validate_accountant(self.accountant)
        if self.target_epsilon is not None:
            set_field("target_epsilon", validation.validate_epsilon(self.target_epsilon))
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError(
                "DP-SGD needs a noise_multiplier, or a target_epsilon (with a sampler and "
                "the planned steps) to calibrate it. Received: noise_multiplier=None, "
                "target_epsilon=None"
            )
        if self.noise_multiplier is not None:
            set_field("noise_multiplier",
                      validation.validate_noise_multiplier(self.noise_multiplier))
        set_field("hardened_noise", validation.validate_hardened_noise(self.hardened_noise))
        validation.validate_clipping(self.clipping)
        set_field("clipping_gamma", validation.validate_clipping_gamma(self.clipping_gamma))
        self._check_unit()
        self._check_bands(set_field)
        set_field("noise_scheme",
                  noise_accounting.validate_noise_scheme(self.noise_scheme, self.bands))
        if self.sampler is not None:
            unit = samplers.sampler_class(self.sampler).privacy_unit  # Unknown names raise.
            if unit != self.privacy_unit:
                raise ValueError(
                    f"sampler={self.sampler!r} protects one {unit}, but privacy_unit="
                    f"{self.privacy_unit!r} was asked for. Received: sampler={self.sampler!r}, "
                    f"privacy_unit={self.privacy_unit!r}"
                )

    def _check_unit(self):
        units = privacy_units()
        if self.privacy_unit not in units:
            raise ValueError(f"privacy_unit must be one of {units}. "
                             f"Received: privacy_unit={self.privacy_unit!r}")
        k = self.max_examples_per_user
        if k is not None and (isinstance(k, bool) or not validation.is_int(k) or k < 1):
            raise ValueError("max_examples_per_user must be a positive integer. "
                             f"Received: max_examples_per_user={k!r}")
        if self.privacy_unit == "example" and k is not None:
            raise ValueError(
                "max_examples_per_user applies to privacy_unit='user' only. Received: "
                f"privacy_unit='example', max_examples_per_user={k!r}")
        if self.privacy_unit != "example" and k is None:
            raise ValueError(
                f"privacy_unit={self.privacy_unit!r} needs max_examples_per_user, a positive "
                "integer: the most examples of one user in a logical step (the others sit "
                "that step out). Received: max_examples_per_user=None")

    def _check_bands(self, set_field):
        set_field("bands", banded_mf.validate_bands(self.bands))
        if self.band_coefficients is not None:
            set_field("band_coefficients",
                      banded_mf.check_coefficients(self.band_coefficients, self.bands))
        if self.bands == 1:
            return
        if self.sampler is not None and not samplers.sampler_class(self.sampler).takes_bands:
            raise ValueError(
                "bands > 1 needs a sampler that keeps each privacy unit's steps `bands` apart "
                "(sampler='banded_poisson', or 'banded_user_poisson' for users). Received: "
                f"sampler={self.sampler!r}, bands={self.bands}")

    @property
    def strategy_coefficients(self):
        """The strategy's coefficients: those given, or the banded square root."""
        if self.band_coefficients is not None:
            return self.band_coefficients
        return banded_mf.square_root_coefficients(self.bands)

    def delta_for(self, dataset_size):
        """δ of a run over `dataset_size` privacy units: the one asked, or the default."""
        if self.delta is not None:
            return self.delta
        return deltas.default_delta(dataset_size)

    def replace(self, **changes):
        """A copy with `changes` (validated like the original)."""
        return dataclasses.replace(self, **changes)
