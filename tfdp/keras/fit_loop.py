"""How `DPModel.fit` runs Keras' loop on the route's batches.

`DPModel.fit` checks its inputs and fixes its route; `FitLoop`, a base of
`DPModel`, then runs Keras' own `fit` on that route's batches:
- on arrays, the route's physical batches (`FitRoute.array_batches`, or
  each replica's share under a strategy, `FitRoute.replica_batches`),
  with the epoch's steps that Keras counts;
- Keras' train function (`train_function.LogicalStepFunction` where one
  call must be one logical step: steps of random size, or replicas that
  synchronise at each release) and test function (averaged over several
  workers);
- the train step retraced when the route or the mechanism changed, and
  what it reads of the route (the batches' `last` flag, the physical batch
  size, the logical steps of an epoch).
"""

import tensorflow as tf

from tfdp.keras import train_function


class FitLoop:
    """Keras' loop of `DPModel.fit`: its batches, train and test functions.

    A mixin listed before `keras.Model` among `DPModel`'s bases: it
    overrides Keras' `make_train_function`, `make_test_function` and
    `_maybe_symbolic_build`, and reads the model's `dp_optimizer` and
    `distribute_strategy`. `_dp_prepare` sets what the train step reads of
    the route: `_dp_marks_last` (whether batches carry a `last` flag),
    `_dp_fit_batch_size` (a replica's physical batch size) and
    `_dp_logical_steps` (an epoch's logical steps, for steps of random size).
    """

    def _fit_arrays(self, x, y, sample_weight, route, logical_steps, callbacks, common):
        """`fit` on arrays, on one device or over the strategy's R replicas (see `fit`).

        Under a strategy each replica trains its share of every physical
        batch (`FitRoute.replica_batches`), clipping and summing its own rows;
        the noise is added once (`LogicalStep.noisy_mean`), so the update is
        the one-device update.
        """
        optimizer = self.dp_optimizer
        strategy = self.distribute_strategy
        physical = route.physical_batch_size
        synchronised = train_function.synchronises(strategy)
        first_step = optimizer.logical_step.epoch_first_step
        if synchronised:
            dataset = route.replica_batches(strategy, x, y, sample_weight,
                                            optimizer.sampling_key, first_step)
        else:
            dataset = route.array_batches(
                x, y, sample_weight, optimizer.sampling_key, first_step,
                steps_per_epoch=None if route.variable_steps else logical_steps)
        replicas = strategy.num_replicas_in_sync if synchronised else 1
        if route.variable_steps:
            # Keras counts logical steps (`train_function.LogicalStepFunction`);
            # the dataset runs on, from step to step, across the epochs.
            common["steps_per_epoch"] = logical_steps
        elif synchronised:
            common["steps_per_epoch"] = logical_steps * (
                route.sampler.logical_batch_size // physical)
        else:
            # N // B steps of B / P batches each: Keras knows each epoch's end.
            dataset = dataset.apply(tf.data.experimental.assert_cardinality(
                logical_steps * (route.sampler.logical_batch_size // physical)))
        common["callbacks"] = [train_function.EpochBoundary(
            logical_steps if route.variable_steps else None)] + callbacks
        common.setdefault("validation_batch_size", physical)
        self._dp_prepare(route, physical // replicas, logical_steps)
        return self._fit_batches(dataset, x, y, physical // replicas, common)

    def _fit_batches(self, dataset, x, y, rows, common):
        """Keras' `fit` on tfdp's `(x, y, weights, last)` batches of the arrays.

        Under a strategy scope Keras builds the metrics from a batch it reads
        from the input, whose `last` flag is no model input; a replica's
        share of the arrays' first rows serves instead.
        """
        self._dp_build_batch = (tf.convert_to_tensor(x[:rows]), tf.convert_to_tensor(y[:rows]))
        try:
            return super().fit(dataset, shuffle=False, **common)
        finally:
            self._dp_build_batch = None

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        batch = getattr(self, "_dp_build_batch", None)
        if iterator is not None and batch is not None:
            iterator, data_batch = None, batch
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _dp_prepare(self, route, physical_batch_size, logical_steps):
        """Retraces the train step when the route or the mechanism changed."""
        optimizer = self.dp_optimizer
        traced_for = (route.kind, route.variable_steps, id(optimizer.mechanism))
        if getattr(self, "_dp_traced_for", None) != traced_for:
            self.train_function = None
            self._dp_traced_for = traced_for
        self._dp_marks_last = route.marks_last_batch
        self._dp_fit_batch_size = physical_batch_size
        self._dp_logical_steps = logical_steps if route.variable_steps else None

    def make_train_function(self, force=False):
        """Keras' train function; for steps of random size, one call is one logical step.

        A Poisson step takes a random number of physical batches, so an
        epoch of N/B logical steps has a random number of them, which Keras'
        epoch loop cannot know in advance. `fit` gives Keras the logical
        steps as `steps_per_epoch` instead, and each call of this function
        runs physical batches until the one that ends a logical step.
        Fixed-size steps use Keras' own function (one call per physical
        batch).
        """
        if self.train_function is not None and not force:
            return self.train_function
        variable_steps = getattr(self, "_dp_logical_steps", None) is not None
        if train_function.synchronises(self.distribute_strategy):
            # The release synchronises the replicas: outside the train step.
            self.train_function = train_function.LogicalStepFunction(
                self, whole_steps=variable_steps)
        elif variable_steps:
            self.train_function = train_function.LogicalStepFunction(self)
        else:
            return super().make_train_function(force=force)
        return self.train_function

    def make_test_function(self, force=False):
        """Keras' test function; under several workers, one that averages their logs.

        Keras 3's own fails on the workers' scalar logs (tensorflow#72388),
        as its train function does (`train_function.WorkerMeanTestFunction`).
        """
        if self.test_function is not None and not force:
            return self.test_function
        if train_function.reduces_over_workers(self.distribute_strategy):
            self.test_function = train_function.WorkerMeanTestFunction(self)
            return self.test_function
        return super().make_test_function(force=force)
