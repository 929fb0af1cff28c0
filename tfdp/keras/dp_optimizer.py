"""`DPOptimizer`: the DP-SGD contract and state of a private Keras model.

A `DPOptimizer` wraps any Keras 3 optimizer with a `tfdp.DPSGD` mechanism
(C, σ, the sampler, δ, the accountant and the secret key) and the state of a
logical step. It is only a half of DP-SGD: the per-example clipping happens
in the train step of a private model (`tfdp.make_private` / `tfdp.DPModel`),
which hands it clipped gradient sums; the end of each logical step
(accumulate → noise once → divide) is the mechanism's shared
`tfdp.dp.noisy_aggregator.NoisyAggregator`, the same code as the trainer's.
Its own `apply` and `apply_gradients` always raise, so that a model whose
default Keras `train_step` would apply plain (unclipped, noiseless)
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

from tfdp import mechanism as mechanism_lib
from tfdp import samplers
from tfdp import secret_key as secret_key_lib
from tfdp.dp import clipping
from tfdp.privacy import accounting as privacy_accounting

_NOT_PLAIN = (
    "DPOptimizer cannot be used as a plain optimizer: it was asked to apply "
    "gradients that were not clipped per example nor noised (this happens "
    "when a model whose `train_step` is Keras' default is compiled with a "
    "DPOptimizer). Make the model private first: "
    "`model = tfdp.make_private(model)` (or build a `tfdp.DPModel`), then "
    "compile it with the DPOptimizer."
)

# How `DPModel.fit` feeds the optimizer (see `DPOptimizer.plan_fit`).
# The default samplers: Poisson for arrays in random order, else shuffle
# (the bound that holds for any order).
POISSON = "poisson"
SHUFFLE = "shuffle"
# How `fit` feeds the examples (the route), whatever the sampler:
SAMPLED = "sampled"  # Arrays, batches drawn by the sampler with the secret key.
ORDERED = "ordered"  # Arrays, `shuffle=False`: the arrays' order.
STREAM = "stream"  # A tf.data.Dataset (or other iterable): the user's batches.
ARRAY_ROUTES = (SAMPLED, ORDERED)


class FitPlan:
    """What `DPOptimizer.plan_fit` decided for one `fit` call.

    Args:
        route: str. One of `SAMPLED`, `ORDERED`, `STREAM`.
        sampler: `tfdp.samplers.Sampler` or None. Draws the array routes'
            logical steps, with the fit batch size as physical batch size.
        steps_per_epoch: int or None. Logical steps per Keras epoch (array
            routes).
    """

    def __init__(self, route, sampler, steps_per_epoch):
        self.route = route
        self.sampler = sampler
        self.steps_per_epoch = steps_per_epoch

    @property
    def marks_last_batch(self):
        """Whether the batches carry the `last` flag of their logical step."""
        return self.route in ARRAY_ROUTES

    @property
    def ordered(self):
        """Whether the arrays are taken in their own order (`shuffle=False`)."""
        return self.route == ORDERED

    @property
    def variable_steps(self):
        """Whether the array steps vary in size (so epochs vary in batches)."""
        return self.route in ARRAY_ROUTES and not self.sampler.fixed_size_steps


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

    Each logical (noisy) step sums its examples' clipped gradients over one
    or more `fit` batches, adds Gaussian noise of std σ·C once, divides by
    the public expected logical batch size B and updates the wrapped
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
      Gaussian mechanism per pass), which holds for any order.

    Args:
        optimizer: `keras.optimizers.Optimizer` (or its identifier, e.g.
            `"sgd"`). The optimizer applied once per logical step.
        l2_norm_clip: float. Per-example clipping bound C > 0 (without
            `mechanism`).
        noise_multiplier: float. σ >= 0; the noise std on the clipped sum
            of a logical batch is σ·C (without `mechanism`).
        mechanism: `tfdp.DPSGD` or None. The whole privacy contract; then
            pass none of the privacy arguments here. Its sampler fixes N and
            B (fit's `batch_size` is the physical batch). Defaults to `None`:
            `fit` builds one from the arguments here and its inputs.
        gradient_accumulation_steps: int. k >= 1: `fit` batches per logical
            step, for shuffled or streamed batches; with the default
            `expected_batch_size`, B = k × `batch_size`. Defaults to `1`.
        method: str. Clipping method of `tfdp.dp.clipped_grad_sum`
            (`"auto"`, `"bk"`, `"mixed"`, `"ghost"`, `"vectorized"`,
            `"naive"`). Defaults to `"auto"`.
        expected_batch_size: int or None. B: the expected (Poisson) or exact
            (shuffle) logical batch size and the divisor of the noisy sum;
            public, never the realised size. Defaults to `None`: k times the
            `fit` batch size (taken from `fit(batch_size=...)`, a batched
            `tf.data.Dataset`'s batch dimension or its first batch, or Keras'
            default of 32 for arrays).
        weight_decay: float. In-loss L2 coefficient on conv/dense kernels,
            clipped with the gradient (Kurakin et al. 2022). Defaults to `0`.
        insecure_reproducible_seed: int or None. INSECURE, for tests and
            reproducible research: derive the noise and sampling key from
            this public seed. No ε holds against anyone who knows it; it
            warns. Defaults to `None`: a secret key drawn from the OS's
            entropy when the optimizer is created. The key is never saved
            (not in `.keras` files, weights or configs), so a run resumed
            from a Keras checkpoint continues with a fresh secret key.
        dataset_size: int or None. N. Defaults to `None`: the length of the
            arrays given to `fit`; needed for a tf.data input's ledger.
        delta: float or None. δ of the ledger. Defaults to `None`:
            `tfdp.privacy.default_delta(N)`, min(1e-5, the largest power of
            ten below 1/N), as on every route.
        sampler: str or None. `"poisson"` or `"shuffle"`. Defaults to
            `None`: `"poisson"` for arrays (`"shuffle"` accounting with
            `fit(shuffle=False)`), `"shuffle"` for a tf.data input.
        accountant: str. `"rdp"` or `"pld"`. Defaults to `"rdp"`.
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
        if mechanism is not None:
            if not isinstance(mechanism, mechanism_lib.DPSGD):
                raise ValueError(
                    f"mechanism must be a tfdp.DPSGD. Received: mechanism={mechanism!r}"
                )
            given = {
                "l2_norm_clip": l2_norm_clip, "noise_multiplier": noise_multiplier,
                "expected_batch_size": expected_batch_size,
                "insecure_reproducible_seed": insecure_reproducible_seed,
                "dataset_size": dataset_size, "delta": delta, "sampler": sampler,
            }
            given = sorted(k for k, v in given.items() if v is not None)
            if accountant != "rdp":
                given.append("accountant")
            if given:
                raise ValueError(
                    "Pass the privacy parameters in the mechanism only, so that they "
                    f"are set in one place. Received: a mechanism and {given}"
                )
            l2_norm_clip = mechanism.l2_norm_clip
            noise_multiplier = mechanism.noise_multiplier
            accountant = mechanism.accountant
            secret_key = mechanism.secret_key
        else:
            if l2_norm_clip is None or noise_multiplier is None:
                raise ValueError(
                    "DPOptimizer needs l2_norm_clip and noise_multiplier, or a "
                    "mechanism (tfdp.DPSGD). Received: "
                    f"l2_norm_clip={l2_norm_clip}, noise_multiplier={noise_multiplier}"
                )
            secret_key = secret_key_lib.SecretKey.resolve(
                insecure_seed=insecure_reproducible_seed
            )
            # The contract validates C, σ, B, δ and the accountant now; the
            # mechanism of a fit is built when N and the batch size are known.
            mechanism_lib.DPSGD(
                l2_norm_clip, noise_multiplier,
                delta=delta or privacy_accounting.default_delta(dataset_size),
                accountant=accountant,
                expected_batch_size=1.0 if expected_batch_size is None else expected_batch_size,
                secret_key=secret_key,
            )
        k = gradient_accumulation_steps
        if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
            raise ValueError(
                "gradient_accumulation_steps must be an int >= 1. "
                f"Received: gradient_accumulation_steps={k}"
            )
        if method not in clipping.METHODS:
            raise ValueError(
                f"Unknown clipping method. Expected one of {clipping.METHODS}. "
                f"Received: method={method!r}"
            )
        if sampler not in (None, "shuffle", "poisson"):
            raise ValueError(
                "sampler must be 'poisson', 'shuffle' or None (poisson for arrays, "
                f"shuffle for a tf.data input). Received: sampler={sampler!r}"
            )
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = optimizer
        self.l2_norm_clip = float(l2_norm_clip)
        self.noise_multiplier = float(noise_multiplier)
        self.accumulation_steps = k
        self.method = method
        self.expected_batch_size = (
            None if expected_batch_size is None else float(expected_batch_size)
        )
        self.weight_decay = float(weight_decay)
        self.dataset_size = None if dataset_size is None else int(dataset_size)
        self.delta = None if delta is None else float(delta)
        self.sampler = sampler
        self.accountant = accountant
        self._given_mechanism = mechanism
        self._secret_key = secret_key
        self.insecure_reproducible_seed = self._secret_key.insecure_seed
        # The divisor of the noisy sum when it is not the logical batch size
        # (TF-Privacy's microbatches divide by their number); set by
        # `tfdp.compat.tensorflow_privacy`.
        self._noise_divisor = None
        # Set by `plan_fit`: the mechanism in use, its aggregator and the plan.
        self.mechanism = None
        self._aggregator = None
        self.fit_plan = None
        self._plan_key = None
        # Run-time state, deliberately not optimizer variables (never saved):
        # the physical batches of the logical step in progress, whether this
        # epoch released a step, the first step of this epoch (read by the
        # array pipelines) and the budget set by `PrivacyBudget`.
        self._micro_step = tf.Variable(0, trainable=False, dtype=tf.int64,
                                       name="dp_micro_step")
        self._epoch_released = tf.Variable(False, trainable=False, name="dp_epoch_released")
        self._epoch_first_step = tf.Variable(0, trainable=False, dtype=tf.int64,
                                             name="dp_epoch_first_step")
        self._max_steps_var = tf.Variable(-1, trainable=False, dtype=tf.int64,
                                          name="dp_max_steps")
        self._pass_steps_var = tf.Variable(0, trainable=False, dtype=tf.int64,
                                           name="dp_pass_steps")
        # A stream's examples in this epoch, the most one pass may hold (N;
        # -1: not checked, e.g. tfdp's own array batches) and whether this
        # epoch went over it (then nothing more is released).
        self._pass_examples = tf.Variable(0, trainable=False, dtype=tf.int64,
                                          name="dp_pass_examples")
        self._pass_limit = tf.Variable(-1, trainable=False, dtype=tf.int64,
                                       name="dp_pass_limit")
        self._pass_overflow = tf.Variable(False, trainable=False, name="dp_pass_overflow")

    # ------------------------------------------------------------------
    # Variables and delegation.
    # ------------------------------------------------------------------

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        # Passes of a streamed input that released a step: a count, saved.
        self.passes = self.add_variable(
            shape=(), dtype="int", initializer="zeros", name="dp_passes"
        )
        # Un-noised clipped sums: plain variables, not in `self.variables`,
        # so never written to a `.keras` file, weights or a Keras checkpoint.
        self._accumulators = [
            tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name="dp_accumulator")
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

    def _sampler_name(self):
        given = self._given_mechanism
        if given is not None:
            return given.sampler.name if given.sampler is not None else None
        return self.sampler

    def plan_fit(self, *, arrays, dataset_size=None, physical_batch_size=None, shuffle=True):
        """Fixes the mechanism and the batches of a `fit` call (eager).

        Args:
            arrays: bool. Whether `fit` got arrays (random access), which
                tfdp batches itself; else a stream of the user's batches.
            dataset_size: int or None. N of the arrays.
            physical_batch_size: int or None. The `fit` batch size.
            shuffle: bool. `fit(shuffle=...)`.

        Returns:
            A `FitPlan`.

        Raises:
            ValueError: for a streamed input with the Poisson sampler, for
                `shuffle=False` with it, or for missing sizes.
        """
        name = self._sampler_name()
        if arrays:
            if name is None:
                name = POISSON if shuffle else SHUFFLE
            if samplers.sampler_class(name).amplified and not shuffle:
                raise ValueError(
                    "fit(shuffle=False) asks for a fixed order, but sampler='poisson' "
                    "draws random batches. Use sampler='shuffle' (accounted without "
                    "amplification), or shuffle=True. Received: shuffle=False"
                )
            route = SAMPLED if shuffle else ORDERED
        else:
            if name is not None and samplers.sampler_class(name).needs_random_access:
                raise ValueError(
                    "sampler='poisson' needs random access to the examples: pass "
                    "arrays (numpy or tensors) to fit, which draws the Poisson "
                    "batches itself; a tf.data input is accounted with "
                    "sampler='shuffle'. Received: x of a streamed type"
                )
            route, name = STREAM, SHUFFLE
        k = self.accumulation_steps
        given = self._given_mechanism
        if given is not None:
            batch = given.sampler.logical_batch_size if given.sampler else None
            n = given.sampler.dataset_size if given.sampler else None
            if arrays and given.sampler is None:
                raise ValueError(
                    "fit on arrays draws its batches with the mechanism's sampler; "
                    "build the DPSGD with one. Received: sampler=None"
                )
            if arrays and n != dataset_size:
                raise ValueError(
                    "The mechanism's sampler was made for another dataset size. "
                    f"Received: sampler dataset_size={n}, fit arrays of {dataset_size}"
                )
        else:
            batch = self.expected_batch_size
            if batch is None and physical_batch_size:
                batch = physical_batch_size * k
            if batch is None:
                raise ValueError(
                    "The DPOptimizer needs the logical batch size: pass "
                    "`expected_batch_size=` to it, or `batch_size=` to fit, or a "
                    "dataset with a static batch size. Received: no batch size"
                )
            n = self.dataset_size or dataset_size
            if arrays and n != dataset_size:
                raise ValueError(
                    "fit on arrays samples from the arrays given: N is their length. "
                    f"Received: dataset_size={self.dataset_size}, arrays of {dataset_size}"
                )
        sampler = None
        if route in ARRAY_ROUTES:
            sampler = samplers.make_sampler(
                name, dataset_size=n, logical_batch_size=batch,
                physical_batch_size=physical_batch_size,
            )
        elif n:
            # Accounting only: the per-pass bound needs N and B, not P.
            sampler = samplers.make_sampler(
                name, dataset_size=n, logical_batch_size=batch, physical_batch_size=1
            )
        key = (route, sampler, batch, self.delta, self._noise_divisor)
        if key != self._plan_key:
            if given is not None:
                self.mechanism = given
            else:
                self.mechanism = self._make_mechanism(sampler, batch)
            with tf.init_scope():  # May run while a train step is traced.
                self._aggregator = self.mechanism.aggregator()
            self._plan_key = key
        steps = None
        if sampler is not None and route in ARRAY_ROUTES:
            steps = max(1, int(round(sampler.steps_per_epoch)))
        with tf.init_scope():
            # A stream is trusted to hold each example at most once per pass;
            # its passes are counted against N (see `check_pass`).
            self._pass_limit.assign(n if route == STREAM and n else -1)
        self.fit_plan = FitPlan(route, sampler, steps)
        return self.fit_plan

    def _make_mechanism(self, sampler, batch):
        """A `DPSGD` from this optimizer's arguments, on its secret key."""
        n = sampler.dataset_size if sampler is not None else None
        delta = self.delta or privacy_accounting.default_delta(n)
        if self._noise_divisor is not None:
            # TF-Privacy's microbatch divisor: no ledger (see the compat ledger).
            return mechanism_lib.DPSGD(
                self.l2_norm_clip, self.noise_multiplier, delta=delta,
                expected_batch_size=self._noise_divisor, secret_key=self._secret_key,
            )
        if sampler is None:
            return mechanism_lib.DPSGD(
                self.l2_norm_clip, self.noise_multiplier, delta=delta,
                accountant=self.accountant, expected_batch_size=batch,
                secret_key=self._secret_key,
            )
        return mechanism_lib.DPSGD(
            self.l2_norm_clip, self.noise_multiplier, sampler=sampler, delta=delta,
            accountant=self.accountant, secret_key=self._secret_key,
        )

    @property
    def logical_batch_size(self):
        """B (the divisor) of the mechanism in use, or None before `fit`."""
        if self.mechanism is None:
            return None
        return self.mechanism.expected_batch_size

    @property
    def sampling_key(self):
        """The secret sampling sub-key (a graph constant, never saved)."""
        return self._secret_key.derive("sampling")

    @property
    def counts_passes(self):
        """Whether the ledger counts the passes of a streamed input."""
        return self.fit_plan is not None and self.fit_plan.route == STREAM

    # ------------------------------------------------------------------
    # The DP step (called by `private_update` only).
    # ------------------------------------------------------------------

    def start_epoch(self):
        """Discards the unfinished logical step, unreleased (eager).

        `DPModel.fit` calls it at each epoch start, so that a logical step
        never spans two epochs (no example twice in one step).
        """
        self._micro_step.assign(0)
        self._epoch_released.assign(False)
        self._epoch_first_step.assign(tf.cast(self.iterations, tf.int64))
        self._pass_examples.assign(0)
        self._pass_overflow.assign(False)

    @property
    def pass_limit(self):
        """The most examples one pass of a stream may hold (N), or None."""
        limit = int(self._pass_limit.numpy())
        return None if limit < 0 else limit

    def check_pass(self):
        """Raises once a stream's pass has delivered more than N examples (eager).

        The train step counts each epoch's examples; the batch that takes
        the count above N, and every later one of the epoch, releases
        nothing, so the logical step it belongs to is never applied. `fit`
        calls this after each batch to stop with this error.

        Raises:
            ValueError: naming N and the count.
        """
        if not bool(self._pass_overflow.numpy()):
            return
        raise ValueError(too_many_examples_error(
            int(self._pass_examples.numpy()), int(self._pass_limit.numpy()),
            "The logical step in progress and the rest of the pass were not applied."))

    def _release_allowed(self, step):
        """Whether releasing step `step` stays within `PrivacyBudget`'s cap."""
        new_pass = tf.where(self._epoch_released, tf.constant(0, tf.int64),
                            tf.constant(1, tf.int64))
        passes = tf.cast(self.passes, tf.int64) + new_pass
        accounted = tf.maximum(step + 1, passes * self._pass_steps_var)
        return tf.logical_or(self._max_steps_var < 0, accounted <= self._max_steps_var)

    def dp_accumulate(self, clipped_sum, variables, last=None, examples=None):
        """Adds one batch's clipped sum; at the end of a logical step, releases.

        Runs inside the model's (traced) train step.

        Args:
            clipped_sum: list of tensors. Σ_i clip(g_i) of the batch.
            variables: the trainable variables to update.
            last: bool scalar tensor or None. True on the last physical batch
                of a logical step (tfdp's array batches); None for a stream,
                whose steps are k consecutive batches of one epoch.
            examples: int scalar tensor or None. The batch's examples
                (weight > 0), counted against N for a stream (`check_pass`).
        """
        if not self.built:
            raise RuntimeError(
                "DPOptimizer is not built; it is built by `fit` (or call "
                "`optimizer.build(model.trainable_variables)`)."
            )
        if self._aggregator is None:
            raise RuntimeError(
                "The DPOptimizer has no mechanism yet: train a private model "
                "with `fit`, which fixes it from its inputs."
            )
        aggregator = self._aggregator
        if examples is not None:
            # Counted before anything of this batch can be released: a pass
            # above N holds some example twice, and none of its steps from
            # here on may be applied.
            count = self._pass_examples.assign_add(tf.cast(examples, tf.int64))
            over = tf.logical_and(self._pass_limit >= 0, count > self._pass_limit)
            self._pass_overflow.assign(tf.logical_or(self._pass_overflow, over))
        aggregator.accumulate(self._accumulators, clipped_sum,
                              first=tf.equal(self._micro_step, 0))
        self._micro_step.assign_add(1)
        if last is None:
            end = self._micro_step >= self.accumulation_steps
        else:
            end = tf.cast(last, tf.bool)
        step = tf.cast(self.iterations, tf.int64)

        def release():
            grads = aggregator.noisy_mean(self._accumulators, step)
            self.inner_optimizer.apply(grads, variables)
            if self.counts_passes:
                first_of_pass = tf.logical_not(self._epoch_released.read_value())
                self.passes.assign_add(tf.cast(first_of_pass, self.passes.dtype))
            self._epoch_released.assign(True)
            return tf.constant(True)

        def end_logical_step():
            # Over budget, or a pass above N: the logical step is dropped
            # (nothing released).
            allowed = tf.logical_and(self._release_allowed(step),
                                     tf.logical_not(self._pass_overflow))
            tf.cond(allowed, release, lambda: tf.constant(False))
            self._micro_step.assign(0)
            return tf.constant(True)

        tf.cond(end, end_logical_step, lambda: tf.constant(False))

    # ------------------------------------------------------------------
    # Privacy accounting.
    # ------------------------------------------------------------------

    def accounted_steps(self, pass_steps=None):
        """The step count the ledger composes.

        `iterations`, or for a streamed input at least one whole pass per
        epoch that released a step: the per-pass bound counts passes, and a
        stream's epochs may hold fewer than N // B steps.
        """
        steps = int(self.iterations.numpy())
        if self.counts_passes and self.built and pass_steps:
            steps = max(steps, int(self.passes.numpy()) * int(pass_steps))
        return steps

    def _accounting_mechanism(self, dataset_size=None, delta=None):
        """The mechanism to account, with N or δ overridden if asked."""
        mech = self.mechanism or self._given_mechanism
        if mech is None:
            raise ValueError(
                "The privacy ledger needs the logical batch size; pass "
                "`expected_batch_size=` to the DPOptimizer, or "
                "`batch_size=` to `fit`, or a dataset with a static batch size."
            )
        sampler = mech.sampler
        if sampler is not None and not dataset_size and not delta:
            return mech
        n = dataset_size or (sampler.dataset_size if sampler else self.dataset_size)
        if not n:
            raise ValueError(
                "The privacy ledger needs the dataset size N. Pass "
                "`dataset_size=` to the DPOptimizer or the callback (it is "
                "only inferred when `fit` is given arrays)."
            )
        n = int(n)
        batch = sampler.logical_batch_size if sampler else int(round(mech.expected_batch_size))
        sampler = samplers.make_sampler(
            sampler.name if sampler else SHUFFLE, dataset_size=n,
            logical_batch_size=min(batch, n), physical_batch_size=1,
        )
        given = self._given_mechanism
        delta = (delta or self.delta or (given.delta if given else None)
                 or privacy_accounting.default_delta(n))
        return mechanism_lib.DPSGD(
            self.l2_norm_clip, self.noise_multiplier, sampler=sampler, delta=delta,
            accountant=self.accountant, secret_key=self._secret_key,
        )

    def ledger(self, *, dataset_size=None, delta=None, steps=None):
        """The `tfdp.privacy.PrivacyLedger` of this run so far.

        Args:
            dataset_size: int or None. Overrides N.
            delta: float or None. Overrides δ.
            steps: int or None. Defaults to the accounted steps (the noisy
                updates; see `accounted_steps`).

        Returns:
            A `PrivacyLedger` whose `epsilon()` is ε after `steps`.
        """
        mech = self._accounting_mechanism(dataset_size, delta)
        if steps is None:
            steps = self.accounted_steps(mech.sampler.steps_per_epoch)
        return mech.ledger(steps)

    def set_budget(self, max_steps, pass_steps=0):
        """Caps the released steps (`PrivacyBudget`); -1 removes the cap."""
        self._max_steps_var.assign(int(max_steps))
        self._pass_steps_var.assign(int(pass_steps) if self.counts_passes else 0)

    # ------------------------------------------------------------------
    # Serialisation.
    # ------------------------------------------------------------------

    def get_config(self):
        # A given mechanism is saved as its public parameters; the key never.
        mech = self._given_mechanism
        sampler = mech.sampler if mech is not None else None
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "gradient_accumulation_steps": self.accumulation_steps,
            "method": self.method,
            "expected_batch_size": (sampler.logical_batch_size if sampler
                                    else self.expected_batch_size),
            "weight_decay": self.weight_decay,
            "insecure_reproducible_seed": self.insecure_reproducible_seed,
            "dataset_size": sampler.dataset_size if sampler else self.dataset_size,
            "delta": mech.delta if mech is not None else self.delta,
            "sampler": sampler.name if sampler else self.sampler,
            "accountant": self.accountant,
        }

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


def too_many_examples_error(count, dataset_size, applied):
    """The message for a stream whose pass holds more than N examples.

    Args:
        count: int. The examples the pass delivered (so far).
        dataset_size: int. N.
        applied: str. What was (not) applied of that pass.
    """
    return (
        f"A pass over the training stream delivered more than dataset_size={dataset_size} "
        f"examples ({count}): it holds some example more than once per epoch "
        "(e.g. `.repeat()` before `.batch()`, or duplicated files), so one example could "
        "sit twice in a logical step and the per-pass privacy bound would not hold. "
        f"{applied} Give a stream that holds each example at most once per epoch, or the "
        f"true `dataset_size`. Received: {count} examples in one pass, "
        f"dataset_size={dataset_size}"
    )

