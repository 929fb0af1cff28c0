"""`route_fit` / `FitRoute`: how one `DPModel.fit` call feeds the examples to the update.

`fit` fixes its route once, before training: its kind (arrays in random
order, arrays in their order, a stream), the sampler and the mechanism it
fixes, the steps of an epoch and whether the batches mark the last of each
logical step. The batches then follow the route (`FitRoute.array_batches`),
and the private update (`tfdp.keras.private_update`) consumes them.
"""

import warnings
import weakref

from tfdp import distribute
from tfdp.keras import array_batches
from tfdp.keras import fit_ledger
from tfdp.samplers import amplification

# The optimizers already warned of weak amplification: once per run, not per fit call.
_WARNED = weakref.WeakSet()
# The optimizers already told that a stream's pipeline is not checked.
_WARNED_STREAM = weakref.WeakSet()
STREAM_MIXING_WARNING = (
    "fit got a stream (a tf.data.Dataset or another iterable), whose pipeline tfdp "
    "does not see: an augmentation in it that combines examples (MixUp, CutMix, "
    "anything computed across the rows of a batch) voids the privacy guarantee, since "
    "one example then reaches other examples' gradients. Augment each example by "
    "itself (per-example random layers in the model), or give fit arrays; see "
    "docs/KERAS.md, \"Augmentation\".")

# How `fit` feeds the examples (the route's kind), whatever the sampler:
SAMPLED = "sampled"  # Arrays, batches drawn by the sampler with the secret key.
ORDERED = "ordered"  # Arrays, `shuffle=False`: the arrays' order.
STREAM = "stream"  # A tf.data.Dataset (or other iterable): the user's batches.
ARRAY_KINDS = (SAMPLED, ORDERED)


class FitRoute:
    """The route of one `fit` call: what `route_fit` decided.

    Args:
        kind: str. One of `SAMPLED`, `ORDERED`, `STREAM`.
        sampler: `tfdp.samplers.Sampler` or None. Draws the array routes'
            logical steps, with the fit batch size as physical batch size;
            for a stream, accounts its passes (None without a known N).
        steps_per_epoch: int or None. Logical steps per Keras epoch (array
            routes).
        sampler_name: str. The registered name of the sampler the route is
            accounted with, also when `sampler` is None (a stream of unknown
            N, which a callback's `dataset_size=` can still account).
        physical_batch_size: int or None. The `fit` batch size, in rows
            (None for a stream of unknown batch size).

    Attributes:
        target_rule: `tfdp.keras.fit_inputs.TargetRule` or None. Set by
            `fit`: a stream's batches are checked with it in the train step
            (`checks_targets_in_graph`), before anything of them is released.
    """

    def __init__(self, kind, sampler, steps_per_epoch, sampler_name,
                 physical_batch_size=None):
        self.target_rule = None
        self.kind = kind
        self.physical_batch_size = physical_batch_size
        self.sampler = sampler
        self.steps_per_epoch = steps_per_epoch
        self.sampler_name = sampler_name

    @property
    def marks_last_batch(self):
        """Whether the batches carry the `last` flag of their logical step."""
        return self.kind in ARRAY_KINDS

    @property
    def ordered(self):
        """Whether the arrays are taken in their own order (`shuffle=False`)."""
        return self.kind == ORDERED

    @property
    def variable_steps(self):
        """Whether the array steps vary in size (so epochs vary in batches)."""
        return self.kind in ARRAY_KINDS and not self.sampler.fixed_size_steps

    @property
    def checks_targets_in_graph(self):
        """Whether each batch's targets are checked in the train step (a stream's).

        Arrays are checked whole before any step (`TargetRule.check`).
        """
        return self.kind == STREAM and self.target_rule is not None

    @property
    def counts_passes(self):
        """Whether the ledger counts the passes of the user's stream."""
        return self.kind == STREAM

    @property
    def group_size(self):
        """Rows of one privacy unit in a physical batch, clipped as one group."""
        if self.kind in ARRAY_KINDS:
            return self.sampler.group_size
        return 1

    def array_batches(self, x, y, sample_weight, sampling_key, first_step, *,
                      steps_per_epoch, input_context=None):
        """The array routes' `(x, y, weights, last)` physical batches of one epoch.

        See `tfdp.keras.array_batches.step_batches`; `steps_per_epoch` None
        runs on without end (for steps of random size, `fit` counts the
        logical steps of each epoch).
        """
        return array_batches.step_batches(
            x, y, sample_weight, self.sampler, sampling_key, ordered=self.ordered,
            first_step=first_step, steps_per_epoch=steps_per_epoch,
            input_context=input_context)


    def replica_batches(self, strategy, x, y, sample_weight, sampling_key, first_step):
        """The array batches split over the replicas of `strategy` (without end).

        Every physical batch of P rows is split into R consecutive
        per-replica batches of P / R (`tfdp.distribute.distribute_train_pipeline`,
        as the trainer's), each worker building its share (the sampler's host
        split); all carry the step's `last` flag, so every replica releases
        together. Keras keeps one iterator and counts the epochs' steps.

        Raises:
            ValueError: when P is not a multiple of R (times a user's block).
        """
        physical = self.physical_batch_size
        replicas = strategy.num_replicas_in_sync
        group = self.group_size
        if physical % (replicas * group):
            unit = f" times max_examples_per_user={group}" if group > 1 else ""
            raise ValueError(
                "Under a tf.distribute strategy the fit batch size is split evenly over "
                f"the replicas: it must be a multiple of the number of replicas{unit}. "
                f"Received: batch_size={physical} with {replicas} replicas"
            )

        def make_pipeline(physical_batch_size, input_context):
            del physical_batch_size  # P / W: the sampler's host split (`step_batches`).
            return self.array_batches(x, y, sample_weight, sampling_key, first_step,
                                      steps_per_epoch=None, input_context=input_context)

        if replicas == 1:  # E.g. one worker of MultiWorkerMirroredStrategy: no split.
            return strategy.distribute_datasets_from_function(
                lambda context: make_pipeline(physical, None))
        return distribute.distribute_train_pipeline(strategy, make_pipeline, physical)


def route_fit(optimizer, *, arrays, dataset_size=None, physical_batch_size=None,
             shuffle=True, user_ids=None, epochs=None):
    """Fixes the route, the sampler and the mechanism of a `fit` call (eager).

    Args:
        optimizer: `tfdp.DPOptimizer`. Its request is bound to the route's
            sampler (`MechanismBuilder.route_fit`), and its account told whether
            a stream's passes are counted.
        arrays: bool. Whether `fit` got arrays (random access), which tfdp
            batches itself; else a stream of the user's batches.
        dataset_size: int or None. N of the arrays, in privacy units (their
            number of users under `privacy_unit="user"`).
        physical_batch_size: int or None. The `fit` batch size.
        shuffle: bool. `fit(shuffle=...)`.
        user_ids: int array `[n]` or None. Each example's user, in [0, N),
            under `privacy_unit="user"`.
        epochs: int or None. `fit(epochs=...)`, for the ε quoted where the
            sampling probability is above one half (a warning, once per
            optimizer). Defaults to None (one epoch).

    Returns:
        A `FitRoute`.

    A stream's pipeline (where MixUp or CutMix would combine examples) is
    not seen by tfdp: the first stream an optimizer gets warns once
    (`STREAM_MIXING_WARNING`).

    Raises:
        ValueError: for a streamed input with a sampler that needs random
            access, for `shuffle=False` with an amplified sampler, for
            missing sizes or user ids, for a banded run restored from a
            Keras checkpoint.
    """
    optimizer.logical_step.check_resumable()
    route = optimizer.mechanism_builder.route_fit(
        arrays=arrays, dataset_size=dataset_size, physical_batch_size=physical_batch_size,
        shuffle=shuffle, user_ids=user_ids)
    # The noise state of the route's noise scheme, for an optimizer built before.
    optimizer.logical_step.prepare_route()
    n = route.sampler.dataset_size if route.sampler is not None else None
    # A stream is trusted to hold each example at most once per pass; its
    # passes are counted against N (`PrivacyAccount.check_pass`).
    optimizer.account.set_route(route.counts_passes, n if route.counts_passes else None)
    _warn_weak_amplification(optimizer, route.sampler, epochs)
    if not arrays and optimizer not in _WARNED_STREAM:
        _WARNED_STREAM.add(optimizer)
        warnings.warn(STREAM_MIXING_WARNING, UserWarning, stacklevel=3)
    return route


def _warn_weak_amplification(optimizer, sampler, epochs):
    """Warns once per optimizer when its sampler's q is above one half."""
    # Without noise (σ = 0) there is no ε to amplify.
    if (sampler is None or optimizer in _WARNED
            or not optimizer.mechanism_builder.noise_multiplier):
        return
    if amplification.weak_amplification_warning(sampler) is None:
        return  # Checked first: the ε below costs an accounting.
    steps = sampler.steps_for_epochs(epochs or 1)
    ledger = fit_ledger.ledger(optimizer, steps=steps)
    message = amplification.weak_amplification_warning(
        sampler, epsilon=ledger.epsilon(), delta=ledger.delta)
    _WARNED.add(optimizer)
    warnings.warn(message + f" (after {steps} steps)", UserWarning, stacklevel=3)
