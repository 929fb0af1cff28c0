"""`PrivacyConfig`: the trainer's privacy settings, as gin binds them."""

import dataclasses

import gin

from tfdp import dpsgd_config


@gin.configurable(module="tfdp.training")
@dataclasses.dataclass(frozen=True)
class PrivacyConfig:
    """What a run protects, how it samples, clips and adds noise, and from which key.

    C, σ, a target ε, δ, the accountant, the privacy unit and k form the
    privacy request, `dpsgd_config` (a `tfdp.DPSGDConfig`, which validates
    them); the run plan binds it to the run's sampler, steps and key
    (`tfdp.training.run_plan`). The other fields are the trainer's own.

    Args:
        private: bool. False for non-private (public) pretraining: no
            clipping, no noise, no epsilon. Defaults to True.
        sampler: str. "poisson" (amplified by sampling) or "shuffle"
            (fixed-size batches, each example once per pass, accounted for
            any order without amplification); see `tfdp.samplers`. Defaults
            to "poisson".
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
    insecure_reproducible_seed: object = None
    # The privacy request of a private run (None when non-private), made
    # and validated with this config.
    dpsgd_config: object = dataclasses.field(default=None, init=False, repr=False,
                                             compare=False)

    def __post_init__(self):
        if not self.private:
            if self.privacy_unit != "example" or self.max_examples_per_user is not None:
                raise ValueError(
                    "privacy_unit and max_examples_per_user are for private training. "
                    f"Received: private=False, privacy_unit={self.privacy_unit!r}, "
                    f"max_examples_per_user={self.max_examples_per_user!r}")
            return
        if self.privacy_unit == "user" and self.sampler != "poisson":
            raise ValueError(
                "privacy_unit='user' draws users by Poisson sampling (sampler='poisson'). "
                f"Received: sampler={self.sampler!r}")
        request = dpsgd_config.DPSGDConfig(
            self.l2_norm_clip, self.noise_multiplier, target_epsilon=self.target_epsilon,
            delta=self.delta, accountant=self.accountant, privacy_unit=self.privacy_unit,
            max_examples_per_user=self.max_examples_per_user)
        object.__setattr__(self, "dpsgd_config", request)  # The dataclass is frozen.

    @property
    def group_size(self):
        """Rows of one privacy unit: k for users, else 1."""
        return self.max_examples_per_user if self.privacy_unit == "user" else 1
