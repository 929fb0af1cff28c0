"""`DPOptimizer`: the DP-SGD contract and state of a private Keras model.

A `DPOptimizer` wraps any Keras 3 optimizer with a `tfdp.DPSGD` mechanism
(C, σ, the sampler, δ, the accountant and the secret key) and the state of a
logical step. It is only a half of DP-SGD: the per-example clipping happens
in the train step of a private model (`tfdp.make_private` / `tfdp.DPModel`),
which hands it clipped gradient sums. Its stages, in order:

1. `accumulate_clipped_sum`: adds a physical batch's clipped sum to the
   logical step's;
2. `noisy_mean` (at the end of a logical step): adds Gaussian noise of std
   σ·C once and divides by the public expected batch size B, with the
   mechanism's shared `tfdp.dp.noisy_aggregator.NoisyAggregator` (the same
   code as the trainer's);
3. the wrapped optimizer's update, unless the budget or a stream's pass
   count refuses the step (`tfdp.keras.privacy_account.PrivacyAccount`).

Which mechanism a `fit` runs under is `tfdp.keras.mechanism_builder`'s
concern. Its own `apply` and `apply_gradients` always raise, so that a model
whose default Keras `train_step` would apply plain (unclipped, noiseless)
gradients fails loudly instead of training non-privately.

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


import keras
import tensorflow as tf
from keras.src.utils import tracking

from tfdp import distribute
from tfdp import privacy
from tfdp.dp import clipping
from tfdp.keras import mechanism_builder as mechanism_builder_lib
from tfdp.keras import privacy_account as privacy_account_lib

_NOT_PLAIN = (
    "DPOptimizer cannot be used as a plain optimizer: it was asked to apply "
    "gradients that were not clipped per example nor noised (this happens "
    "when a model whose `train_step` is Keras' default is compiled with a "
    "DPOptimizer). Make the model private first: "
    "`model = tfdp.make_private(model)` (or build a `tfdp.DPModel`), then "
    "compile it with the DPOptimizer."
)


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

    or with a mechanism built beforehand (e.g. calibrated to a target ε):

    ```python
    mechanism = tfdp.DPSGD(1.0, target_epsilon=3.0, steps=15 * len(x) // 250,
                           sampler=tfdp.samplers.make_sampler(
                               "poisson", dataset_size=len(x), logical_batch_size=250))
    model.compile(optimizer=tfdp.DPOptimizer("sgd", mechanism=mechanism), ...)
    ```

    or, to protect all the examples of each user (user-level DP):

    ```python
    optimizer = tfdp.DPOptimizer("sgd", 1.0, 1.1, privacy_unit="user",
                                 max_examples_per_user=4)
    model.fit(x, y, user_ids=user_of_each_example, batch_size=64)
    ```

    Each logical (noisy) step sums its privacy units' clipped gradients over
    one or more `fit` batches, adds Gaussian noise of std σ·C once, divides
    by the public expected logical batch size B and updates the wrapped
    optimizer once; `iterations` counts these steps. How the steps are
    drawn (see `DPModel.fit` and docs/KERAS.md):

    - arrays with `sampler="poisson"` (the default for arrays): each step
      holds each example independently with probability q = B/N, drawn with
      the mechanism's secret sampling key, in `fit` batches of
      `batch_size` padded with weight-0 examples; accounted with
      amplification by sampling;
    - arrays with `sampler="shuffle"`, or `fit(shuffle=False)`: N // B steps
      of exactly B examples per pass, in a secret random (or the arrays')
      order; a tf.data input: the dataset's own batches, k per step, a step
      never spanning two epochs. Accounted with no amplification (one
      Gaussian mechanism per pass), which holds for any order;
    - arrays with `privacy_unit="user"`: each step holds each user
      independently with probability q = B/N (N users, B the expected users
      per step), each drawn user with at most `max_examples_per_user` of
      their examples, whose mean gradient is clipped to C as one vector;
      accounted with amplification, for adding or removing one user's data.

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
        num_microbatches: must be `None`. tfdp always clips per example
            (TF-Privacy's `num_microbatches == batch_size`); use
            `gradient_accumulation_steps` for virtual steps.
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
        num_microbatches=None,
        name=None,
        **kwargs,
    ):
        if "seed" in kwargs:
            raise ValueError(
                "DPOptimizer takes no `seed`: the noise comes from a secret key "
                "drawn from the OS's entropy, so that no one who knows the "
                "configuration can subtract it. For tests only, pass "
                "`insecure_reproducible_seed=`. "
                f"Received: seed={kwargs['seed']!r}"
            )
        if kwargs:
            raise ValueError(
                "DPOptimizer does not take base optimizer arguments; set them "
                f"on the wrapped optimizer. Received: {sorted(kwargs)}"
            )
        if num_microbatches is not None:
            raise ValueError(
                "tfdp always clips per example (num_microbatches equal to the "
                "batch size). For several batches per noisy update use "
                "`gradient_accumulation_steps`. "
                f"Received: num_microbatches={num_microbatches}"
            )
        optimizer = keras.optimizers.get(optimizer)
        if isinstance(optimizer, DPOptimizer):
            raise ValueError("DPOptimizer cannot wrap another DPOptimizer.")
        if getattr(optimizer, "gradient_accumulation_steps", None):
            raise ValueError(
                "Set virtual steps on the DPOptimizer "
                "(`gradient_accumulation_steps=`), not on the wrapped "
                "optimizer, whose accumulation would average noisy updates. "
                "Received: optimizer.gradient_accumulation_steps="
                f"{optimizer.gradient_accumulation_steps}"
            )
        k = gradient_accumulation_steps
        if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
            raise ValueError(
                "gradient_accumulation_steps must be an int >= 1. "
                f"Received: gradient_accumulation_steps={k}"
            )
        builder = mechanism_builder_lib.MechanismBuilder(
            l2_norm_clip, noise_multiplier, mechanism=mechanism,
            expected_batch_size=expected_batch_size,
            insecure_reproducible_seed=insecure_reproducible_seed,
            dataset_size=dataset_size, delta=delta, sampler=sampler, accountant=accountant,
            privacy_unit=privacy_unit, max_examples_per_user=max_examples_per_user,
            gradient_accumulation_steps=k,
        )
        if method not in clipping.METHODS:
            raise ValueError(
                f"Unknown clipping method. Expected one of {clipping.METHODS}. "
                f"Received: method={method!r}"
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = optimizer
        self.accumulation_steps = k
        self.method = method
        self.weight_decay = float(weight_decay)
        self.mechanism_builder = builder
        self.account = privacy_account_lib.PrivacyAccount()
        # The logical step in progress, deliberately not optimizer variables
        # (never saved): its physical batches so far, and the first step of
        # this epoch (read by the array pipelines). Under a strategy every
        # replica counts its own batches alike, with no communication.
        self._micro_step = distribute.replica_local_variable(
            tf.constant(0, tf.int64), "dp_micro_step", aggregation="first")
        self._epoch_first_step = distribute.replica_local_variable(
            tf.constant(0, tf.int64), "dp_epoch_first_step", aggregation="first")

    # ------------------------------------------------------------------
    # The privacy contract (read from the mechanism).
    # ------------------------------------------------------------------

    @property
    def mechanism(self):
        """The `tfdp.DPSGD` of the last `fit` (or the one given); None before."""
        return self.mechanism_builder.current

    @property
    def l2_norm_clip(self):
        """C, the mechanism's clipping bound."""
        return self.mechanism_builder.l2_norm_clip

    @property
    def noise_multiplier(self):
        """σ, the mechanism's noise multiplier."""
        return self.mechanism_builder.noise_multiplier

    @property
    def accountant(self):
        """The mechanism's accountant ("rdp" or "pld")."""
        return self.mechanism_builder.accountant

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
    def expected_batch_size(self):
        """B as asked for (privacy units per logical step), or None: from `fit`."""
        return self.mechanism_builder.expected_batch_size

    @property
    def dataset_size(self):
        """N as asked for (privacy units), or None: from `fit`'s arrays."""
        return self.mechanism_builder.dataset_size

    @property
    def sampler(self):
        """The sampler name asked for, or None: the route's default."""
        return self.mechanism_builder.sampler

    @property
    def privacy_unit(self):
        """What ε protects: "example", or "user" (all of one user's data)."""
        return self.mechanism_builder.privacy_unit

    @property
    def max_examples_per_user(self):
        """k under `privacy_unit="user"`, else None."""
        return self.mechanism_builder.max_examples_per_user

    @property
    def logical_batch_size(self):
        """B (the divisor) of the mechanism in use, or None before `fit`."""
        if self.mechanism_builder.fit_plan is None:
            return None
        return self.mechanism.expected_batch_size

    @property
    def fit_plan(self):
        """The `tfdp.keras.fit_plan.FitPlan` of the last `fit`, or None."""
        return self.mechanism_builder.fit_plan

    @property
    def group_size(self):
        """Rows of one privacy unit in a physical batch (k for users, else 1)."""
        plan = self.fit_plan
        return 1 if plan is None else plan.group_size

    def has_replica_local_state(self):
        """Whether the step's state has one copy per replica of the strategy in scope.

        True on one replica; under a multi-replica strategy only for an
        optimizer created inside its scope.
        """
        return distribute.is_replica_local(self._micro_step)

    @property
    def epoch_first_step(self):
        """The int64 variable holding this epoch's first logical step."""
        return self._epoch_first_step

    # ------------------------------------------------------------------
    # Variables and delegation.
    # ------------------------------------------------------------------

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        # Passes of a streamed input that released a step: a count, saved.
        self.passes = self.add_variable(
            shape=(), dtype="int", initializer="zeros", name="dp_passes"
        )
        self.account.build(self.passes)
        # Un-noised clipped sums: plain variables, not in `self.variables`,
        # so never written to a `.keras` file, weights or a Keras checkpoint.
        # Under a strategy each replica sums its own rows (as the trainer's
        # `PrivateTrainStep`); the optimizer's all-reduce adds them up.
        self._accumulators = [
            distribute.replica_local_variable(tf.zeros(v.shape, v.dtype), "dp_accumulator")
            for v in var_list
        ]
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

    # ------------------------------------------------------------------
    # Never a plain optimizer.
    # ------------------------------------------------------------------

    def apply_gradients(self, grads_and_vars):
        raise RuntimeError(_NOT_PLAIN)

    def apply(self, grads, trainable_variables=None):
        raise RuntimeError(_NOT_PLAIN)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise RuntimeError(_NOT_PLAIN)

    # ------------------------------------------------------------------
    # The mechanism of a fit call.
    # ------------------------------------------------------------------

    def plan_fit(self, *, arrays, dataset_size=None, physical_batch_size=None, shuffle=True,
                 user_ids=None):
        """Fixes the mechanism and the batches of a `fit` call (eager).

        Args:
            arrays: bool. Whether `fit` got arrays (random access), which
                tfdp batches itself; else a stream of the user's batches.
            dataset_size: int or None. N of the arrays, in privacy units
                (their number of users under `privacy_unit="user"`).
            physical_batch_size: int or None. The `fit` batch size.
            shuffle: bool. `fit(shuffle=...)`.
            user_ids: int array `[n]` or None. Each example's user, in
                [0, N), under `privacy_unit="user"`.

        Returns:
            A `tfdp.keras.fit_plan.FitPlan`.

        Raises:
            ValueError: for a streamed input with a sampler that needs random
                access, for `shuffle=False` with an amplified sampler, for
                missing sizes or user ids.
        """
        plan = self.mechanism_builder.plan(
            arrays=arrays, dataset_size=dataset_size, physical_batch_size=physical_batch_size,
            shuffle=shuffle, user_ids=user_ids)
        n = plan.sampler.dataset_size if plan.sampler is not None else None
        # A stream is trusted to hold each example at most once per pass;
        # its passes are counted against N (see `check_pass`).
        self.account.set_route(plan.counts_passes, n if plan.counts_passes else None)
        return plan

    @property
    def counts_passes(self):
        """Whether the ledger counts the passes of a streamed input."""
        return self.fit_plan is not None and self.fit_plan.counts_passes

    @property
    def pass_limit(self):
        """The most examples one pass of a stream may hold (N), or None."""
        return self.account.pass_limit

    def start_epoch(self):
        """Discards the unfinished logical step, unreleased (eager).

        `DPModel.fit` calls it at each epoch start, so that a logical step
        never spans two epochs (no example twice in one step).
        """
        self._micro_step.assign(0)
        self._epoch_first_step.assign(tf.cast(self.iterations, tf.int64))
        self.account.start_epoch()

    def check_pass(self):
        """Raises once a stream's pass has delivered more than N examples (eager).

        See `tfdp.keras.privacy_account.PrivacyAccount.check_pass`.
        """
        self.account.check_pass()

    # ------------------------------------------------------------------
    # The DP step (called by `private_update` only, in the traced train step).
    # ------------------------------------------------------------------

    def dp_accumulate(self, clipped_sum, variables, last=None, examples=None, release=True):
        """Adds one batch's clipped sum; at the end of a logical step, releases.

        Args:
            clipped_sum: list of tensors. Σ_i clip(g_i) of the batch, one
                clipped term per privacy unit.
            variables: the trainable variables to update.
            last: bool scalar tensor or None. True on the last physical batch
                of a logical step (tfdp's array batches); None for a stream,
                whose steps are k consecutive batches of one epoch.
            examples: int scalar tensor or None. The batch's examples
                (weight > 0), counted against N for a stream (`check_pass`).
            release: bool. End the logical step here, on its `last` batch.
                False under several replicas: the caller ends it with
                `release_step`, since the optimizer's all-reduce cannot run
                inside the train step's control flow. Defaults to `True`.
        """
        if not self.built:
            raise RuntimeError(
                "DPOptimizer is not built; it is built by `fit` (or call "
                "`optimizer.build(model.trainable_variables)`)."
            )
        if self.mechanism_builder.aggregator is None:
            raise RuntimeError(
                "The DPOptimizer has no mechanism yet: train a private model "
                "with `fit`, which fixes it from its inputs."
            )
        if examples is not None:
            self.account.count_examples(examples)
        self.accumulate_clipped_sum(clipped_sum)
        if not release:
            return
        if last is None:
            end = self._micro_step >= self.accumulation_steps
        else:
            end = tf.cast(last, tf.bool)

        def end_logical_step():
            self._release_or_drop(variables)
            self._micro_step.assign(0)
            return tf.constant(True)

        tf.cond(end, end_logical_step, lambda: tf.constant(False))

    def release_step(self, strategy, variables):
        """Ends a logical step on every replica of `strategy` (eager, cross-replica).

        The step's last batch was accumulated with `release=False`. As
        `dp_accumulate` would: the wrapped optimizer's update with the noisy
        mean, unless the account refuses the step (then nothing of it is
        released); either way the next batch starts a new step. Each
        replica hands the optimizer its own sum plus its share of the one
        noise draw, and the optimizer all-reduces them with a SUM: the
        one-device update.

        Args:
            strategy: the `tf.distribute` strategy of the train step.
            variables: the trainable variables to update.
        """
        if bool(self.account.release_allowed(tf.cast(self.iterations, tf.int64))):
            release = getattr(self, "_replica_release_fn", None)
            if release is None:
                def replica_release():
                    step = tf.cast(self.iterations, tf.int64)
                    self.inner_optimizer.apply(self.noisy_mean(step), variables)
                    self.account.record_release()

                release = tf.function(lambda: strategy.run(replica_release), autograph=False)
                self._replica_release_fn = release
            release()
        self._micro_step.assign(0)

    def accumulate_clipped_sum(self, clipped_sum):
        """Stage 1: adds a physical batch's clipped sum to the logical step's."""
        self.mechanism_builder.aggregator.accumulate(
            self._accumulators, clipped_sum, first=tf.equal(self._micro_step, 0))
        self._micro_step.assign_add(1)

    def noisy_mean(self, step):
        """Stage 2: the logical step's sum plus N(0, (σC)²) once, divided by B.

        On R replicas each replica returns `(local_sum + noise / R) / B` of
        one common draw; the wrapped optimizer's cross-replica SUM then
        applies the one-device update, with the noise counted once.
        """
        context = tf.distribute.get_replica_context()
        replicas = 1 if context is None else context.num_replicas_in_sync
        return self.mechanism_builder.aggregator.noisy_mean(
            self._accumulators, step, num_replicas=replicas)

    def _release_or_drop(self, variables):
        """Stage 3: the wrapped optimizer's update, unless the account refuses it.

        Over budget, or in a pass above N, the logical step is dropped:
        nothing of it is released.
        """
        step = tf.cast(self.iterations, tf.int64)

        def release():
            self.inner_optimizer.apply(self.noisy_mean(step), variables)
            self.account.record_release()
            return tf.constant(True)

        tf.cond(self.account.release_allowed(step), release, lambda: tf.constant(False))

    # ------------------------------------------------------------------
    # Privacy accounting.
    # ------------------------------------------------------------------

    def accounted_steps(self, pass_steps=None):
        """The step count the ledger composes.

        `iterations`, or for a streamed input at least one whole pass per
        epoch that released a step: the per-pass bound counts passes, and a
        stream's epochs may hold fewer than N // B steps.
        """
        return self.account.accounted_steps(int(self.iterations.numpy()), pass_steps)

    def accounting_mechanism(self, dataset_size=None, delta=None):
        """The `tfdp.DPSGD` the ledger accounts, with N or δ overridden if asked."""
        return self.mechanism_builder.accounting_mechanism(dataset_size, delta)

    def ledger(self, *, dataset_size=None, delta=None, steps=None):
        """The `tfdp.privacy.PrivacyLedger` of this run so far.

        Args:
            dataset_size: int or None. Overrides N (privacy units).
            delta: float or None. Overrides δ.
            steps: int or None. Defaults to the accounted steps (the noisy
                updates; see `accounted_steps`).

        Returns:
            A `PrivacyLedger` whose `epsilon()` is ε after `steps`, for the
            neighbouring relation of its sampler (`ledger.privacy_unit`
            says what it protects).
        """
        mech = self.accounting_mechanism(dataset_size, delta)
        if steps is None:
            steps = self.accounted_steps(mech.sampler.steps_per_epoch)
        return mech.ledger(steps, sensitivity=self.sensitivity)

    @property
    def sensitivity(self):
        """How far one privacy unit moves a step's clipped sum, in units of C: 1.

        Each unit (an example, or a user's block) is clipped alone to C.
        `tfdp.compat.tensorflow_privacy`'s microbatches override it.
        """
        return 1

    def describe_epsilon(self, *, dataset_size=None, delta=None, steps=None, epsilon=None,
                         brief=False):
        """One line: ε, δ, the neighbouring relation and, for users, the unit's bounds.

        Args:
            dataset_size, delta, steps: as `ledger`.
            epsilon: float or None. ε already computed for these steps.
            brief: bool. Name the relation without its description.

        Returns:
            A str, e.g. `epsilon=2.01 at delta=1e-05 (add_or_remove_one_user
            adjacency: ...); privacy unit: user (N=500 users, at most 4
            examples of a user per step); for comparison, example-level
            accounting with group privacy for 4 examples would claim
            epsilon=... at delta=...` (the comparison not when `brief`).
        """
        ledger = self.ledger(dataset_size=dataset_size, delta=delta, steps=steps)
        text = ledger.describe_epsilon(epsilon, brief=brief)
        if ledger.privacy_unit == "example":
            return text
        text = (f"{text}; privacy unit: {ledger.privacy_unit} (N={ledger.dataset_size} "
                f"{ledger.privacy_unit}s, at most {self.max_examples_per_user} examples of "
                f"a {ledger.privacy_unit} per step)")
        if brief:
            return text
        claim = privacy.example_level_claim(ledger, self.max_examples_per_user)
        return f"{text}; for comparison, {privacy.describe_example_level_claim(claim)}"

    def example_level_claim(self, *, dataset_size=None, delta=None, steps=None):
        """Under users: what example-level accounting would claim for a user.

        Example-level DP-SGD at the same σ, steps and sampling rate, at the
        ledger's δ, converted by group privacy for `max_examples_per_user`
        examples (`tfdp.privacy.example_level_claim`): the figure a
        user-level run improves on.

        Args:
            dataset_size, delta, steps: as `ledger`.

        Returns:
            The dict of `tfdp.privacy.example_level_claim`.

        Raises:
            ValueError: under `privacy_unit="example"`.
        """
        if self.privacy_unit != "user":
            raise ValueError(
                "example_level_claim compares a user-level run with example-level "
                "accounting. Received: privacy_unit="
                f"{self.privacy_unit!r}")
        ledger = self.ledger(dataset_size=dataset_size, delta=delta, steps=steps)
        return privacy.example_level_claim(ledger, self.max_examples_per_user)

    def set_budget(self, max_steps, pass_steps=0):
        """Caps the released steps (`PrivacyBudget`); -1 removes the cap."""
        self.account.set_budget(max_steps, pass_steps)

    # ------------------------------------------------------------------
    # Serialisation.
    # ------------------------------------------------------------------

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
