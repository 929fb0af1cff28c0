"""`tfdp.dp.LogicalStepState`: the one state and stages of a logical step, on every route."""

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tfdp import dp
from tfdp import dpsgd_config
from tfdp import mechanism as mechanism_lib
from tfdp.dp import logical_step_state
from tfdp.dp import noisy_aggregator
from tfdp.privacy import banded_mf
from tfdp.secret_key import SecretKey

KEY = SecretKey(np.array([3, 4]))


def _aggregator(stddev=0.0, coefficients=(1.0,), batch=4.0):
    return noisy_aggregator.NoisyAggregator(
        noise_stddev=stddev, expected_batch_size=batch, noise_key=KEY.derive("noise"),
        coefficients=coefficients)


def _variables():
    return [tf.Variable(tf.zeros([3, 2])), tf.Variable(tf.zeros([2]))]


def _model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    return model


class LogicalStepStateTest(tf.test.TestCase):

    def test_accumulate_twice_then_noisy_mean_at_sigma_zero_is_the_mean_over_b(self):
        state = logical_step_state.LogicalStepState(_aggregator(batch=4.0))
        state.build(_variables())
        self.assertIsNone(state.noise_state)
        self.assertEqual(state.variables_to_checkpoint(), [])
        self.assertTrue(bool(state.is_empty()))
        a = [tf.fill([3, 2], 1.0), tf.constant([2.0, -1.0])]
        b = [tf.fill([3, 2], 3.0), tf.constant([6.0, 5.0])]
        state.accumulate(a)
        state.accumulate(b)
        self.assertEqual(int(state.micro_batches.numpy()), 2)
        self.assertFalse(bool(state.is_empty()))
        mean = state.noisy_mean(tf.constant(0, tf.int64), num_replicas=1)
        self.assertAllClose(mean[0], np.full([3, 2], 1.0))
        self.assertAllClose(mean[1], [2.0, 1.0])
        state.reset()
        self.assertTrue(bool(state.is_empty()))
        # The first batch of the next step overwrites the sums.
        state.accumulate(a)
        self.assertAllClose(state.accumulators[1], [2.0, -1.0])
        # An empty step releases a zero sum.
        state.reset()
        empty = state.noisy_mean(tf.constant(1, tf.int64), empty=state.is_empty())
        self.assertAllClose(empty[1], [0.0, 0.0])

    def test_accumulators_take_the_variables_dtype_or_the_one_given(self):
        own = logical_step_state.LogicalStepState(_aggregator())
        own.build([tf.Variable(tf.zeros([2], tf.float64))])
        self.assertEqual(own.accumulators[0].dtype, tf.float64)
        given = logical_step_state.LogicalStepState(_aggregator(), accumulator_dtype=tf.float32)
        given.build([tf.Variable(tf.zeros([2], tf.float64))])
        self.assertEqual(given.accumulators[0].dtype, tf.float32)

    def test_banded_state_is_shaped_by_the_scheme_and_advances(self):
        coefficients = banded_mf.square_root_coefficients(3)
        aggregator = _aggregator(stddev=1.0, coefficients=coefficients)
        state = logical_step_state.LogicalStepState(aggregator)
        variables = _variables()
        state.build(variables)
        self.assertLen(state.noise_state, len(variables))
        for v, w in zip(variables, state.noise_state):
            self.assertEqual(w.shape, aggregator.noise_state_shape(v.shape))
            self.assertAllEqual(w, np.zeros(w.shape))
        self.assertEqual(state.variables_to_checkpoint(), list(state.noise_state))
        before = [w.numpy() for w in state.noise_state]
        state.accumulate([tf.zeros([3, 2]), tf.zeros([2])])
        got = state.noisy_mean(tf.constant(0, tf.int64))
        after = [w.numpy() for w in state.noise_state]
        self.assertFalse(all(np.array_equal(x, y) for x, y in zip(before, after)))
        # The same stages on the aggregator alone, from a zero state, release the same noise.
        accumulators = [tf.Variable(tf.zeros(v.shape)) for v in variables]
        fresh = [tf.Variable(tf.zeros(aggregator.noise_state_shape(v.shape))) for v in variables]
        expected = aggregator.noisy_mean(accumulators, tf.constant(0, tf.int64),
                                         noise_state=fresh)
        for a, b in zip(got, expected):
            self.assertAllEqual(a, b)
        for a, b in zip(after, fresh):
            self.assertAllEqual(a, b)

    def test_noise_state_waits_for_an_aggregator(self):
        current = [None]
        state = logical_step_state.LogicalStepState(lambda: current[0])
        state.build(_variables())
        self.assertIsNone(state.noise_state)
        current[0] = _aggregator(stddev=1.0, coefficients=banded_mf.square_root_coefficients(2))
        state.build_noise_state()
        self.assertLen(state.noise_state, 2)
        self.assertEqual(tuple(state.noise_state[0].shape), (1, 3, 2))

    def test_the_trainer_step_and_the_keras_logical_step_hold_one(self):
        config = dpsgd_config.DPSGDConfig(1.0, 1.0, bands=2)
        mechanism = mechanism_lib.DPSGD.from_config(config, expected_batch_size=8.0,
                                                    secret_key=KEY)
        model = _model()
        step = dp.PrivateTrainStep(
            model, keras.optimizers.SGD(0.1),
            keras.losses.MeanSquaredError(reduction=None), mechanism=mechanism)
        self.assertIsInstance(step.step_state, dp.LogicalStepState)
        self.assertIs(step.accumulators, step.step_state.accumulators)
        self.assertEqual(step.noise_state, step.step_state.noise_state)
        self.assertEqual(step.variables_to_checkpoint(), step.noise_state)

        optimizer = tfdp.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
                                     noise_multiplier=1.0)
        logical_step = optimizer.logical_step
        self.assertIsInstance(logical_step.state, dp.LogicalStepState)
        self.assertIs(logical_step.micro_step, logical_step.state.micro_batches)
        optimizer.build(_model().trainable_variables)
        self.assertIs(logical_step.accumulators, logical_step.state.accumulators)
        self.assertIsNone(logical_step.noise_state)
