"""How `DPModel.fit` runs its steps: the train function, epochs and strategies.

- `LogicalStepFunction`: Keras' train function for steps of random size
  (one call, one logical step), and under several replicas the function
  that ends each logical step outside the traced train step.
- `EpochBoundary`: the callback that starts each epoch with an empty
  logical step.
- `check_strategy` / `synchronises`: the `tf.distribute` strategies `fit`
  supports, and whether their replicas are all-reduced.
- `reduce_logs`: one batch's logs, averaged over the replicas (also of
  several workers, where Keras 3's own reduction fails), and
  `WorkerMeanTestFunction`, Keras' test function with that reduction, for
  `fit`'s validation under several workers.
"""

import keras
import tensorflow as tf
from keras.src.backend.tensorflow.trainer import reduce_per_replica

from tfdp import distribute


class LogicalStepFunction:
    """The train function of steps of random size: one call, one logical step.

    Each call runs physical batches until the one that ends a logical step
    (its `last` flag), `steps_per_execution` logical steps per call but
    never past the epoch's end, and returns the last batch's logs.

    Under several replicas it also serves fixed-size steps (one call, one
    physical batch) and ends each logical step itself, after its last batch
    (`LogicalStep.release_step`): the update all-reduces the replicas'
    sums, which cannot happen inside the train step's control flow.

    Args:
        model: `DPModel`. Its `train_step` runs each physical batch.
        whole_steps: bool. One Keras step is one logical step (else one
            physical batch). Defaults to `True`.
    """

    def __init__(self, model, whole_steps=True):
        self._model = model
        self._whole_steps = whole_steps
        self._left = None
        strategy = model.distribute_strategy
        self._release = None
        if synchronises(strategy):
            self._release = lambda: model.dp_optimizer.logical_step.release_step(
                strategy, model.model.trainable_variables)

        # As Keras' own train function: the train step is traced as written,
        # not rewritten by AutoGraph.
        @tf.autograph.experimental.do_not_convert
        def one_batch(data):
            outputs = model.distribute_strategy.run(model.train_step, args=(data,))
            return reduce_logs(outputs, model.distribute_strategy)

        if not model.run_eagerly:
            one_batch = tf.function(one_batch, reduce_retracing=True,
                                    jit_compile=model.jit_compile)

        @tf.autograph.experimental.do_not_convert
        def next_batch(iterator):
            data = iterator.get_next()
            return one_batch(data), data[-1]

        if not model.run_eagerly:
            # Not under XLA: reading the iterator cannot be compiled.
            next_batch = tf.function(next_batch, reduce_retracing=True)
        self._next_batch = next_batch

    def start_epoch(self, logical_steps):
        """The epoch's logical steps, which the calls of the epoch take."""
        self._left = int(logical_steps)

    def __call__(self, iterator):
        steps = self._model.steps_per_execution
        if self._left is not None:
            steps = max(1, min(steps, self._left))
            self._left -= steps
        logs = None
        for _ in range(steps):
            while True:
                logs, last = self._next_batch(iterator)
                # Under a strategy every replica holds the same flag.
                last = distribute.is_last(self._model.distribute_strategy, last)
                if last and self._release is not None:
                    self._release()
                if last or not self._whole_steps:
                    break
        return logs


def reduce_logs(logs, strategy):
    """One batch's logs (per replica) as single values: their mean over the replicas.

    Keras' "auto" reduction, except under several workers: there Keras 3
    reduces each value along an axis 0 that the scalar logs do not have
    ("Invalid reduction dimension 0 for input with 0 dimensions",
    tensorflow#72388), and would average a vector log over its own entries.
    The mean over the replicas, elementwise, is what Keras does on one worker.

    Args:
        logs: structure of per-replica values (or tensors), as
            `strategy.run(train_step)` returns them.
        strategy: the `tf.distribute` strategy of the train step.

    Returns:
        The same structure of tensors.
    """
    if reduces_over_workers(strategy):
        # A collective all-reduce: every worker runs it for every batch, as
        # every worker runs every batch's train step.
        return tf.nest.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), logs)
    return reduce_per_replica(logs, strategy, reduction="auto")


def reduces_over_workers(strategy):
    """Whether `strategy` has several workers, whose logs `reduce_logs` averages itself."""
    return distribute.num_workers(strategy) > 1


class WorkerMeanTestFunction:
    """Keras' test function, with the logs averaged by `reduce_logs`.

    Under several workers Keras 3's own test function fails on the scalar
    logs as its train function does (tensorflow#72388), so `fit` with
    validation data would fail there at the first epoch's end; a private
    model's `make_test_function` returns this one where
    `reduces_over_workers`. Each
    call runs up to the model's `steps_per_execution` batches of the
    iterator, and raises `StopIteration` when it has none left, as Keras'
    own.

    Args:
        model: `keras.Model`. Its `test_step` runs each batch.
    """

    def __init__(self, model):
        self._model = model
        strategy = model.distribute_strategy

        # As Keras' own test function: the test step is traced as written.
        @tf.autograph.experimental.do_not_convert
        def one_batch(data):
            # Keras' adapters mark an absent element (e.g. no sample weight)
            # with an empty Optional: the step takes None.
            data = tf.nest.map_structure(
                lambda t: None if isinstance(t, tf.experimental.Optional) else t, data)
            return reduce_logs(strategy.run(model.test_step, args=(data,)), strategy)

        if not model.run_eagerly:
            one_batch = tf.function(one_batch, reduce_retracing=True,
                                    jit_compile=model.jit_compile)
        self._one_batch = one_batch

    def __call__(self, iterator):
        logs = None
        for _ in range(self._model.steps_per_execution):
            # On a distributed iterator every worker learns together that
            # the data has ended, so all run the same batches.
            batch = iterator.get_next_as_optional()
            if not bool(batch.has_value()):
                break
            logs = self._one_batch(batch.get_value())
        if logs is None:
            raise StopIteration
        return logs


class EpochBoundary(keras.callbacks.Callback):
    """Starts each epoch with an empty logical step (see `DPOptimizer.start_epoch`).

    Args:
        logical_steps: int or None. The logical steps of each epoch, when
            each Keras step is one logical step (`make_train_function`).
        check_pass: bool. Stop with an error once a stream's pass went
            above N (`PrivacyAccount.check_pass`).
    """

    def __init__(self, logical_steps=None, check_pass=False):
        super().__init__()
        self.logical_steps = logical_steps
        self.check_pass = check_pass

    def on_train_batch_end(self, batch, logs=None):
        if self.check_pass:
            self.model.dp_optimizer.account.check_pass()

    def on_epoch_begin(self, epoch, logs=None):
        self.model.dp_optimizer.start_epoch()
        function = self.model.train_function
        if self.logical_steps is not None and isinstance(function, LogicalStepFunction):
            function.start_epoch(self.logical_steps)


# Strategies whose replicas Keras' optimizer all-reduces with a SUM in
# replica context, as `LogicalStep.noisy_mean` needs.
STRATEGIES = ("MirroredStrategy", "MultiWorkerMirroredStrategy", "CollectiveAllReduceStrategy",
               "TPUStrategy", "OneDeviceStrategy", "_DefaultDistributionStrategy")


def synchronises(strategy):
    """Whether Keras' optimizer synchronises the replicas of `strategy` (all-reduce).

    Then the update cannot run inside the train step's control flow (also
    with one replica), so the train function ends each logical step.
    """
    name = type(strategy).__name__
    return name not in ("OneDeviceStrategy", "_DefaultDistributionStrategy")


def check_strategy(strategy, optimizer):
    """The number of replicas of a strategy `fit` supports; else a `ValueError`.

    Supported: the default (no strategy), `OneDeviceStrategy`,
    `MirroredStrategy`, `MultiWorkerMirroredStrategy` and `TPUStrategy`,
    with the optimizer (and model) created inside `strategy.scope()`, so
    that each replica keeps its own clipped sums.
    """
    name = type(strategy).__name__
    if not any(name == n or name.startswith(n) for n in STRATEGIES):
        raise ValueError(
            "A private model's fit supports no strategy, OneDeviceStrategy, "
            "MirroredStrategy, MultiWorkerMirroredStrategy and TPUStrategy (each replica "
            "clips its own rows, the sums are all-reduced and the noise added once). "
            f"Received: strategy={name}"
        )
    replicas = int(strategy.num_replicas_in_sync)
    if replicas > 1:
        with strategy.scope():
            local = optimizer.logical_step.is_replica_local()
        if not local:
            raise ValueError(
                "Under a tf.distribute strategy create the DPOptimizer inside "
                "`strategy.scope()` (with the model, before `compile`), so that each "
                f"replica keeps its own clipped sums. Received: strategy={name} with "
                f"{replicas} replicas and a DPOptimizer created outside its scope"
            )
    return replicas
