"""`LogicalStepState`: the state and stages of one logical step, on every route.

A logical step is one or more physical batches: each adds its clipped sum to
replica-local accumulators; on the last, the noise is added once
(`tfdp.dp.NoisyAggregator`, carrying the noise scheme's state across steps,
e.g. banded noise's last b − 1 noise tensors), the noisy mean goes to the
optimizer, and the step starts afresh. The trainer's
`tfdp.dp.PrivateTrainStep` and Keras' `tfdp.keras.private_update.LogicalStep`
(`fit`, the compat `fit` and the compat custom loops) each hold one and keep
only their own policy around it: the trainer its statistics and strategy
drivers; Keras its privacy account, `DPOptimizer.apply_noisy` and its
release under strategies.

Every variable is replica-local (`tfdp.distribute.replica_local_variable`):
under a strategy each replica keeps its own partial sums, its share w / R of
the noise state and its count of batches, with no communication. The noisy
mean of one replica is `(local_sum + noise / R) / B`; the optimizer's
cross-replica SUM then applies the one-device update.

None of it belongs in a saved model or optimizer: the accumulators hold the
un-noised clipped sum, and the noise state is as secret as the key. The
trainer saves the noise state in its training checkpoints
(`variables_to_checkpoint`); Keras never saves it.
"""

import tensorflow as tf

from tfdp import distribute


class LogicalStepState:
    """Accumulators, batch counter and noise state of a logical step, and its stages.

    Args:
        aggregator: `tfdp.dp.NoisyAggregator`, or a callable returning the
            current one (a Keras optimizer binds a new one per `fit` route),
            or None until the route has one. Its `accumulate` and
            `noisy_mean` are the arithmetic; its scheme shapes the noise
            state (`noise_state_shape`).
        accumulator_dtype: dtype or None. The accumulators' dtype. Defaults
            to None: each variable's own dtype.
    """

    def __init__(self, aggregator, *, accumulator_dtype=None):
        self._aggregator = aggregator
        self._accumulator_dtype = accumulator_dtype
        self._strategy = None
        self.accumulators = None
        # The scheme's state (banded noise: the last b − 1 noise tensors, as
        # w / R per replica), one per variable; None without one.
        self.noise_state = None
        # Physical batches in the logical step so far: 0 at its start.
        self.micro_batches = distribute.replica_local_variable(
            tf.constant(0, tf.int64), "dp_micro_step", aggregation="first")

    @property
    def aggregator(self):
        """The current `NoisyAggregator`, or None."""
        if callable(self._aggregator):
            return self._aggregator()
        return self._aggregator

    @property
    def built(self):
        return self.accumulators is not None

    def build(self, variables):
        """Creates one accumulator per variable, and the noise state if the scheme has one.

        Call it in the strategy's scope: the state is created in it, and a
        noise state created later (`build_noise_state`) too.
        """
        self._strategy = tf.distribute.get_strategy()
        self.accumulators = [
            distribute.replica_local_variable(
                tf.zeros(v.shape, self._accumulator_dtype or v.dtype), "dp_accumulator")
            for v in variables
        ]
        self.build_noise_state()

    def build_noise_state(self):
        """Creates the aggregator's noise state, if it has one and it is not made yet (eager).

        Shaped and initialised by the scheme (`noise_state_shape`,
        `NoiseScheme.initial_state`), float32, one per accumulator. Nothing
        before `build` or without an aggregator.
        """
        aggregator = self.aggregator
        if (self.noise_state is not None or self.accumulators is None or aggregator is None
                or not aggregator.correlated):
            return
        with self._strategy.scope():
            self.noise_state = [
                distribute.replica_local_variable(
                    aggregator.scheme.initial_state(a.shape), "dp_noise_state")
                for a in self.accumulators
            ]

    def is_empty(self):
        """True (bool scalar tensor) while no batch was accumulated in the step."""
        return tf.equal(self.micro_batches, 0)

    def accumulate(self, clipped_sum):
        """Adds a physical batch's clipped sum (the first batch overwrites the sums)."""
        self.aggregator.accumulate(self.accumulators, clipped_sum, first=self.is_empty())
        self.micro_batches.assign_add(1)

    def noisy_mean(self, step, num_replicas=None, empty=None):
        """This replica's `(sum + noise / R) / B` of logical step `step`.

        Args:
            step: int scalar (tensor). The logical step: seeds the noise.
            num_replicas: int or None. R. Defaults to the replica context's
                (1 in cross-replica context).
            empty: bool scalar tensor or None. True when no batch was
                accumulated (`is_empty()`): the sum is taken as zero.
                Defaults to None (the step has a batch).

        Returns:
            A list of tensors, one per accumulator. Advances the noise state.
        """
        if num_replicas is None:
            context = tf.distribute.get_replica_context()
            num_replicas = 1 if context is None else context.num_replicas_in_sync
        return self.aggregator.noisy_mean(
            self.accumulators, step, num_replicas=num_replicas, empty=empty,
            noise_state=self.noise_state)

    def reset(self):
        """Starts a new logical step: the next batch overwrites the sums."""
        self.micro_batches.assign(0)

    def variables_to_checkpoint(self):
        """The state a training checkpoint keeps to resume the same noise: a list.

        The noise state where its scheme asks for it
        (`NoiseScheme.checkpoint_state`); never the accumulators.
        """
        aggregator = self.aggregator
        if not self.noise_state or aggregator is None or not aggregator.scheme.checkpoint_state:
            return []
        return list(self.noise_state)
