"""`PrivacyConfig`: the trainer's privacy settings, as gin binds them."""

import dataclasses

import gin

from tfdp import dpsgd_config
from tfdp import samplers
from tfdp.privacy import banded_mf

_COEFFICIENT_CHOICES = ("sqrt", "optimized")


def _given_coefficients(band_coefficients):
    """Explicit coefficients, or None for "sqrt" and "optimized"; else a clear error."""
    if isinstance(band_coefficients, str):
        if band_coefficients not in _COEFFICIENT_CHOICES:
            raise ValueError(
                f"band_coefficients must be one of {_COEFFICIENT_CHOICES} or a sequence of b "
                f"numbers. Received: band_coefficients={band_coefficients!r}")
        return None
    if not isinstance(band_coefficients, (list, tuple)):
        raise ValueError(
            f"band_coefficients must be one of {_COEFFICIENT_CHOICES} or a sequence of b "
            f"numbers. Received: band_coefficients={band_coefficients!r}")
    return tuple(band_coefficients)


@gin.configurable(module="tfdp.training")
@dataclasses.dataclass(frozen=True)
class PrivacyConfig:
    """What a run protects, how it samples, clips and adds noise, and from which key.

    C, σ, a target ε, δ, the accountant, the privacy unit and k form the
    privacy request, `dpsgd_config` (a `tfdp.DPSGDConfig`, which validates
    them); the run's contract (`tfdp.training.run_contract`) binds it to
    the run's sampler, steps and key. The other fields are the trainer's own.

    Args:
        private: bool. False for non-private (public) pretraining: no
            clipping, no noise, no epsilon. Defaults to True.
        sampler: str. "poisson" (amplified by sampling) or "shuffle"
            (fixed-size batches, each example once per pass, accounted for
            any order without amplification); see `tfdp.samplers`. With
            `bands` > 1, "poisson" means "banded_poisson" (Poisson sampling
            within b groups of the examples), or "banded_user_poisson" (of
            the users) under `privacy_unit="user"`. Defaults to "poisson".
        l2_norm_clip: float. Per-example clipping bound C. Defaults to 1.
        noise_multiplier: float or None. σ (noise std σ·C on the sum). If
            None, calibrated from `target_epsilon`. Defaults to None.
        target_epsilon: float or None. Budget: calibrates σ when σ is None,
            and training stops before any step that would exceed it.
            Defaults to None.
        delta: float or None. δ of the guarantee. Defaults to None:
            `tfdp.privacy.default_delta(N)`, min(1e-5, the largest power of
            ten below 1/N), the default of every route.
        accountant: str. "rdp" or "pld". Defaults to "rdp".
        privacy_unit: str. What ε protects. "example": one example. "user":
            everything one user contributed (needs a user per example, e.g.
            an `npz:` file's `user_ids`): each step draws users by Poisson
            sampling (`OptimizationConfig.logical_batch_size` is then the
            expected USERS per step and N the number of users), each drawn
            user brings at most `max_examples_per_user` examples, and the
            mean of their gradients is clipped to C as one vector
            (`tfdp.samplers.UserPoissonSampler`). Defaults to "example".
        max_examples_per_user: int or None. k, with `privacy_unit="user"`:
            the most examples of one user in a step, chosen at random from
            the secret key. `RunConfig.physical_batch_size` (rows) must be a
            multiple of k; it defaults to k times the logical batch.
            Defaults to None.
        clipping_method: str. How per-example gradients are clipped; see
            `tfdp.dp.clipped_grad_sum`. Defaults to "auto".
        clipping_memory_budget_mb: float or None. With "auto": the most
            memory per device that clipping may add to non-private training
            at the replica batch, as `tfdp.dp.plan` estimates it; "auto"
            then picks book-keeping if it fits, else mixed, and the log says
            why. Defaults to None (book-keeping).
        bands: int. b >= 1. b > 1: banded matrix-factorization DP-SGD
            (docs/PRIVACY.md, "Banded matrix factorization"): the noise is
            correlated across b steps, which lowers the noise the model
            accumulates; the examples are split into b secret groups and
            step t samples group t mod b at b times the rate, and ε counts
            ⌈T/b⌉ rounds. Under `privacy_unit="user"` the users are split
            into the b groups. Needs sampler "poisson" (or "banded_poisson")
            and b × logical_batch_size <= N (users under
            `privacy_unit="user"`); keeps b − 1
            noise tensors of the size of the trainable variables per replica.
            Defaults to 1 (DP-SGD).
        band_coefficients: str or sequence of floats. The banded strategy's
            coefficients c_0 … c_{b-1}: "sqrt", the banded square root;
            "optimized", `tfdp.privacy.banded_mf.optimized_coefficients(b,
            planned steps)` (lower noise for the planned steps); or b
            numbers with c_0 > 0 and Euclidean norm <= 1. Ignored at b = 1.
            Defaults to "sqrt".
        hardened_noise: bool. Noise hardened against floating-point attacks
            on the release (`tfdp.DPSGDConfig`; docs/PRIVACY.md,
            "Floating-point noise"): the same std σ·C and ε, drawn in float64
            and rounded once, at several times the noise draw's cost per
            logical step. Defaults to False.
        clipping: str. How each privacy unit's gradient g is bounded:
            "standard", min(1, C/‖g‖)·g; or "automatic" (Bu et al. 2023,
            AUTO-S), C·g/(‖g‖ + γ), of norm below C: the same sensitivity
            and ε, and C only scales the update (set the learning rate for
            an update of norm about C per example). Defaults to "standard".
        clipping_gamma: float. γ > 0 of automatic clipping. Defaults to
            0.01, the paper's.
        noise_scheme: str or None. The noise each logical step releases: a
            registered noise scheme (`tfdp.DPSGDConfig.noise_scheme`), e.g.
            "gaussian" or "banded". None: "banded" at bands > 1, else
            "gaussian".
        insecure_reproducible_seed: int or None. INSECURE, for tests and
            reproducible research: derive the noise and the sampling from
            this public seed instead of a secret key from the OS's entropy.
            No epsilon then holds against anyone who knows the seed; the run
            warns and `summary.json` says so. Defaults to None (secret).
    """

    private: bool = True
    sampler: str = "poisson"
    l2_norm_clip: float = 1.0
    noise_multiplier: object = None
    target_epsilon: object = None
    delta: object = None
    accountant: str = "rdp"
    privacy_unit: str = "example"
    max_examples_per_user: object = None
    clipping_method: str = "auto"
    clipping_memory_budget_mb: object = None
    bands: int = 1
    band_coefficients: object = "sqrt"
    hardened_noise: bool = False
    clipping: str = "standard"
    clipping_gamma: float = 0.01
    noise_scheme: object = None
    insecure_reproducible_seed: object = None
    # The privacy request of a private run (None when non-private), made
    # and validated with this config.
    dpsgd_config: object = dataclasses.field(default=None, init=False, repr=False,
                                             compare=False)

    def __post_init__(self):
        given = _given_coefficients(self.band_coefficients)
        object.__setattr__(self, "bands", banded_mf.validate_bands(self.bands))
        if not self.private:
            if (self.privacy_unit != "example" or self.max_examples_per_user is not None
                    or self.bands != 1 or self.hardened_noise is not False
                    or self.clipping != "standard" or self.noise_scheme is not None):
                raise ValueError(
                    "privacy_unit, max_examples_per_user, bands, hardened_noise, clipping and "
                    f"noise_scheme are for private training. Received: private=False, privacy_unit="
                    f"{self.privacy_unit!r}, max_examples_per_user="
                    f"{self.max_examples_per_user!r}, bands={self.bands!r}, "
                    f"hardened_noise={self.hardened_noise!r}, clipping={self.clipping!r}, "
                    f"noise_scheme={self.noise_scheme!r}")
            return
        banded = self.bands > 1
        # The sampler has a form for the unit and the bands (one mapping of names).
        samplers.resolve_name(self.sampler, privacy_unit=self.privacy_unit, bands=self.bands)
        # DPSGDConfig validates bands and given coefficients once, with C, σ and δ.
        request = dpsgd_config.DPSGDConfig(
            self.l2_norm_clip, self.noise_multiplier, target_epsilon=self.target_epsilon,
            delta=self.delta, accountant=self.accountant, privacy_unit=self.privacy_unit,
            max_examples_per_user=self.max_examples_per_user, bands=self.bands,
            band_coefficients=given if banded else None, hardened_noise=self.hardened_noise,
            clipping=self.clipping, clipping_gamma=self.clipping_gamma,
            noise_scheme=self.noise_scheme)
        object.__setattr__(self, "dpsgd_config", request)  # The dataclass is frozen.

    @property
    def sampler_name(self):
        """The registered sampler a run draws with (`tfdp.samplers.resolve_name`).

        Its form for the privacy unit and, for b > 1, its banded form:
        "banded_poisson", or "banded_user_poisson" under `privacy_unit="user"`.
        """
        if not self.private:
            return self.sampler
        return samplers.resolve_name(self.sampler, privacy_unit=self.privacy_unit,
                                     bands=self.dpsgd_config.bands)

    def request_for(self, steps):
        """The privacy request for `steps` planned steps ("optimized" coefficients fitted).

        Args:
            steps: int. The run's planned logical steps.

        Returns:
            A `tfdp.DPSGDConfig`, or None for a non-private run.
        """
        request = self.dpsgd_config
        if (request is None or request.bands == 1
                or self.band_coefficients != "optimized"):
            return request
        return request.replace(
            band_coefficients=banded_mf.optimized_coefficients(request.bands, steps))

    @property
    def group_size(self):
        """Rows of one privacy unit: k for users, else 1."""
        return self.max_examples_per_user if self.privacy_unit == "user" else 1
