"""`DPOptimizer`: the DP-SGD contract and state of a private Keras model.

A `DPOptimizer` wraps any Keras 3 optimizer with a `tfdp.DPSGD` mechanism
(C, σ, the sampler, δ, the accountant and the secret key) and the state of a
logical step (`tfdp.keras.private_update.LogicalStep`). It is only a half of
DP-SGD: the per-example clipping, accumulation, noise and update happen in
the train step of a private model (`tfdp.make_private` / `tfdp.DPModel`),
through `tfdp.keras.private_update`. Which mechanism a `fit` runs under is
`tfdp.keras.mechanism_builder`'s concern. Its own `apply` and
`apply_gradients` always raise, so that a model whose default Keras
`train_step` would apply plain (unclipped, noiseless) gradients fails
loudly instead of training non-privately. The wrapped optimizer's own
`apply`, `apply_gradients` and `stateless_apply` refuse too, except inside
the release (`DPOptimizer.apply_noisy`, which `LogicalStep` and the compat
custom loop call): a `train_step` that hands plain gradients to
`optimizer.inner_optimizer` raises `PlainGradientsError` instead of training
plain SGD under a printed ε.

What is saved: `iterations` (the wrapped optimizer's step counter, i.e. the
noisy updates taken), the wrapped optimizer's slots and the count of passes
a streamed input released steps in. Never saved: the secret key (a graph
constant), and the accumulators, which hold the un-noised clipped sum of the
logical step in progress: they are plain variables outside the optimizer's
`variables`, so no `.keras` file, weights file or Keras checkpoint can
contain an un-noised partial sum. A resumed run does not need them: a
logical step never spans two epochs (`DPModel.fit` discards an unfinished
one, unreleased, at each epoch start), and Keras resumes at an epoch start.
"""

import threading

import keras
from keras.src.utils import tracking

from tfdp.keras import fit_ledger
from tfdp.keras import mechanism_builder as mechanism_builder_lib
from tfdp.keras import optimizer_arguments
from tfdp.keras import private_update
from tfdp.keras import privacy_account as privacy_account_lib

_NOT_PLAIN = (
    "DPOptimizer cannot be used as a plain optimizer: it was asked to apply "
    "gradients that were not clipped per example nor noised (this happens "
    "when a model whose `train_step` is Keras' default is compiled with a "
    "DPOptimizer). Make the model private first: "
    "`model = tfdp.make_private(model)` (or build a `tfdp.DPModel`), then "
    "compile it with the DPOptimizer."
)


_BYPASS = (
    "The optimizer wrapped by a DPOptimizer was asked to apply gradients outside "
    "the private release: only the clipped, noised mean of a logical step may "
    "update the weights, and the ledger counts only those releases. This happens "
    "when a custom `train_step` (or other code) calls "
    "`optimizer.inner_optimizer.apply_gradients(...)` or `.apply(...)` itself. "
    "Leave the update to the private model's `train_step` "
    "(`tfdp.keras.private_update.private_update`), or, in a TF-Privacy custom "
    "loop, to `minimize` / `apply_gradients` of the released gradients."
)

# Set (per thread) while `DPOptimizer.apply_noisy` hands a release to the
# wrapped optimizer. A Python flag, read when the wrapped optimizer's `apply`
# is called: eagerly, or while a train step is traced, so a traced update
# outside the release fails at its tracing, before any update runs.
_RELEASE = threading.local()


class PlainGradientsError(RuntimeError, AssertionError):
    """Raised when gradients that were not released privately would update the weights.

    A `RuntimeError`, tfdp's error for an operation that cannot be made
    private, and an `AssertionError`, the error TF-Privacy's optimizers
    raise when asked to apply gradients that are not their DP gradients.
    """


def _refuse_outside_release(optimizer):
    """Makes `optimizer` (a wrapped one) refuse updates outside `apply_noisy`.

    Wraps its bound `apply` and `stateless_apply` (Keras' `apply_gradients`
    calls `apply`) on the instance. Idempotent: a second DPOptimizer around
    the same optimizer keeps one guard.
    """
    if getattr(optimizer, "_tfdp_release_guard", False):
        return
    apply, stateless_apply = optimizer.apply, optimizer.stateless_apply

    def guarded_apply(grads, trainable_variables=None):
        if not getattr(_RELEASE, "active", False):
            raise PlainGradientsError(_BYPASS)
        return apply(grads, trainable_variables)

    def guarded_stateless_apply(optimizer_variables, grads, trainable_variables):
        if not getattr(_RELEASE, "active", False):
            raise PlainGradientsError(_BYPASS)
        return stateless_apply(optimizer_variables, grads, trainable_variables)

    optimizer.apply = guarded_apply
    optimizer.stateless_apply = guarded_stateless_apply
    optimizer._tfdp_release_guard = True


def _request_property(name, doc):
    """A read-only property: the mechanism builder's `name` (the request, or the fit's)."""
    return property(lambda self: getattr(self.mechanism_builder, name), doc=doc)


@keras.saving.register_keras_serializable(package="tfdp")
class DPOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer with a DP-SGD mechanism and virtual steps.

    Use it with a private model only:

    ```python
    model = tfdp.make_private(tfdp.models.small_convnet())
    model.compile(
        optimizer=tfdp.DPOptimizer(
            keras.optimizers.SGD(0.5, momentum=0.9),
            l2_norm_clip=1.0, noise_multiplier=1.1,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(x, y, batch_size=250, epochs=15)  # Poisson batches, q = 250/N.
    ```

    docs/KERAS.md shows it with a mechanism built beforehand (e.g.
    calibrated to a target ε) and with user-level privacy.

    Each logical (noisy) step sums its privacy units' clipped gradients over
    one or more `fit` batches, adds Gaussian noise of std σ·C once, divides
    by the public expected logical batch size B and updates the wrapped
    optimizer once; `iterations` counts these steps. How `fit` draws the
    steps (Poisson or shuffled batches of arrays, a stream's batches,
    Poisson-sampled users) and accounts them is in `DPModel.fit` and
    docs/KERAS.md.

    Args:
        optimizer: `keras.optimizers.Optimizer` (or its identifier, e.g.
            `"sgd"`). The optimizer applied once per logical step.
        l2_norm_clip: float. Clipping bound C > 0 of each privacy unit's
            gradient (without `mechanism`).
        noise_multiplier: float. σ >= 0; the noise std on the clipped sum
            of a logical batch is σ·C (without `mechanism`).
        mechanism: `tfdp.DPSGD` or None. The whole privacy contract; then
            pass none of the privacy arguments here. Its sampler fixes N and
            B (fit's `batch_size` is the physical batch). Defaults to `None`:
            `fit` builds one from the arguments here and its inputs.
        gradient_accumulation_steps: int. k >= 1: `fit` batches per logical
            step, for shuffled or streamed batches; with the default
            `expected_batch_size`, B = k × `batch_size` (k × `batch_size` /
            `max_examples_per_user` users under `privacy_unit="user"`).
            Defaults to `1`.
        method: str. Clipping method of `tfdp.dp.clipped_grad_sum`
            (`"auto"`, `"bk"`, `"mixed"`, `"ghost"`, `"vectorized"`,
            `"naive"`). Defaults to `"auto"`.
        expected_batch_size: int or None. B: the expected (Poisson) or exact
            (shuffle) logical batch size and the divisor of the noisy sum,
            in privacy units (users under `privacy_unit="user"`); public,
            never the realised size. Defaults to `None`: from the `fit`
            batch size (taken from `fit(batch_size=...)`, a batched
            `tf.data.Dataset`'s batch dimension or its first batch, or
            Keras' default of 32 for arrays), as above.
        weight_decay: float. In-loss L2 coefficient on conv/dense kernels,
            clipped with the gradient (Kurakin et al. 2022). Defaults to `0`.
        insecure_reproducible_seed: int or None. INSECURE, for tests and
            reproducible research: derive the noise and sampling key from
            this public seed. No ε holds against anyone who knows it; it
            warns. Defaults to `None`: a secret key drawn from the OS's
            entropy when the optimizer is created. The key is never saved
            (not in `.keras` files, weights or configs), so a run resumed
            from a Keras checkpoint continues with a fresh secret key.
        dataset_size: int or None. N, in privacy units. Defaults to `None`:
            the length of the arrays given to `fit` (their number of users
            under `privacy_unit="user"`); needed for a tf.data input's
            ledger.
        delta: float or None. δ of the ledger. Defaults to `None`:
            `tfdp.privacy.default_delta(N)`, min(1e-5, the largest power of
            ten below 1/N), as on every route.
        sampler: str or None. A registered sampler (`tfdp.samplers.names()`)
            of the privacy unit: `"poisson"` or `"shuffle"` for examples,
            `"user_poisson"` for users. Defaults to `None`: `"poisson"` for
            arrays (`"shuffle"` accounting with `fit(shuffle=False)`),
            `"shuffle"` for a tf.data input, `"user_poisson"` for users.
        accountant: str. `"rdp"` or `"pld"`. Defaults to `"rdp"`.
        privacy_unit: str. What ε protects: `"example"` (one example) or
            `"user"` (all the examples of one user; `fit` then needs
            `user_ids=`). Defaults to `"example"`.
        max_examples_per_user: int or None. k, required with
            `privacy_unit="user"`: the most examples of a drawn user in a
            logical step, chosen at random with the secret key (the others
            sit that step out). The `fit` batch size must be a multiple of
            it. Defaults to `None`.
        bands: int. b >= 1: banded matrix-factorization noise over b secret
            groups of the arrays ("banded_poisson"), or of the users under
            `privacy_unit="user"` ("banded_user_poisson"; docs/PRIVACY.md).
            Its state is never saved: no resume from a Keras checkpoint.
            Defaults to `1`: DP-SGD.
        band_coefficients: sequence of b floats or None. The strategy's
            coefficients. Defaults to `None`: the banded square root.
        target_epsilon: float or None. A budget for the given σ: `fit`
            releases no logical step that would take ε at `delta` above it
            (warned once where it cuts the planned steps). Defaults to
            `None`: no budget (a `tfdp.callbacks.PrivacyBudget` can add one).
        hardened_noise: bool. Noise hardened against floating-point attacks
            on the release (docs/PRIVACY.md, "Floating-point noise"): the
            same std σ·C and ε, drawn in float64 and rounded once. Defaults
            to `False`.
        clipping: str. How each privacy unit's gradient g is bounded:
            "standard", min(1, C/‖g‖)·g; or "automatic" (Bu et al. 2023),
            C·g/(‖g‖ + γ), of norm below C: the same ε, and no C to tune (it
            scales the update like the learning rate). Defaults to
            "standard".
        clipping_gamma: float. γ > 0 of automatic clipping. Defaults to
            0.01.
        noise_scheme: str or None. The noise each logical step releases: a
            registered noise scheme (`tfdp.DPSGDConfig.noise_scheme`), e.g.
            "gaussian" or "banded". Defaults to `None`: "banded" at
            bands > 1, else "gaussian".
        num_microbatches: must be `None`: each privacy unit is clipped
            alone; use `gradient_accumulation_steps` for virtual steps.
        name: str or None. Optimizer name.
    """

    def __init__(
        self,
        optimizer,
        l2_norm_clip=None,
        noise_multiplier=None,
        *,
        mechanism=None,
        gradient_accumulation_steps=1,
        method="auto",
        expected_batch_size=None,
        weight_decay=0.0,
        insecure_reproducible_seed=None,
        dataset_size=None,
        delta=None,
        sampler=None,
        accountant="rdp",
        privacy_unit="example",
        max_examples_per_user=None,
        bands=1,
        band_coefficients=None,
        target_epsilon=None,
        hardened_noise=False,
        clipping="standard",
        clipping_gamma=0.01,
        noise_scheme=None,
        num_microbatches=None,
        name=None,
        **kwargs,
    ):
        optimizer = optimizer_arguments.check(
            optimizer, kwargs, wrapper_class=DPOptimizer, num_microbatches=num_microbatches,
            gradient_accumulation_steps=gradient_accumulation_steps, method=method)
        k = gradient_accumulation_steps
        builder = mechanism_builder_lib.MechanismBuilder(
            l2_norm_clip, noise_multiplier, mechanism=mechanism,
            expected_batch_size=expected_batch_size,
            insecure_reproducible_seed=insecure_reproducible_seed,
            dataset_size=dataset_size, delta=delta, sampler=sampler, accountant=accountant,
            privacy_unit=privacy_unit, max_examples_per_user=max_examples_per_user,
            gradient_accumulation_steps=k, bands=bands, band_coefficients=band_coefficients,
            target_epsilon=target_epsilon, hardened_noise=hardened_noise,
            clipping=clipping, clipping_gamma=clipping_gamma, noise_scheme=noise_scheme,
        )
        super().__init__(learning_rate=0.0, name=name)
        # Plain gradients handed to the wrapped optimizer directly are refused.
        _refuse_outside_release(optimizer)
        self.inner_optimizer = optimizer
        self.accumulation_steps = k
        self.method = method
        self.weight_decay = float(weight_decay)
        self.mechanism_builder = builder
        self.account = privacy_account_lib.PrivacyAccount()
        # The logical step in progress: deliberately not optimizer variables
        # (never saved).
        self.logical_step = private_update.LogicalStep(self)

    l2_norm_clip = _request_property("l2_norm_clip", 'C, the clipping bound.')
    noise_multiplier = _request_property("noise_multiplier", 'σ, the noise multiplier.')
    accountant = _request_property("accountant", '"rdp" or "pld".')
    expected_batch_size = _request_property("expected_batch_size", "B asked for, or None.")
    dataset_size = _request_property("dataset_size", 'N as asked for, or None: from `fit`.')
    sampler = _request_property("sampler", 'The sampler asked for, or None.')
    privacy_unit = _request_property("privacy_unit", '"example" or "user".')
    bands = _request_property("bands", 'b (1: DP-SGD).')
    max_examples_per_user = _request_property("max_examples_per_user", 'k, or None.')
    hardened_noise = _request_property("hardened_noise", 'Whether the noise is hardened.')
    fit_route = _request_property("fit_route", "The last `fit`'s route, or None.")

    @property
    def mechanism(self):
        """The `tfdp.DPSGD` of the last `fit` (or the one given); None before."""
        return self.mechanism_builder.current

    @property
    def delta(self):
        """δ of the mechanism in use; before a `fit`, the δ asked for (or None)."""
        mechanism = self.mechanism
        return mechanism.delta if mechanism is not None else self.mechanism_builder.delta

    @property
    def insecure_reproducible_seed(self):
        """The public seed of an INSECURE key, or None for a secret key."""
        return self.mechanism_builder.secret_key.insecure_seed

    @property
    def sampling_key(self):
        """The secret sampling sub-key (a graph constant, never saved)."""
        return self.mechanism_builder.secret_key.derive("sampling")

    @property
    def logical_batch_size(self):
        """B (the divisor) of the mechanism in use, or None before `fit`."""
        if self.mechanism_builder.fit_route is None:
            return None
        return self.mechanism.expected_batch_size

    @property
    def group_size(self):
        """Rows of one privacy unit in a physical batch (k for users, else 1)."""
        route = self.fit_route
        return 1 if route is None else route.group_size

    def clipping_groups(self, x, batch_size=None):
        """`(x, rows)`: the batch `x`, and its consecutive rows clipped as one unit.

        One row per example; under `privacy_unit="user"` a user's block of
        `max_examples_per_user` rows (`group_size`). A subclass that clips
        other groups of rows (knowing the `fit` `batch_size`) also sets
        `sensitivity`.
        """
        return x, self.group_size

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        # Passes of a streamed input that released a step: a count, saved.
        self.passes = self.add_variable(
            shape=(), dtype="int", initializer="zeros", name="dp_passes"
        )
        self.account.build(self.passes)
        # Un-noised clipped sums, never written to a `.keras` file, weights or
        # a Keras checkpoint. Under a strategy each replica sums its own rows
        # (as the trainer's `PrivateTrainStep`); the optimizer's all-reduce
        # adds them up.
        self.logical_step.build(var_list)
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def iterations(self):
        """Logical (noisy) steps taken: the wrapped optimizer's counter."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def scale_loss(self, loss):
        return loss

    def apply_gradients(self, grads_and_vars):
        raise PlainGradientsError(_NOT_PLAIN)

    def apply(self, grads, trainable_variables=None):
        raise PlainGradientsError(_NOT_PLAIN)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise PlainGradientsError(_NOT_PLAIN)

    def apply_noisy(self, grads, variables):
        """Applies a private release through the wrapped optimizer: the one way to update.

        Called by the release of a logical step (`LogicalStep`) and by the
        compat custom loop with the gradients it released; the wrapped
        optimizer refuses any other call (`PlainGradientsError`).

        Args:
            grads: list of tensors. The released (noised) gradients.
            variables: list of variables, one per gradient.
        """
        previous = getattr(_RELEASE, "active", False)
        _RELEASE.active = True
        try:
            self.inner_optimizer.apply(grads, variables)
        finally:
            _RELEASE.active = previous

    @property
    def counts_passes(self):
        """Whether the ledger counts the passes of a streamed input."""
        return self.fit_route is not None and self.fit_route.counts_passes

    def start_epoch(self):
        """Discards the unfinished logical step, unreleased (eager).

        `DPModel.fit` calls it at each epoch start, so that a logical step
        never spans two epochs (no example twice in one step).
        """
        self.logical_step.start_epoch()
        self.account.start_epoch()

    def accounted_steps(self, pass_steps=None):
        """The step count the ledger composes.

        `iterations`, or for a streamed input at least one whole pass per
        epoch that released a step: the per-pass bound counts passes, and a
        stream's epochs may hold fewer than N // B steps.
        """
        return self.account.accounted_steps(int(self.iterations.numpy()), pass_steps)

    def accounting_mechanism(self, dataset_size=None, delta=None):
        """The `tfdp.DPSGD` the ledger accounts, with N or δ overridden if asked."""
        return fit_ledger.accounting_mechanism(self.mechanism_builder, dataset_size, delta)

    def ledger(self, *, dataset_size=None, delta=None, steps=None):
        """The `tfdp.privacy.PrivacyLedger` of this run so far (`tfdp.keras.fit_ledger.ledger`).

        `dataset_size` and `delta` override N and δ; `steps` defaults to the
        accounted steps (`accounted_steps`).
        """
        return fit_ledger.ledger(self, dataset_size=dataset_size, delta=delta, steps=steps)

    # Layer weight regularizers are refused unless a subclass adds their
    # gradient in `final_gradients` (the native route has `weight_decay`).
    applies_weight_regularizers = False

    def final_gradients(self, noisy_mean, variables):
        """The gradients the wrapped optimizer applies: the noisy mean, by default."""
        return noisy_mean

    @property
    def sensitivity(self):
        """How far one privacy unit moves a step's clipped sum, in units of C: 1.

        Each unit (an example, or a user's block) is clipped alone to C. A
        subclass whose `clipping_groups` clip several units together
        overrides it.
        """
        return 1

    def describe_epsilon(self, *, dataset_size=None, delta=None, steps=None, epsilon=None,
                         brief=False):
        """One line: ε, δ, the neighbouring relation and, for users, the unit's bounds.

        See `tfdp.keras.fit_ledger.describe_epsilon`; `dataset_size`,
        `delta` and `steps` as `ledger`.
        """
        ledger = self.ledger(dataset_size=dataset_size, delta=delta, steps=steps)
        return fit_ledger.describe_epsilon(ledger, self.max_examples_per_user,
                                           epsilon=epsilon, brief=brief)

    def example_level_claim(self, *, dataset_size=None, delta=None, steps=None):
        """Under users: what example-level accounting would claim for a user.

        See `tfdp.keras.fit_ledger.example_level_claim`.
        """
        return fit_ledger.example_level_claim(self, dataset_size=dataset_size, delta=delta,
                                              steps=steps)

    def set_budget(self, max_steps, pass_steps=0):
        """Caps the released steps (`PrivacyBudget`); -1 removes the cap."""
        self.account.set_budget(max_steps, pass_steps)

    def get_config(self):
        # A given mechanism is saved as its public parameters; the key never.
        config = {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "gradient_accumulation_steps": self.accumulation_steps,
            "method": self.method,
            "weight_decay": self.weight_decay,
        }
        config.update(self.mechanism_builder.config())
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        # Files saved before the noise became secret hold a public `seed`;
        # the restored optimizer draws a fresh secret key instead.
        config.pop("seed", None)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(optimizer, **config)
