"""The private update of a Keras model: clip, accumulate, noise, apply.

`private_update` is the DP half of a private model's train step. Its stages,
in order, as named stages of Opacus' optimizer:

1. clip: each privacy unit's gradient to C, summed over the physical batch
   (`tfdp.dp.clipping.clipped_grad_sum`, on the engine the trainer uses);
2. accumulate: `LogicalStep.accumulate` adds the sum to the logical step's;
3. noise (at the end of a logical step): `LogicalStep.noisy_mean` adds
   Gaussian noise of std σ·C once and divides by the public expected batch
   size B, with the mechanism's `tfdp.dp.noisy_aggregator.NoisyAggregator`;
4. apply: `LogicalStep.release_or_drop` hands the noisy mean to the wrapped
   optimizer, unless the budget or a stream's pass count refuses the step
   (`tfdp.keras.privacy_account.PrivacyAccount`), when nothing of it is
   released.

The state of the logical step in progress (`LogicalStep`) is deliberately
not optimizer variables: the accumulators hold the un-noised clipped sum,
which no `.keras` file, weights file or Keras checkpoint may contain.
"""

import numpy as np
import tensorflow as tf

from tfdp import distribute
from tfdp.dp import clipping
from tfdp.dp import logical_step_state
from tfdp.dp import release_checks
from tfdp.keras import train_step_probe
from tfdp.keras import training_probe


def private_update(model, optimizer, per_example_loss, x, y, sample_weight=None, *,
                   batch_size=None, last=None, physical_batch_size=None, release=True):
    """The DP-SGD half of a `fit` step: clip, accumulate, noise, update.

    Clips each privacy unit's gradient to the optimizer's `l2_norm_clip`:
    each example's, or under `privacy_unit="user"` the mean of a user's
    block of `max_examples_per_user` rows, or the groups of consecutive rows
    of the optimizer's `clipping_groups`. Adds the sum to the logical step's
    and, on the last batch of a logical step, noises once and updates. Runs
    inside a traced train step.

    Args:
        model: `keras.Model`. The (plain, inner) model whose
            `trainable_variables` are updated.
        optimizer: `tfdp.DPOptimizer`. Clipping bound, noise and state.
        per_example_loss: callable. `(y_true, y_pred) -> [B]` losses (see
            `tfdp.keras.per_example_loss_fn`).
        x: tensor. Inputs, batch first (a single tensor).
        y: tensor. Targets.
        sample_weight: optional tensor [B]. Scales each row's loss before
            clipping. Defaults to `None` (ones).
        batch_size: int or None. The `fit` batch size, for clipping groups
            whose size the traced batch dimension does not give. Defaults
            to `None`.
        last: bool scalar tensor or None. True on the last physical batch of
            a logical step (tfdp's array batches). Defaults to `None`: the
            step ends after the optimizer's `gradient_accumulation_steps`
            batches of one epoch.
        physical_batch_size: int or None. The rows of the training probe
            (`tfdp.keras.training_probe`). Defaults to the traced batch
            size, else `batch_size`, else the array sampler's physical batch.
        release: bool. End the logical step on its last batch here; False
            under several replicas, where the train function ends it
            (`LogicalStep.release_step`). Defaults to `True`.

    Returns:
        The predictions of the clipping forward pass (for metrics).
    """
    # Where the batch enters the update: a replay of a subclass's train_step
    # (`train_step_probe`) stops here with it, before anything reads it.
    train_step_probe.intercept(optimizer, x, y, sample_weight, batch_size)
    # Weight regularizers only where the optimizer adds their (data-free)
    # gradient after the noise (`DPOptimizer.final_gradients`).
    regularized = _regularized_layers(model, optimizer.applies_weight_regularizers)
    if regularized:
        raise NotImplementedError(
            "Layer regularizers are not part of the per-example loss of a "
            f"private model (found {regularized}). Use "
            "`DPOptimizer(weight_decay=...)` for an L2 penalty that is "
            "clipped with the gradient."
        )
    if not tf.is_tensor(x) and not isinstance(x, np.ndarray):
        raise NotImplementedError(
            "Private models take a single input tensor. "
            f"Received: x of type {type(x).__name__}"
        )
    if not model.built:  # First trace only: creates the variables.
        model(x, training=False)
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    rows = tf.shape(x)[0]
    weights = None
    if sample_weight is not None:
        weights = tf.reshape(tf.cast(sample_weight, tf.float32), [rows])
    # A stream's rows are compared with the pass's earlier rows before
    # anything of this batch is released (`PrivacyAccount.count_copies`).
    optimizer.account.count_copies(x, weights)
    route = optimizer.fit_route
    checked = route is not None and route.checks_targets_in_graph and y is not None
    if checked:
        # Labels out of range stop the step before its clipped sum exists;
        # the assertion's message carries no value of the batch.
        y = route.target_rule.in_graph(y)
    x, group = optimizer.clipping_groups(x, batch_size)
    method = clipping.resolve_method(model, optimizer.method)
    captured = []

    def capturing_loss_fn(y_true, y_pred):
        captured.append(y_pred)
        return per_example_loss(y_true, y_pred)

    training_probe.probe_before_training(
        model, optimizer, per_example_loss, x, y, group,
        rows=(x.shape[0] or physical_batch_size or batch_size
              or training_probe.planned_batch_size(optimizer)),
        method=method)
    clipped_sum, norms = clipping.clipped_grad_sum(
        model,
        capturing_loss_fn,
        x,
        y,
        method=method,
        sample_weight=weights,
        weight_decay=optimizer.weight_decay,
        augmentation_multiplicity=group,
        **optimizer.mechanism_builder.clip_settings(),
    )
    # The clipping gave the units with a NaN/Inf gradient no contribution;
    # counted for a figure not covered by ε.
    optimizer.account.count_nonfinite(
        release_checks.nonfinite_units(norms, weights, group))
    if method in clipping.TAPPED_METHODS and len(captured) == 1:
        y_pred = captured[0]  # The batched forward pass of the clipping.
    else:  # Per-example forward passes: recompute the batch's predictions.
        y_pred = model(x, training=True)
    if checked:
        # The caller's loss and metrics read its own targets and these
        # predictions: they too wait for the check (a loss kernel's own
        # error would print the batch's labels).
        with tf.control_dependencies([y]):
            y_pred = tf.identity(y_pred)
    examples = None
    if optimizer.counts_passes:  # A stream's rows are counted against N.
        examples = rows if weights is None else tf.math.count_nonzero(weights, dtype=tf.int32)
    optimizer.logical_step.add_batch(clipped_sum, model.trainable_variables, last=last,
                                     examples=examples, release=release)
    return y_pred


def _regularized_layers(model, weights_allowed=False):
    found = []
    weights = ("kernel_regularizer", "bias_regularizer", "embeddings_regularizer",
               "gamma_regularizer", "beta_regularizer")
    # An activity regularizer depends on the data: never outside the clipping.
    refused = ("activity_regularizer",) + (() if weights_allowed else weights)
    for layer in model._flatten_layers(include_self=True, recursive=True):
        for attr in refused:
            if getattr(layer, attr, None) is not None:
                found.append(f"{layer.name}.{attr}")
    return found


class LogicalStep:
    """The state and stages of a `DPOptimizer`'s logical step.

    Its state and stages are the engine's `tfdp.dp.LogicalStepState`
    (`state`: the replica-local accumulators, the count of physical batches
    in the step, the noise scheme's state), as in the trainer's
    `PrivateTrainStep`; it adds the Keras route's policy: the account's
    `release_allowed`, the release through `DPOptimizer.apply_noisy`, the
    release under strategies (`release_step`), the releases that advanced
    the noise state (`noise_steps`) and the epoch's first logical step (read
    by the array pipelines). Under a strategy every replica keeps its own
    sums and counts its own batches alike, with no communication.

    Args:
        optimizer: `tfdp.DPOptimizer`. Its wrapped optimizer applies the
            noisy mean; its mechanism's aggregator adds the noise; its
            account decides whether a step may be released.
    """

    def __init__(self, optimizer):
        self._optimizer = optimizer
        # The accumulators, their dtype the variables', and the noise state
        # (never saved: the state is as secret as the key), shaped by the
        # current route's aggregator.
        self.state = logical_step_state.LogicalStepState(
            lambda: optimizer.mechanism_builder.aggregator)
        # The releases that advanced the noise state. Every release counts,
        # so that a later `fit` call of this process finds
        # `noise_steps == iterations` and continues the same state, while a
        # Keras checkpoint (which restores `iterations` only) does not.
        self.noise_steps = distribute.replica_local_variable(
            tf.constant(0, tf.int64), "dp_noise_steps", aggregation="first")
        self.epoch_first_step = distribute.replica_local_variable(
            tf.constant(0, tf.int64), "dp_epoch_first_step", aggregation="first")

    def is_replica_local(self):
        """Whether the state has one copy per replica of the strategy in scope.

        True on one replica; under a multi-replica strategy only for an
        optimizer created inside its scope.
        """
        return distribute.is_replica_local(self.micro_step)

    @property
    def accumulators(self):
        """The un-noised clipped sums of the step, one per variable (None before `build`)."""
        return self.state.accumulators

    @property
    def noise_state(self):
        """The noise scheme's state, w / R per replica (None without one)."""
        return self.state.noise_state

    @property
    def micro_step(self):
        """The physical batches added in the logical step so far (int64)."""
        return self.state.micro_batches

    def build(self, var_list):
        """Creates one accumulator per trainable variable, and the noise state (never saved).

        The noise state once the route's aggregator is known: here, or at
        `prepare_route` for an optimizer built before its `fit`.
        """
        self.state.build(var_list)

    def prepare_route(self):
        """Creates the noise state of the route's aggregator, if still missing (eager)."""
        self.state.build_noise_state()

    def check_resumable(self):
        """Refuses a banded run restored from a Keras checkpoint (eager).

        Its noise state and key are not saved, so the steps after a restore
        would start a new strategy and a new group split, which the ledger
        does not account. Another `fit` call on the same optimizer in this
        process continues the same state, key and group split: every release
        advanced `noise_steps` with `iterations`, which a restore does not.

        Raises:
            ValueError: for bands > 1 when `iterations` differs from the
                releases this process drew noise for.
        """
        iterations = int(self._optimizer.iterations.numpy())
        if self._optimizer.bands > 1 and iterations != int(self.noise_steps.numpy()):
            raise ValueError(
                "A DPOptimizer with bands > 1 keeps its noise state and secret key in "
                "memory only, so it cannot resume from a Keras checkpoint or saved "
                "optimizer: train it in one process (several `fit` calls are fine), or use "
                "the trainer (`python -m tfdp.train`), whose checkpoints keep both. "
                f"Received: iterations={iterations} restored with bands="
                f"{self._optimizer.bands}")

    def start_epoch(self):
        """Discards the unfinished logical step, unreleased (eager)."""
        self.state.reset()
        self.epoch_first_step.assign(tf.cast(self._optimizer.iterations, tf.int64))

    def add_batch(self, clipped_sum, variables, last=None, examples=None, release=True):
        """Adds one batch's clipped sum; at the end of a logical step, releases.

        Args:
            clipped_sum: list of tensors. Σ_i clip(g_i) of the batch, one
                clipped term per privacy unit.
            variables: the trainable variables to update.
            last: bool scalar tensor or None. True on the last physical batch
                of a logical step (tfdp's array batches); None for a stream,
                whose steps are k consecutive batches of one epoch.
            examples: int scalar tensor or None. The batch's examples
                (weight > 0), counted against N for a stream.
            release: bool. End the logical step here, on its `last` batch.
                False under several replicas: the caller ends it with
                `release_step`, since the optimizer's all-reduce cannot run
                inside the train step's control flow. Defaults to `True`.
        """
        optimizer = self._optimizer
        if self.accumulators is None:
            raise RuntimeError(
                "DPOptimizer is not built; it is built by `fit` (or call "
                "`optimizer.build(model.trainable_variables)`)."
            )
        if optimizer.mechanism_builder.aggregator is None:
            raise RuntimeError(
                "The DPOptimizer has no mechanism yet: train a private model "
                "with `fit`, which fixes it from its inputs."
            )
        if examples is not None:
            optimizer.account.count_examples(examples)
        self.accumulate(clipped_sum)
        if not release:
            return
        if last is None:
            end = self.micro_step >= optimizer.accumulation_steps
        else:
            end = tf.cast(last, tf.bool)

        def end_logical_step():
            self.release_or_drop(variables)
            self.state.reset()
            return tf.constant(True)

        tf.cond(end, end_logical_step, lambda: tf.constant(False))

    def accumulate(self, clipped_sum):
        """Stage 2: adds a physical batch's clipped sum to the logical step's."""
        self.state.accumulate(clipped_sum)

    def noisy_mean(self, step):
        """Stage 3: the logical step's sum plus N(0, (σC)²) once, divided by B.

        On R replicas each replica returns `(local_sum + noise / R) / B` of
        one common draw; the wrapped optimizer's cross-replica SUM then
        applies the one-device update, with the noise counted once.
        """
        return self.state.noisy_mean(step)

    def release_or_drop(self, variables):
        """Stage 4: the wrapped optimizer's update, unless the account refuses it.

        Over budget, or in a pass above N, the logical step is dropped:
        nothing of it is released.
        """
        optimizer = self._optimizer
        step = tf.cast(optimizer.iterations, tf.int64)

        def release():
            self._apply(step, variables)
            return tf.constant(True)

        tf.cond(optimizer.account.release_allowed(step), release, lambda: tf.constant(False))

    def release_step(self, strategy, variables):
        """Ends a logical step on every replica of `strategy` (eager, cross-replica).

        The step's last batch was added with `release=False`. As
        `add_batch` would: the wrapped optimizer's update with the noisy
        mean, unless the account refuses the step (then nothing of it is
        released); either way the next batch starts a new step. Each
        replica hands the optimizer its own sum plus its share of the one
        noise draw, and the optimizer all-reduces them with a SUM: the
        one-device update.

        Args:
            strategy: the `tf.distribute` strategy of the train step.
            variables: the trainable variables to update.
        """
        optimizer = self._optimizer
        if bool(optimizer.account.release_allowed(tf.cast(optimizer.iterations, tf.int64))):
            release = getattr(self, "_replica_release_fn", None)
            if release is None:
                def replica_release():
                    self._apply(tf.cast(optimizer.iterations, tf.int64), variables)

                release = tf.function(lambda: strategy.run(replica_release), autograph=False)
                self._replica_release_fn = release
            release()
        self.state.reset()

    def _apply(self, step, variables):
        grads = self._optimizer.final_gradients(self.noisy_mean(step), variables)
        # The one door to the wrapped optimizer, which refuses any other call.
        self._optimizer.apply_noisy(grads, variables)
        self._optimizer.account.record_release()
        self.noise_steps.assign_add(1)
