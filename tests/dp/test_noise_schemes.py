"""Noise schemes (`tfdp.dp.noise_schemes`): today's noise bit for bit, the registry, a new scheme.

The expected noise comes from a copy of the arithmetic that `NoisyAggregator`
held inline before the schemes (and `tfdp.dp.tree_noise`, commit ab63aff):
DP-SGD's fused draw, the banded recursion over its ring of states, the
tree's node increments. Each scheme must give the same bits, step by step,
on one replica and as one replica's share of two.
"""

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import engine
from tfdp import privacy
from tfdp import secret_key
from tfdp.dp import noise as noise_lib
from tfdp.dp import noise_schemes
from tfdp.dp import noisy_aggregator
from tfdp.privacy import banded_mf
from tfdp.privacy import noise_accounting
from tfdp.privacy import tree_aggregation
from tfdp.samplers import base as samplers_base
from tfdp.training.privacy_config import PrivacyConfig

KEY = [0x51, 0x7A]  # A public noise key: these tests read the noise.
SHAPES = ([4, 3], [5], [])
DIVISOR = 8.0


# Today's arithmetic, copied: the expected values of the schemes' noise.

def _old_gaussian_mean(sums, stddev, step):
    return noise_lib.noisy_divided(sums, stddev, noise_lib.step_seed(KEY, step), DIVISOR)


def _old_banded_mean(sums, stddev, step, coefficients, noise_state):
    step = tf.cast(step, tf.int64)
    slots = max(len(coefficients) - 1, 1)
    lags = tf.math.floormod(step - 1 - tf.range(slots, dtype=tf.int64), slots) + 1
    tail = coefficients[1:] or (0.0,)
    draws = noise_lib.gaussian_noise(sums, stddev, noise_lib.step_seed(tf.constant(KEY, tf.int64),
                                                                       step))
    slot = tf.math.floormod(step, slots)
    means = []
    for total, draw, state in zip(sums, draws, noise_state):
        lag_weights = tf.gather(tf.constant(tail, state.dtype), lags - 1)
        previous = tf.convert_to_tensor(state)
        history = tf.tensordot(lag_weights, previous, axes=1)
        noise = (tf.cast(draw, state.dtype) - history) / coefficients[0]
        state.assign(tf.tensor_scatter_nd_update(previous, slot[None, None], noise[None]))
        means.append((total + tf.cast(noise, total.dtype)) / DIVISOR)
    return means


def _old_tree_and_leaf(step, restarts):
    step = tf.cast(step, tf.int64)
    if restarts.restart_period is None:
        return tf.constant(0, tf.int64), step
    period = tf.constant(restarts.restart_period, tf.int64)
    warmup = restarts.warmup
    if not warmup:
        return step // period, step % period
    after = tf.maximum(step - warmup, 0)
    in_warmup = step < warmup
    tree = tf.where(in_warmup, tf.constant(0, tf.int64), 1 + after // period)
    leaf = tf.where(in_warmup, step, after % period)
    return tree, leaf


def _old_node_seed(tree, level, end):
    key = tf.random.experimental.stateless_fold_in(
        tf.constant(KEY, tf.int64), tf.constant(0x7EE0_0001, tf.int64))
    for word in (tree, level, end):
        key = tf.random.experimental.stateless_fold_in(key, tf.cast(word, tf.int64))
    return key


def _old_residual_noise(like, stddev, step, restarts):
    tree, leaf = _old_tree_and_leaf(step, restarts)
    count = leaf + 1
    lowest = tf.bitwise.bitwise_and(count, -count)
    top = noise_lib.gaussian_noise(like, stddev, _old_node_seed(tree, lowest, count))

    def body(span, noise):
        draws = noise_lib.gaussian_noise(like, stddev, _old_node_seed(tree, span, count - span))
        return span * 2, [n - tf.cast(d, n.dtype) for n, d in zip(noise, draws)]

    _, noise = tf.while_loop(
        lambda span, noise: span < lowest, body, (tf.constant(1, tf.int64), top))
    return noise


def _old_tree_mean(sums, stddev, step, restarts, k):
    first = tf.cast(step, tf.int64) * k
    if k == 1:
        noise = _old_residual_noise(sums, stddev, first, restarts)
    else:
        def body(j, total):
            leaf_noise = _old_residual_noise(sums, stddev, first + j, restarts)
            return j + 1, [t + tf.cast(n, t.dtype) for t, n in zip(total, leaf_noise)]

        zeros = [tf.zeros_like(x) for x in sums]
        _, noise = tf.while_loop(lambda j, total: j < k, body,
                                 (tf.constant(0, tf.int64), zeros))
    return [(s + tf.cast(n, s.dtype)) / DIVISOR for s, n in zip(sums, noise)]


def _sums():
    return [tf.Variable(tf.reshape(tf.range(float(np.prod(s, dtype=int))), s) * 0.25 - 1.0)
            for s in SHAPES]


def _released(aggregator, steps, replicas):
    """What the aggregator releases at steps 0 … steps − 1, as numpy arrays."""
    accumulators = _sums()
    shapes = [aggregator.noise_state_shape(a.shape) for a in accumulators]
    state = None if shapes[0] is None else [tf.Variable(tf.zeros(s)) for s in shapes]
    fn = tf.function(lambda t: aggregator.noisy_mean(accumulators, t, num_replicas=replicas,
                                                     noise_state=state), autograph=False)
    return [[m.numpy() for m in fn(tf.constant(t, tf.int64))] for t in range(steps)]


def _expected(old_mean, steps, state_shapes=None):
    accumulators = _sums()
    state = None if state_shapes is None else [
        tf.Variable(tf.zeros([*state_shapes, *a.shape])) for a in accumulators]
    fn = tf.function(lambda t: old_mean([tf.convert_to_tensor(a) for a in accumulators], t, state),
                     autograph=False)
    return [[m.numpy() for m in fn(tf.constant(t, tf.int64))] for t in range(steps)]


def _aggregator(stddev=1.5, **options):
    return noisy_aggregator.NoisyAggregator(
        noise_stddev=stddev, expected_batch_size=DIVISOR, noise_key=KEY, **options)


def _assert_bit_identical(got, expected):
    assert len(got) == len(expected)
    for step, (got_step, expected_step) in enumerate(zip(got, expected)):
        for g, e in zip(got_step, expected_step):
            np.testing.assert_array_equal(g, e, err_msg=f"step {step}")


@pytest.mark.parametrize("replicas", [1, 2])
def test_gaussian_is_todays_noise_bit_for_bit(replicas):
    stddev = 1.5 / replicas
    expected = _expected(lambda sums, t, _: _old_gaussian_mean(sums, stddev, t), 4)
    _assert_bit_identical(_released(_aggregator(), 4, replicas), expected)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("coefficients", [
    tuple(banded_mf.square_root_coefficients(3)), tuple(banded_mf.square_root_coefficients(2)),
    (0.75,)])
def test_banded_is_todays_noise_bit_for_bit(coefficients, replicas):
    stddev = 1.5 / replicas
    slots = max(len(coefficients) - 1, 1)
    # Seven steps: the ring of two slots wraps around three times.
    expected = _expected(
        lambda sums, t, state: _old_banded_mean(sums, stddev, t, coefficients, state), 7, [slots])
    _assert_bit_identical(_released(_aggregator(coefficients=coefficients), 7, replicas), expected)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("restarts, leaves", [
    (tree_aggregation.TreeRestarts(), 1),
    (tree_aggregation.TreeRestarts(4, 3), 1),
    (tree_aggregation.TreeRestarts(3), 2)])
def test_tree_is_todays_noise_bit_for_bit(restarts, leaves, replicas):
    stddev = 1.5 / replicas
    expected = _expected(
        lambda sums, t, _: _old_tree_mean(sums, stddev, t, restarts, leaves), 6)
    got = _released(_aggregator(tree=restarts, leaves_per_step=leaves), 6, replicas)
    _assert_bit_identical(got, expected)


def test_the_aggregators_arguments_choose_the_scheme():
    assert _aggregator().scheme.name == "gaussian"
    assert _aggregator(coefficients=(0.8, 0.6)).scheme.name == "banded"
    tree = _aggregator(tree=tree_aggregation.TreeRestarts(4), leaves_per_step=2).scheme
    assert (tree.name, tree.leaves_per_step) == ("tree", 2)
    assert {"gaussian", "banded", "tree"} <= set(noise_schemes.names())


def test_gaussian_noise_is_its_fused_mean_minus_the_sum():
    scheme = noise_schemes.scheme_class("gaussian")()
    sums = [tf.zeros(s) for s in SHAPES]
    key = tf.constant(KEY, tf.int64)
    noise = scheme.noise(sums, stddev=0.5, noise_key=key, step=3)
    fused = scheme.noisy_mean(sums, stddev=0.5, noise_key=key, step=3, divisor=1.0)
    for n, f in zip(noise, fused):
        np.testing.assert_array_equal(n.numpy(), f.numpy())


def test_each_scheme_declares_its_state():
    gaussian = noise_schemes.scheme_class("gaussian")()
    tree = noise_schemes.scheme_class("tree")(tree_aggregation.TreeRestarts())
    for scheme in (gaussian, tree):
        assert not scheme.has_state
        assert scheme.state_shape([3]) is None and scheme.initial_state([3]) is None
        assert not scheme.checkpoint_state
    banded = noise_schemes.scheme_class("banded")((0.8, 0.5, 0.3))
    assert banded.has_state and banded.checkpoint_state
    assert banded.state_shape([4, 3]) == [2, 4, 3]
    np.testing.assert_array_equal(banded.initial_state([4, 3]).numpy(), np.zeros([2, 4, 3]))
    assert _aggregator(coefficients=(0.8, 0.6)).noise_state_shape([5]) == [1, 5]


def test_the_registry_refuses_an_unknown_name_and_a_taken_one():
    with pytest.raises(ValueError, match="Received: scheme='no_such_scheme'"):
        noise_schemes.scheme_class("no_such_scheme")
    with pytest.raises(ValueError, match="Unknown noise scheme"):
        _aggregator(scheme="no_such_scheme")

    class Again(noise_schemes.NoiseScheme):
        name = "gaussian"

        def noise(self, like, *, stddev, noise_key, step, state=None):
            return like

    with pytest.raises(ValueError, match="unique name"):
        noise_schemes.register(Again)
    with pytest.raises(ValueError, match="NoiseScheme subclass"):
        noise_schemes.register(object)

    class Unaccounted(noise_schemes.NoiseScheme):
        name = "unaccounted_for_test"

        def noise(self, like, *, stddev, noise_key, step, state=None):
            return like

    with pytest.raises(ValueError, match="needs its accounting"):
        noise_schemes.register(Unaccounted)
    assert "unaccounted_for_test" not in noise_schemes.names()


def test_a_scheme_refuses_options_it_does_not_take():
    with pytest.raises(ValueError, match="takes no coefficients"):
        _aggregator(scheme="gaussian", coefficients=(0.8, 0.6))
    with pytest.raises(ValueError, match="choose one"):
        _aggregator(scheme="tree")


# Accounted as DP-SGD by its sampler only to exercise the registry: a toy.
noise_accounting.register(noise_accounting.SchemeAccounting(
    "zero_for_test", "a toy, for the registry's tests", by_sampler=True))


@noise_schemes.register
class _ZeroNoise(noise_schemes.NoiseScheme):
    """A toy scheme, registered once here: no noise at all."""

    name = "zero_for_test"

    def noise(self, like, *, stddev, noise_key, step, state=None):
        return [tf.zeros_like(x) for x in like]


def test_a_new_scheme_is_picked_up_with_one_registration():
    aggregator = _aggregator(scheme="zero_for_test")
    assert isinstance(aggregator.scheme, _ZeroNoise)
    assert not aggregator.correlated and aggregator.noise_state_shape([3]) is None
    for got, s in zip(_released(aggregator, 2, 1)[1], _sums()):
        np.testing.assert_array_equal(got, s.numpy() / DIVISOR)
    # As an object too (a scheme with options of its own would be passed so).
    assert _aggregator(scheme=_ZeroNoise()).scheme.name == "zero_for_test"


def test_gaussian_and_banded_events_are_the_samplers():
    poisson = samplers_base.make_sampler("poisson", dataset_size=1000, logical_batch_size=50)
    gaussian = noise_schemes.scheme_class("gaussian")()
    assert gaussian.dp_event(poisson, 1.1, 30) == poisson.dp_event(1.1, 30)

    coefficients = tuple(banded_mf.square_root_coefficients(3))
    banded = noise_schemes.scheme_class("banded")(coefficients)
    grouped = samplers_base.make_sampler("banded_poisson", dataset_size=1000,
                                         logical_batch_size=50, bands=3)
    event = banded.dp_event(grouped, 1.1, 30)
    assert event == grouped.dp_event(1.1, 30)
    assert isinstance(event, dp_accounting.SelfComposedDpEvent)
    assert event.count == banded_mf.rounds(30, 3)
    with pytest.raises(ValueError, match="at least 3 apart"):
        banded.dp_event(poisson, 1.1, 30)


def test_the_tree_event_is_its_ledgers():
    restarts = tree_aggregation.TreeRestarts(6)
    tree = noise_schemes.scheme_class("tree")(restarts, leaves_per_step=2)
    shuffle = samplers_base.make_sampler("shuffle", dataset_size=1000, logical_batch_size=50)
    ledger = tree_aggregation.TreeAggregationLedger(
        1.1, delta=1e-5, steps=30, dataset_size=1000, batch_size=50, restarts=restarts,
        leaves_per_step=2)
    assert tree.dp_event(shuffle, 1.1, 30) == ledger.dp_event()


# ----------------------------------------------------------------------
# A scheme named by a request: DPSGDConfig, DPOptimizer, the trainer, the ledger.
# ----------------------------------------------------------------------


def test_a_request_names_a_registered_scheme_checked_where_given():
    assert tfdp.DPSGDConfig(1.0, 1.0).noise_scheme == "gaussian"
    assert tfdp.DPSGDConfig(1.0, 1.0, bands=3).noise_scheme == "banded"
    assert tfdp.DPSGDConfig(1.0, 1.0, noise_scheme="zero_for_test").noise_scheme == (
        "zero_for_test")
    with pytest.raises(ValueError, match="Unknown noise scheme.*noise_scheme='nope'"):
        tfdp.DPSGDConfig(1.0, 1.0, noise_scheme="nope")
    with pytest.raises(ValueError, match="needs bands > 1"):
        tfdp.DPSGDConfig(1.0, 1.0, noise_scheme="banded")
    with pytest.raises(ValueError, match="takes no bands"):
        tfdp.DPSGDConfig(1.0, 1.0, bands=2, noise_scheme="gaussian")
    # The tree needs its restarts, which no request carries: its route is DP-FTRL's.
    with pytest.raises(ValueError, match="DP-FTRL.*cannot be asked for here"):
        tfdp.DPSGDConfig(1.0, 1.0, noise_scheme="tree")
    assert PrivacyConfig(noise_multiplier=1.0, noise_scheme="zero_for_test").dpsgd_config \
        .noise_scheme == "zero_for_test"
    with pytest.raises(ValueError, match="for private training"):
        PrivacyConfig(private=False, noise_scheme="gaussian")


def test_the_engine_releases_and_the_ledger_records_the_scheme_a_request_names():
    sampler = samplers_base.make_sampler("poisson", dataset_size=1000, logical_batch_size=50)
    config = tfdp.DPSGDConfig(1.0, 1.3, delta=1e-5, noise_scheme="zero_for_test")
    key = secret_key.SecretKey.resolve(insecure_seed=3)
    made = engine.make_engine(config, sampler=sampler, key=key)
    assert isinstance(made.aggregator.scheme, _ZeroNoise)
    assert made.dp_event(20) == made.mechanism.dp_event(20) == sampler.dp_event(1.3, 20)
    ledger = made.ledger(20)
    assert ledger.noise_scheme == "zero_for_test"
    assert ledger.to_dict()["noise_scheme"] == "zero_for_test"
    assert privacy.PrivacyLedger.from_dict(ledger.to_dict()) == ledger
    # A run resumes only under the same noise.
    plain = engine.make_engine(config.replace(noise_scheme=None), sampler=sampler, key=key)
    assert "noise_scheme" not in plain.ledger(20).to_dict()  # As ledgers without the field.
    assert ledger.differences(plain.ledger(20)) == {
        "noise_scheme": ("zero_for_test", "gaussian")}
    with pytest.raises(ValueError, match="another privacy configuration.*noise_scheme"):
        plain.mechanism.check_checkpoint(ledger.to_dict(), key, "here")


def test_dp_optimizer_fit_releases_the_named_scheme():
    x = np.linspace(-1, 1, 64 * 3, dtype=np.float32).reshape(64, 3)
    y = (x.sum(1) > 0).astype(np.int32)

    def fit(**options):
        keras.utils.set_random_seed(0)
        model = tfdp.make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
        model.compile(optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(0.5), l2_norm_clip=1.0,
                                                 insecure_reproducible_seed=1, **options),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        return model

    zero = fit(noise_multiplier=4.0, noise_scheme="zero_for_test")
    noiseless = fit(noise_multiplier=0.0)
    noisy = fit(noise_multiplier=4.0)
    for z, n, g in zip(zero.get_weights(), noiseless.get_weights(), noisy.get_weights()):
        np.testing.assert_allclose(z, n, rtol=0, atol=1e-6)
        assert np.abs(z - g).max() > 1e-2
    assert zero.optimizer.mechanism.noise_scheme == "zero_for_test"
    assert zero.optimizer.get_config()["noise_scheme"] == "zero_for_test"
