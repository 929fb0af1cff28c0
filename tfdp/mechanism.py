"""`DPSGD`: the whole privacy contract of a DP-SGD run, in one object.

A `tfdp.DPSGDConfig` (C, σ or a target ε, δ, the accountant: validated
there, once) bound to what a route knows (the sampler, the planned steps, the
secret key or the divisor) by `DPSGD.from_config`, the one way tfdp's routes
make one. Everything the guarantee rests on is derived here:
- σ, calibrated for the target ε over the planned steps;
- the noise std σ·C, whether the noise is hardened, and the divisor (the
  sampler's expected batch size);
- the DP event and the privacy ledger;
- whether a checkpoint may be continued under this contract.

The engine builds the noisy aggregator that releases each logical step from
it (`tfdp.dp.NoisyAggregator.for_mechanism`).

The trainer, `DPOptimizer` / `make_private`, the audit and the bench all take
one, so no route can wire these values differently.

Imports no TensorFlow.
"""

import copy
import math

from tfdp import dpsgd_config
from tfdp import samplers
from tfdp import secret_key as secret_key_lib
from tfdp import validation
from tfdp.privacy import accounting
from tfdp.privacy import calibration
from tfdp.privacy import ledger as ledger_lib
from tfdp.privacy import noise_accounting


def _check_sampler(sampler):
    if sampler is not None and not isinstance(sampler, samplers.Sampler):
        raise ValueError(
            "sampler must be a tfdp.samplers.Sampler (e.g. "
            "`tfdp.samplers.make_sampler('poisson', dataset_size=..., "
            f"logical_batch_size=...)`). Received: {sampler!r}"
        )


class DPSGD:
    """The privacy contract of a DP-SGD run.

    tfdp's routes make it with `DPSGD.from_config(tfdp.DPSGDConfig(...), ...)`;
    this constructor takes the same values in one call, for users.

    Args:
        l2_norm_clip: float. C > 0, the per-example clipping bound.
        noise_multiplier: float or None. σ >= 0; the noise std on the
            summed clipped gradients of a logical step is σ·C. If None, σ
            is calibrated from `target_epsilon` over `steps`.
        sampler: `tfdp.samplers.Sampler` or None. How the logical batches
            are drawn; it gives the divisor and the DP event. None is only
            for a bare step with an explicit `expected_batch_size` and no
            accounting.
        target_epsilon: float or None. A budget: calibrates σ when σ is
            None, and `budget_steps` stops before it would be exceeded.
            Defaults to None.
        delta: float. δ of the guarantee, in (0, 1). Defaults to 1e-5.
        accountant: str. "rdp" or "pld". Defaults to "rdp".
        steps: int or None. The planned logical steps (for calibration).
            Defaults to None.
        expected_batch_size: float or None. The divisor when there is no
            sampler. Defaults to None.
        secret_key: `tfdp.secret_key.SecretKey` or None. The key of the
            noise and the sampling; a checkpointed one to resume. Defaults to
            None: a fresh key from the OS's entropy.
        insecure_reproducible_seed: int or None. INSECURE: derive the key
            from this public seed (tests, reproducible research). Defaults
            to None.
        band_coefficients: sequence of floats or None. Banded matrix
            factorization: the coefficients of the strategy, as many as the
            sampler's `bands` (`tfdp.DPSGDConfig`). None: the banded square
            root (at bands=1, DP-SGD). Defaults to None.
        hardened_noise: bool. Noise hardened against floating-point attacks
            (`tfdp.DPSGDConfig`). Defaults to False.
        clipping: str. "standard" or "automatic" (`tfdp.DPSGDConfig`).
            Defaults to "standard".
        clipping_gamma: float. γ of automatic clipping. Defaults to 0.01.
        noise_scheme: str or None. The noise scheme (`tfdp.DPSGDConfig`).
            Defaults to None: "banded" at the sampler's bands > 1, else
            "gaussian".
    """

    def __init__(
        self,
        l2_norm_clip,
        noise_multiplier=None,
        *,
        sampler=None,
        target_epsilon=None,
        delta=1e-5,
        accountant="rdp",
        steps=None,
        expected_batch_size=None,
        secret_key=None,
        insecure_reproducible_seed=None,
        band_coefficients=None,
        hardened_noise=False,
        clipping="standard",
        clipping_gamma=validation.DEFAULT_CLIPPING_GAMMA,
        noise_scheme=None,
    ):
        # The users' constructor: the request part becomes a `DPSGDConfig`
        # (validated there), then it is bound as tfdp's routes bind theirs.
        if delta is None:
            # None is a route's "δ by N" (`DPSGDConfig`); this constructor
            # has always asked for δ (default 1e-5), so the rule refuses it.
            validation.validate_delta(delta)
        _check_sampler(sampler)
        unit = sampler.privacy_unit if sampler is not None else "example"
        config = dpsgd_config.DPSGDConfig(
            l2_norm_clip, noise_multiplier, target_epsilon=target_epsilon, delta=delta,
            accountant=accountant, privacy_unit=unit,
            max_examples_per_user=sampler.group_size if unit != "example" else None,
            bands=sampler.bands if sampler is not None else 1,
            band_coefficients=band_coefficients, hardened_noise=hardened_noise,
            clipping=clipping, clipping_gamma=clipping_gamma, noise_scheme=noise_scheme)
        self._bind(config, sampler=sampler, steps=steps,
                   expected_batch_size=expected_batch_size,
                   secret_key=secret_key_lib.SecretKey.resolve(
                       secret_key, insecure_reproducible_seed))

    @classmethod
    def from_config(cls, config, *, sampler=None, steps=None, expected_batch_size=None,
                    secret_key=None):
        """The contract of `config` on a route: the one way tfdp makes a `DPSGD`.

        Args:
            config: `tfdp.DPSGDConfig`. The privacy request, already validated.
            sampler: `tfdp.samplers.Sampler` or None. The route's sampler: the
                divisor (its expected batch size) and the DP event. None only
                for a step with an explicit `expected_batch_size` and no
                accounting.
            steps: int or None. The planned logical steps (to calibrate σ
                from the target ε). Defaults to None.
            expected_batch_size: float or None. The divisor when there is no
                sampler. Defaults to None.
            secret_key: `tfdp.secret_key.SecretKey` or None. The key of the
                noise and the sampling. Defaults to None: a fresh key from the
                OS's entropy.

        Returns:
            A `DPSGD`.
        """
        if not isinstance(config, dpsgd_config.DPSGDConfig):
            raise ValueError(f"config must be a tfdp.DPSGDConfig. Received: config={config!r}")
        _check_sampler(sampler)
        if sampler is not None and sampler.privacy_unit != config.privacy_unit:
            raise ValueError(
                f"The sampler protects one {sampler.privacy_unit}, but the config asks for "
                f"privacy_unit={config.privacy_unit!r}. Received: sampler={sampler!r}"
            )
        if sampler is not None and sampler.bands != config.bands:
            raise ValueError(
                f"The config asks for bands={config.bands}, and the sampler keeps each "
                f"example's steps {sampler.bands} apart; they must agree (e.g. "
                "`tfdp.samplers.make_sampler('banded_poisson', ..., bands=...)`). "
                f"Received: sampler={sampler!r}, bands={config.bands}"
            )
        mechanism = cls.__new__(cls)
        mechanism._bind(config, sampler=sampler, steps=steps,
                        expected_batch_size=expected_batch_size,
                        secret_key=secret_key_lib.SecretKey.resolve(secret_key))
        return mechanism

    def _bind(self, config, *, sampler, steps, expected_batch_size, secret_key):
        self.config = config
        self.l2_norm_clip = config.l2_norm_clip
        self.sampler = sampler
        self.delta = config.delta_for(sampler.dataset_size if sampler is not None else None)
        self.accountant = config.accountant
        self.bands = config.bands
        self.band_coefficients = config.strategy_coefficients
        self.hardened_noise = config.hardened_noise
        self.noise_scheme = config.noise_scheme
        self.clipping = config.clipping
        self.clipping_gamma = config.clipping_gamma
        if sampler is not None:
            accounting.check_supported(config.accountant, sampler)
        self.target_epsilon = config.target_epsilon
        self.planned_steps = steps
        noise_multiplier = config.noise_multiplier
        if noise_multiplier is None:
            if sampler is None or steps is None:
                raise ValueError(
                    "DP-SGD needs a noise_multiplier, or a target_epsilon with a sampler "
                    "and the planned steps to calibrate it. Received: noise_multiplier=None, "
                    f"target_epsilon={config.target_epsilon}, sampler={sampler!r}, steps={steps}"
                )
            noise_multiplier = calibration.calibrate_noise(
                config.target_epsilon, self.delta, steps=steps,
                dataset_size=sampler.dataset_size, batch_size=sampler.logical_batch_size,
                accountant=config.accountant, sampler=sampler,
            )
            noise_multiplier = validation.validate_noise_multiplier(noise_multiplier)
        self.calibrated = config.noise_multiplier is None
        self.noise_multiplier = noise_multiplier
        if sampler is not None:
            if expected_batch_size is not None:
                raise ValueError(
                    "The divisor is the sampler's expected batch size; pass a sampler or "
                    f"expected_batch_size, not both. Received: expected_batch_size={expected_batch_size}"
                )
            expected_batch_size = sampler.expected_batch_size
        if expected_batch_size is None:
            raise ValueError(
                "DP-SGD needs the divisor of the noisy sum: pass a sampler, or "
                "expected_batch_size. Received: sampler=None, expected_batch_size=None"
            )
        self.expected_batch_size = validation.validate_expected_batch_size(expected_batch_size)
        self.secret_key = secret_key

    # ------------------------------------------------------------------
    # The noise and the divisor.
    # ------------------------------------------------------------------

    @property
    def noise_stddev(self):
        """σ·C: the noise std on a logical step's summed clipped gradients."""
        return self.noise_multiplier * self.l2_norm_clip

    @property
    def sampling_key(self):
        """The secret sub-key of the sampler's batches."""
        return self.secret_key.derive("sampling")

    # ------------------------------------------------------------------
    # Accounting.
    # ------------------------------------------------------------------

    def clip_settings(self):
        """C and its rule, as `tfdp.dp.clipped_grad_sum` takes them (keyword arguments).

        Every route clips with these, so that what it clips is what the
        contract's sensitivity assumes.
        """
        return dict(l2_norm_clip=self.l2_norm_clip, clipping=self.clipping,
                    clipping_gamma=self.clipping_gamma)

    def _require_sampler(self, what):
        if self.sampler is None:
            raise ValueError(f"{what} needs the sampler of the run. Received: sampler=None")

    def dp_event(self, steps):
        """The `dp_accounting.DpEvent` of `steps` logical steps."""
        self._require_sampler("The DP event")
        return noise_accounting.dp_event(self.noise_scheme, self.sampler, self.noise_multiplier,
                                         steps, bands=self.bands)

    def ledger(self, steps=0, sensitivity=1):
        """A `PrivacyLedger` of this contract after `steps` steps.

        Args:
            steps: int. Logical steps taken. Defaults to `0`.
            sensitivity: float. How far one privacy unit moves a clipped sum,
                in units of C (`PrivacyLedger`): 1 where each unit is clipped
                alone, 2 for microbatches of several examples. Defaults to `1`.
        """
        self._require_sampler("The privacy ledger")
        return ledger_lib.PrivacyLedger(
            self.noise_multiplier, self.sampler.sampling_rate, delta=self.delta, steps=steps,
            sampler=self.sampler.name, accountant=self.accountant,
            dataset_size=self.sampler.dataset_size, batch_size=self.sampler.logical_batch_size,
            l2_norm_clip=self.l2_norm_clip, sensitivity=sensitivity, bands=self.bands,
            band_coefficients=self.band_coefficients if self.bands > 1 else None,
            noise_scheme=self.noise_scheme,
        )

    def epsilon(self, steps):
        """ε after `steps` logical steps, at this contract's δ."""
        return self.ledger(steps).epsilon()

    def budget_steps(self, planned_steps, sensitivity=1):
        """The steps that fit the target ε (all of them without a target).

        Every route that runs this contract releases no step beyond it: the
        trainer's plan (`tfdp.training.run_contract`) and Keras `fit`
        (`tfdp.keras.fit_ledger.budget_steps`, for the steps it accounts).

        Args:
            planned_steps: int. The logical steps the route plans, in all.
            sensitivity: float. As `ledger`: how far one privacy unit moves
                a clipped sum, in units of C. Defaults to `1`.

        Returns:
            An int: `planned_steps`, or fewer where the target ε allows
            fewer (0 where it allows none).
        """
        if self.target_epsilon is None:
            return planned_steps
        within = self.ledger(sensitivity=sensitivity).max_steps_within(self.target_epsilon)
        return min(planned_steps, within)

    def check_checkpoint(self, record, saved_key, where):
        """Refuses a checkpoint written under another contract.

        Args:
            record: dict. The checkpoint's ledger (`to_dict`).
            saved_key: `SecretKey` or None. The checkpoint's key.
            where: str. Names the checkpoint and the fix, for the message.

        Raises:
            ValueError: naming what differs.
        """
        saved = ledger_lib.PrivacyLedger.from_dict(record)
        differences = saved.differences(self.ledger())
        if differences:
            listed = ", ".join(
                f"{name}: checkpoint {old!r} vs this run {new!r}"
                for name, (old, new) in differences.items()
            )
            raise ValueError(
                f"The checkpoint {where} was written under another privacy configuration "
                f"({listed}); its steps cannot be counted under this one."
            )
        if saved_key is None or saved_key.insecure_seed != self.secret_key.insecure_seed:
            def describe(key):
                if key is None:
                    return "no recorded key"
                return "a secret key" if key.is_secret else f"insecure seed {key.insecure_seed}"

            raise ValueError(
                f"The checkpoint {where} drew its noise and sampling from "
                f"{describe(saved_key)}, and this run asks for {describe(self.secret_key)}."
            )

    def with_secret_key(self, secret_key):
        """The same contract with another key (e.g. a checkpoint's, to resume)."""
        other = copy.copy(self)
        other.secret_key = secret_key_lib.SecretKey.resolve(secret_key)
        return other

    def describe(self):
        """One line for logs. Never shows the key."""
        sampler = self.sampler.describe() if self.sampler is not None else "no sampler"
        return (f"DP-SGD: C={self.l2_norm_clip:g} sigma={self.noise_multiplier:.4f}"
                f"{' (calibrated)' if self.calibrated else ''} delta={self.delta:g} "
                f"{f'bands={self.bands} ' if self.bands > 1 else ''}"
                f"{'' if self.noise_scheme == noise_accounting.validate_noise_scheme(None, self.bands) else f'noise={self.noise_scheme} '}"
                f"{'hardened_noise ' if self.hardened_noise else ''}"
                f"{f'clipping=automatic(gamma={self.clipping_gamma:g}) ' if self.clipping == 'automatic' else ''}"
                f"accountant={self.accountant} {sampler} "
                f"key={'secret' if self.secret_key.is_secret else 'INSECURE'}")

    def __repr__(self):
        return f"DPSGD({self.describe()})"
