"""`DPEngine`: a privacy request bound to a route, and what the route asks of it.

The one engine of every route (jax_privacy's config → make() → plan):
`make_engine` binds a validated `tfdp.DPSGDConfig` to the route's sampler
(or divisor), the planned steps and the run's key, and the route then only
asks the engine: the contract (`mechanism`, a `tfdp.DPSGD`), the
`tfdp.dp.NoisyAggregator` that releases each logical step, the DP event of
its noise scheme, the budget, the ledger and the training probe's settings. The other guarantees (the
labels, non-finite values, duplicates) are checked where their data is, each
by the one function written for it (docs/PRIVACY.md, "Every route, every
guarantee"). `DPSGD.from_config`
is called here and nowhere else on a route.

The trainer's `tfdp.training.run_contract.RunContract` holds one, and so
does Keras' `tfdp.keras.mechanism_builder.MechanismBuilder` (`engine`) for
each `fit` route.
"""

import tensorflow as tf

from tfdp import distribute
from tfdp import dpsgd_config
from tfdp import mechanism as mechanism_lib
from tfdp.dp import noisy_aggregator


class DPEngine:
    """One route's DP-SGD: its contract, its key, its sampler, its aggregator.

    Made by `make_engine` only. Immutable: a route that changes (another
    sampler, a resumed key) makes another engine (`with_key`).

    Attributes:
        mechanism: `tfdp.DPSGD`. The contract: C, σ (perhaps calibrated), δ,
            the sampler, the accountant, the key.
        key: `tfdp.secret_key.SecretKey`. The agreed key of the noise and
            the batches (the mechanism's).
        sampler: `tfdp.samplers.Sampler` or None. The route's sampler (None:
            a divisor and no accounting here).
        aggregator: `tfdp.dp.NoisyAggregator`. The release of each logical
            step, from the contract and the noise options.
        noise_options: dict. The aggregator's options (e.g. `tree=`).
    """

    def __init__(self, mechanism, aggregator, noise_options, token):
        if token is not _TOKEN:
            raise TypeError("Make a DPEngine with tfdp.engine.make_engine(config, ...).")
        self.mechanism = mechanism
        self.aggregator = aggregator
        self.noise_options = dict(noise_options)

    @property
    def key(self):
        return self.mechanism.secret_key

    @property
    def sampler(self):
        return self.mechanism.sampler

    @property
    def config(self):
        """The `tfdp.DPSGDConfig` the contract was bound from."""
        return self.mechanism.config

    @property
    def l2_norm_clip(self):
        return self.mechanism.l2_norm_clip

    @property
    def noise_multiplier(self):
        return self.mechanism.noise_multiplier

    @property
    def delta(self):
        return self.mechanism.delta

    def with_key(self, key):
        """This engine with another key (a resumed run's): same contract, its noise and batches."""
        if key == self.key:
            return self
        return _engine(self.mechanism.with_secret_key(key), self.noise_options)

    # ------------------------------------------------------------------
    # The guarantees, each delegated to the one place it is written.
    # ------------------------------------------------------------------

    def budget_steps(self, planned, sensitivity=1):
        """The steps of `planned` that fit the target ε (`tfdp.DPSGD.budget_steps`)."""
        return self.mechanism.budget_steps(planned, sensitivity=sensitivity)

    def ledger(self, steps=0, sensitivity=1):
        """The contract's `tfdp.privacy.PrivacyLedger` after `steps` (`tfdp.DPSGD.ledger`)."""
        return self.mechanism.ledger(steps, sensitivity=sensitivity)

    def dp_event(self, steps):
        """The `DpEvent` of `steps` released steps: the noise scheme's, over the sampler.

        DP-SGD and banded noise compose the sampler's event (banded only over
        a sampler whose units' steps are b apart); tree noise its trees'.
        """
        if self.sampler is None:
            raise ValueError(
                "An engine made with a divisor and no sampler has no DP event: account it "
                "where the sampling is known. Received: sampler=None")
        return self.aggregator.scheme.dp_event(self.sampler, self.noise_multiplier, steps)

    def probe_settings(self, *, method, weight_decay, augmentation_multiplicity=1, group_size=1):
        """The training probe's keyword arguments for this contract (C, the method, ...).

        The probe leaves one privacy unit out: the K augmentations of an
        example, or the k rows of a user (`group_size`).
        """
        return dict(self.mechanism.clip_settings(), method=method, weight_decay=weight_decay,
                    augmentation_multiplicity=augmentation_multiplicity * group_size)

    def __repr__(self):
        return f"DPEngine({self.mechanism!r}, noise_options={self.noise_options!r})"


_TOKEN = object()


def _engine(mechanism, noise_options):
    with tf.init_scope():  # May run while a train step is traced.
        aggregator = noisy_aggregator.NoisyAggregator.for_mechanism(mechanism, **noise_options)
    return DPEngine(mechanism, aggregator, noise_options, _TOKEN)


def make_engine(config, *, sampler, steps=None, key, strategy=None, noise_options=None,
                expected_batch_size=None):
    """The route's `DPEngine`: `config` bound to its sampler, steps and key.

    Args:
        config: `tfdp.DPSGDConfig` (the request, validated), or a bound
            `tfdp.DPSGD` (a contract the user gave whole; `sampler`, `steps`
            and `expected_batch_size` must then be None). δ=None is
            `tfdp.privacy.default_delta(N)` of the sampler.
        sampler: `tfdp.samplers.Sampler` or None. The route's sampler: the
            divisor and the DP event. None with `expected_batch_size`.
        steps: int or None. The planned logical steps (to calibrate σ from
            a target ε).
        key: `tfdp.secret_key.SecretKey`. The key of the noise and the
            batches. With `strategy`, agreed across its workers here
            (`tfdp.distribute.agreed_key`, a collective: every worker calls
            it at the same point); without, already agreed by the caller.
        strategy: `tf.distribute.Strategy` or None.
        noise_options: dict or None. `NoisyAggregator.for_mechanism`'s options
            (the noise scheme: `tree=`, `leaves_per_step=`, `scheme=`).
        expected_batch_size: float or None. The divisor where there is no
            sampler.

    Returns:
        A `DPEngine`.
    """
    if strategy is not None and key is not None:
        key = distribute.agreed_key(strategy, key)
    if isinstance(config, mechanism_lib.DPSGD):
        if sampler is not None or steps is not None or expected_batch_size is not None:
            raise ValueError(
                "A bound tfdp.DPSGD carries its sampler, steps and divisor. Received: "
                f"sampler={sampler!r}, steps={steps}, expected_batch_size={expected_batch_size}")
        mechanism = config
        if key is not None and key != mechanism.secret_key:
            mechanism = mechanism.with_secret_key(key)
    elif isinstance(config, dpsgd_config.DPSGDConfig):
        mechanism = mechanism_lib.DPSGD.from_config(
            config, sampler=sampler, steps=steps, expected_batch_size=expected_batch_size,
            secret_key=key)
    else:
        raise ValueError(
            f"config must be a tfdp.DPSGDConfig (or a tfdp.DPSGD). Received: config={config!r}")
    return _engine(mechanism, noise_options or {})
