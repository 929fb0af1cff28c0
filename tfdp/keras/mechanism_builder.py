"""`MechanismBuilder`: a `DPOptimizer`'s privacy request, and the `DPSGD` of each `fit`.

The route of a `fit` call (arrays in random order, arrays in their order, a
stream) and the privacy unit fix the sampler; the sampler is asked what it
needs (random access, a random order, the user of each example) and what it
costs; nothing here branches on a sampler's name.
"""

import numpy as np
import tensorflow as tf

from tfdp import distribute
from tfdp import dpsgd_config
from tfdp import engine as engine_lib
from tfdp import mechanism as mechanism_lib
from tfdp import samplers
from tfdp import secret_key as secret_key_lib
from tfdp import validation
from tfdp.keras import fit_route as fit_route_lib

# The sampler `fit` asks for when none is given, by route kind: Poisson sampling
# for arrays in random order (accounted with amplification), shuffle for a
# fixed order or a stream (the bound that holds for any order). Its form for
# the privacy unit and the bands is `tfdp.samplers.resolve_name`'s.
DEFAULT_SAMPLERS = {
    fit_route_lib.SAMPLED: "poisson",
    fit_route_lib.ORDERED: "shuffle",
    fit_route_lib.STREAM: "shuffle",
}


class MechanismBuilder:
    """The privacy request of a `DPOptimizer`, and the `DPSGD` of each `fit`.

    It holds the request, `request` (a `tfdp.DPSGDConfig`: C, σ, δ, the
    sampler asked for, the privacy unit and the accountant, validated when
    the optimizer is made), and binds it to each `fit` once the route has
    fixed the sampler, N and B: `engine` is the `tfdp.engine.DPEngine` of
    the last `route_fit` (`tfdp.engine.make_engine`, as the trainer's), None
    before; `mechanism` (its `tfdp.DPSGD`, or the one given) and
    `aggregator` (its `NoisyAggregator`) read it. C, σ and δ live in the request
    (or the given mechanism) alone; the builder keeps the key and what a
    `fit` settles (B and N as asked, or None for "from the inputs").

    Args:
        l2_norm_clip: float or None. C (without `mechanism`).
        noise_multiplier: float or None. σ (without `mechanism`).
        mechanism: `tfdp.DPSGD` or None. The whole contract; then none of the
            other privacy arguments may be given.
        expected_batch_size: float or None. B, in privacy units (examples,
            or users) per logical step.
        insecure_reproducible_seed: int or None. INSECURE public seed of the
            key (tests only).
        dataset_size: int or None. N, in privacy units.
        delta: float or None. δ; None: `tfdp.privacy.default_delta(N)`.
        sampler: str or None. A registered sampler name; None: the default
            of the route (`DEFAULT_SAMPLERS`).
        accountant: str. "rdp" or "pld".
        privacy_unit: str. What ε protects: "example" or "user".
        max_examples_per_user: int or None. k, under `privacy_unit="user"`:
            the most examples of one user in a logical step.
        gradient_accumulation_steps: int. `fit` batches per logical step,
            for the default B.
        bands: int. b >= 1: banded matrix-factorization noise over b bands
            (the sampler "banded_poisson", or "banded_user_poisson" for
            users); 1 is DP-SGD.
        band_coefficients: sequence of b floats or None. The strategy's
            coefficients; None: the banded square root.
        target_epsilon: float or None. A budget with the given σ: `fit`
            releases no step beyond it (`tfdp.keras.fit_ledger.budget_steps`).
            Defaults to None.
        hardened_noise: bool. Noise hardened against floating-point attacks
            (`tfdp.DPSGDConfig`). Defaults to False.
        clipping: str. "standard" or "automatic" (`tfdp.DPSGDConfig`).
            Defaults to "standard".
        clipping_gamma: float. γ of automatic clipping. Defaults to 0.01.
        noise_scheme: str or None. The noise scheme (`tfdp.DPSGDConfig`).
            Defaults to None: "banded" at bands > 1, else "gaussian".
    """

    def __init__(self, l2_norm_clip=None, noise_multiplier=None, *, mechanism=None,
                 expected_batch_size=None, insecure_reproducible_seed=None, dataset_size=None,
                 delta=None, sampler=None, accountant="rdp", privacy_unit="example",
                 max_examples_per_user=None, gradient_accumulation_steps=1, bands=1,
                 band_coefficients=None, target_epsilon=None, hardened_noise=False,
                 clipping="standard", clipping_gamma=validation.DEFAULT_CLIPPING_GAMMA,
                 noise_scheme=None):
        self.accumulation_steps = gradient_accumulation_steps
        self.fit_route = None
        # The engine of the last route (`route_fit`); None before one.
        self.engine = None
        # The mechanism given whole, or None (a request).
        self._given_mechanism = None
        self._route_key = None
        # A public divisor other than B (`set_noise_divisor`); None: B.
        self.noise_divisor = None
        # The aggregator's own options (`set_aggregator_options`).
        self.aggregator_options = {}
        # B of the last route, in privacy units: what the ledger accounts,
        # also where the noise divisor is not B (`tfdp.keras.fit_ledger`).
        self.planned_batch_size = None
        if mechanism is not None:
            self._init_given(mechanism, l2_norm_clip=l2_norm_clip,
                             noise_multiplier=noise_multiplier,
                             expected_batch_size=expected_batch_size,
                             insecure_reproducible_seed=insecure_reproducible_seed,
                             dataset_size=dataset_size, delta=delta, sampler=sampler,
                             accountant=accountant, privacy_unit=privacy_unit,
                             max_examples_per_user=max_examples_per_user,
                             bands=None if bands == 1 else bands,
                             band_coefficients=band_coefficients,
                             target_epsilon=target_epsilon, hardened_noise=hardened_noise,
                             clipping=clipping, clipping_gamma=clipping_gamma,
                             noise_scheme=noise_scheme)
            return
        if l2_norm_clip is None or noise_multiplier is None:
            raise ValueError(
                "DPOptimizer needs l2_norm_clip and noise_multiplier, or a "
                "mechanism (tfdp.DPSGD). Received: "
                f"l2_norm_clip={l2_norm_clip}, noise_multiplier={noise_multiplier}"
            )
        self.given = False
        # Validated here, where the user gives it; bound at each `route_fit`.
        self.request = dpsgd_config.DPSGDConfig(
            l2_norm_clip, noise_multiplier, delta=delta, accountant=accountant,
            sampler=sampler, privacy_unit=privacy_unit,
            max_examples_per_user=max_examples_per_user, bands=bands,
            band_coefficients=band_coefficients, target_epsilon=target_epsilon,
            hardened_noise=hardened_noise, clipping=clipping, clipping_gamma=clipping_gamma,
            noise_scheme=noise_scheme)
        self.expected_batch_size = (None if expected_batch_size is None else
                                    validation.validate_expected_batch_size(expected_batch_size))
        self.dataset_size = None if dataset_size is None else int(dataset_size)
        # The chief's key on every worker (the optimizer is made in the
        # strategy's scope): one sample and one noise draw per step.
        self.secret_key = distribute.agreed_key(
            tf.distribute.get_strategy(),
            secret_key_lib.SecretKey.resolve(insecure_seed=insecure_reproducible_seed))

    def _init_given(self, mechanism, **others):
        if not isinstance(mechanism, mechanism_lib.DPSGD):
            raise ValueError(
                f"mechanism must be a tfdp.DPSGD. Received: mechanism={mechanism!r}"
            )
        defaults = {"accountant": "rdp", "privacy_unit": "example", "hardened_noise": False,
                    "clipping": "standard",
                    "clipping_gamma": validation.DEFAULT_CLIPPING_GAMMA}
        given = sorted(name for name, value in others.items()
                       if value is not None and value != defaults.get(name, None))
        if given:
            raise ValueError(
                "Pass the privacy parameters in the mechanism only, so that they "
                f"are set in one place. Received: a mechanism and {given}"
            )
        self.given = True
        # The chief's key on every worker, as for a request.
        key = distribute.agreed_key(tf.distribute.get_strategy(), mechanism.secret_key)
        self._given_mechanism = (mechanism if key == mechanism.secret_key
                                 else mechanism.with_secret_key(key))
        self.request = mechanism.config
        self.secret_key = key
        self.expected_batch_size = None
        self.dataset_size = None

    # ------------------------------------------------------------------

    @property
    def mechanism(self):
        """The `tfdp.DPSGD` of the last route's engine, or the one given; None before."""
        if self.engine is not None:
            return self.engine.mechanism
        return self._given_mechanism

    @property
    def aggregator(self):
        """The `NoisyAggregator` of the last route's engine; None before a route."""
        return self.engine.aggregator if self.engine is not None else None

    @property
    def l2_norm_clip(self):
        """C of the request."""
        return self.request.l2_norm_clip

    @property
    def noise_multiplier(self):
        """σ: the given mechanism's (perhaps calibrated), else the request's."""
        return self.mechanism.noise_multiplier if self.given else self.request.noise_multiplier

    @property
    def accountant(self):
        return self.request.accountant

    @property
    def delta(self):
        """δ: the given mechanism's, else as asked (None: by N at each `route_fit`)."""
        return self.mechanism.delta if self.given else self.request.delta

    @property
    def sampler(self):
        """The sampler name asked for, or None (the route's default, or the given one)."""
        return None if self.given else self.request.sampler

    @property
    def privacy_unit(self):
        return self.request.privacy_unit

    @property
    def max_examples_per_user(self):
        return self.request.max_examples_per_user

    @property
    def hardened_noise(self):
        """Whether the noise is hardened against floating-point attacks (the request's)."""
        return self.request.hardened_noise

    def clip_settings(self):
        """C and its rule (`tfdp.DPSGD.clip_settings`), from the request."""
        return dict(l2_norm_clip=self.request.l2_norm_clip, clipping=self.request.clipping,
                    clipping_gamma=self.request.clipping_gamma)

    @property
    def current(self):
        """The mechanism of the last `route_fit`, or the given one; None before a route."""
        return self.mechanism if (self.given or self.fit_route is not None) else None

    def set_noise_divisor(self, divisor):
        """Divides the noisy sum by the public `divisor` instead of B.

        For an optimizer that clips groups of rows (`clipping_groups`) and
        divides by the number of groups. The mechanism then carries no
        sampler (its divisor is not B); `tfdp.keras.fit_ledger` accounts the
        sampler and B of the route, at the optimizer's `sensitivity`.
        """
        self.noise_divisor = None if divisor is None else float(divisor)
        self._route_key = None

    def set_aggregator_options(self, **options):
        """Options of the `NoisyAggregator` of each route, e.g. `tree=` (DP-FTRL's noise)."""
        self.aggregator_options = dict(options)
        self._route_key = None

    def route_fit(self, *, arrays, dataset_size=None, physical_batch_size=None, shuffle=True,
             user_ids=None):
        """Fixes the route, the sampler and the mechanism of a `fit` call.

        Args:
            arrays: bool. Whether `fit` got arrays (random access).
            dataset_size: int or None. N of the arrays, in privacy units
                (the number of users under `privacy_unit="user"`).
            physical_batch_size: int or None. The `fit` batch size (rows).
            shuffle: bool. `fit(shuffle=...)`.
            user_ids: int array `[n]` or None. The user of each example, in
                [0, N) (under `privacy_unit="user"`).

        Returns:
            A `FitRoute`.
        """
        unit = self.privacy_unit
        if arrays:
            kind = fit_route_lib.SAMPLED if shuffle else fit_route_lib.ORDERED
        else:
            kind = fit_route_lib.STREAM
        name = self._sampler_name(kind)
        cls = samplers.sampler_class(name)
        if arrays and cls.amplified and not shuffle:
            fix = ("use shuffle=True" if cls.privacy_unit != "example" else
                   "use sampler='shuffle' (accounted without amplification), or shuffle=True")
            raise ValueError(
                f"fit(shuffle=False) asks for a fixed order, but sampler={name!r} draws "
                f"random batches, accounted with amplification by sampling: {fix}. "
                "Received: shuffle=False"
            )
        if not arrays and cls.needs_random_access:
            if cls.privacy_unit != "example":
                raise ValueError(
                    f"privacy_unit={unit!r} draws users by Poisson sampling, which needs "
                    "random access to every user's examples and the user of each: pass "
                    "arrays (numpy or tensors) to fit with `user_ids=`. A tf.data input "
                    "carries no user ids. Received: x of a streamed type"
                )
            drawn = "Poisson-sampled batches" if cls.amplified else "batches"
            raise ValueError(
                f"sampler={name!r} needs random access to the examples: pass arrays "
                f"(numpy or tensors) to fit, which draws the {drawn} itself; a tf.data "
                "input is accounted with sampler='shuffle'. Received: x of a streamed type"
            )
        if cls.privacy_unit != "example" and user_ids is None:
            raise ValueError(
                f"privacy_unit={unit!r} needs the user of every example: pass "
                "`fit(x, y, user_ids=...)`. Received: user_ids=None"
            )
        batch, n = self._sizes(arrays, dataset_size, physical_batch_size)
        self.planned_batch_size = batch
        sampler = None
        if kind in fit_route_lib.ARRAY_KINDS:
            sampler = samplers.make_sampler(
                name, dataset_size=n, logical_batch_size=batch,
                physical_batch_size=physical_batch_size,
                **self._sampler_options(cls, user_ids))
        elif n:
            # Accounting only: the per-pass bound needs N and B, not P.
            sampler = samplers.for_accounting(name, None, dataset_size=n, batch_size=batch,
                                              **self._sampler_options(cls, None))
        key = (kind, sampler, batch, self.delta, self.noise_divisor)
        if key != self._route_key:
            self.engine = self._fit_engine(sampler, batch)
            self._route_key = key
        steps = None
        if kind in fit_route_lib.ARRAY_KINDS:
            steps = max(1, int(round(sampler.steps_per_epoch)))
        self.fit_route = fit_route_lib.FitRoute(kind, sampler, steps, name,
                                                physical_batch_size)
        return self.fit_route

    @property
    def bands(self):
        """b: the bands of the noise (1 for DP-SGD)."""
        return self.request.bands

    def _sampler_name(self, kind):
        if self.given:
            sampler = self.mechanism.sampler
            if sampler is not None:
                return sampler.name
            if kind in fit_route_lib.ARRAY_KINDS:
                raise ValueError(
                    "fit on arrays draws its batches with the mechanism's sampler; "
                    "build the DPSGD with one. Received: sampler=None"
                )
        elif self.sampler is not None:
            return self.sampler
        # Users have one sampler (Poisson), which every route takes and then
        # refuses where it cannot draw it; bands > 1 keep a unit's steps apart.
        requested = "poisson" if self.privacy_unit == "user" else DEFAULT_SAMPLERS[kind]
        return samplers.resolve_name(requested, privacy_unit=self.privacy_unit,
                                     bands=self.bands)

    def _sizes(self, arrays, dataset_size, physical_batch_size):
        """B and N of the fit (in privacy units), checked against the request."""
        if self.given:
            sampler = self.mechanism.sampler
            batch = sampler.logical_batch_size if sampler is not None else None
            n = sampler.dataset_size if sampler is not None else None
            if arrays and n != dataset_size:
                raise ValueError(
                    "The mechanism's sampler was made for another dataset size. "
                    f"Received: sampler dataset_size={n}, fit arrays of {dataset_size}"
                )
            return batch, n
        batch = self.expected_batch_size
        if batch is None and physical_batch_size:
            k = self.max_examples_per_user or 1
            if physical_batch_size % k:
                raise ValueError(
                    f"Under privacy_unit={self.privacy_unit!r} a fit batch holds whole "
                    "users, max_examples_per_user rows each: batch_size must be a multiple "
                    f"of it. Received: batch_size={physical_batch_size}, "
                    f"max_examples_per_user={k}"
                )
            batch = physical_batch_size // k * self.accumulation_steps
        if batch is None:
            raise ValueError(
                "The DPOptimizer needs the logical batch size: pass "
                "`expected_batch_size=` to it, or `batch_size=` to fit, or a "
                "dataset with a static batch size. Received: no batch size"
            )
        n = self.dataset_size or dataset_size
        if arrays and n != dataset_size:
            raise ValueError(
                "fit on arrays samples from the arrays given: N is their length "
                "(their number of users under privacy_unit='user'). "
                f"Received: dataset_size={self.dataset_size}, arrays of {dataset_size}"
            )
        return batch, n

    def _sampler_options(self, cls, user_ids):
        """The sampler's own arguments: its bands, and the users of the examples."""
        banded = {"bands": self.bands} if cls.takes_bands else {}
        if cls.privacy_unit == "example":
            return banded
        given = self.mechanism.sampler if self.given else None
        if given is not None and given.user_ids is not None and not np.array_equal(
                given.user_ids, user_ids):
            raise ValueError(
                "The mechanism's sampler was made for other user ids than fit's "
                "`user_ids`. Received: user ids that differ from the sampler's"
            )
        return {"user_ids": user_ids, "max_examples_per_user": self.max_examples_per_user,
                **banded}

    def _fit_engine(self, sampler, batch):
        """The route's `tfdp.engine.DPEngine`: the request bound to this fit's sampler
        (or divisor) and the key, or the mechanism given whole."""
        options = dict(noise_options=self.aggregator_options, key=self.secret_key)
        if self.given:
            return engine_lib.make_engine(self._given_mechanism, sampler=None, **options)
        n = sampler.dataset_size if sampler is not None else None
        # δ by N of the sampler that draws the batches, even where the
        # divisor below is not its B.
        request = self.request.replace(delta=self.request.delta_for(n))
        if self.noise_divisor is not None:
            # The divisor is not B, so this mechanism carries no sampler;
            # `tfdp.keras.fit_ledger` accounts the route's.
            return engine_lib.make_engine(request, sampler=None,
                                          expected_batch_size=self.noise_divisor, **options)
        if sampler is None:
            return engine_lib.make_engine(request, sampler=None, expected_batch_size=batch,
                                          **options)
        return engine_lib.make_engine(request, sampler=sampler, **options)

    # ------------------------------------------------------------------

    def config(self):
        """The privacy entries of `DPOptimizer.get_config` (never the key)."""
        sampler = self.mechanism.sampler if self.given else None
        return {
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "expected_batch_size": (sampler.logical_batch_size if sampler
                                    else self.expected_batch_size),
            "insecure_reproducible_seed": self.secret_key.insecure_seed,
            "dataset_size": sampler.dataset_size if sampler else self.dataset_size,
            "delta": self.delta,
            "sampler": sampler.name if sampler else self.sampler,
            "accountant": self.accountant,
            "privacy_unit": self.privacy_unit,
            "max_examples_per_user": self.max_examples_per_user,
            "bands": self.bands,
            "band_coefficients": (None if self.request.band_coefficients is None
                                  else [float(c) for c in self.request.band_coefficients]),
            "target_epsilon": self.request.target_epsilon,
            "hardened_noise": self.hardened_noise,
            "clipping": self.request.clipping,
            "clipping_gamma": self.request.clipping_gamma,
            "noise_scheme": self.request.noise_scheme,
        }
