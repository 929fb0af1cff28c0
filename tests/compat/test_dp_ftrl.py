"""DP-FTRL by tree aggregation: the engine's tree noise, its accounting, the compat optimizer."""

import math

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf
from dp_accounting import rdp as dp_rdp

import tfdp
from tests.compat import custom_loop_models as models
from tests.keras.keras_test_case import digits
from tests.keras.keras_test_case import tiny_model
from tfdp.compat import tensorflow_privacy
from tfdp.dp import noise as noise_lib
from tfdp.dp import noisy_aggregator
from tfdp.dp import tree_noise
from tfdp.privacy import accounting
from tfdp.privacy import tree_aggregation

KEY = [0x1234, 0x5678]  # A public noise key: these tests read the noise.


def _released_noise(restarts, steps, size=1, stddev=1.0):
    """The noise each of `steps` steps releases (zero sums, divisor 1): `[steps, size]`."""
    aggregator = noisy_aggregator.NoisyAggregator(
        noise_stddev=stddev, expected_batch_size=1.0, noise_key=KEY, tree=restarts)
    zeros = [tf.Variable(tf.zeros([size]))]
    step_fn = tf.function(lambda s: aggregator.noisy_mean(zeros, s)[0])
    return np.stack([step_fn(tf.constant(s, tf.int64)).numpy() for s in range(steps)])


def _node(tree, span, end, size=1, stddev=1.0):
    like = [tf.zeros([size])]
    return noise_lib.gaussian_noise(
        like, stddev, tree_noise.node_seed(KEY, tree, span, end))[0].numpy()


def _dyadic_blocks(n):
    """The (span, end) blocks of [0, n)'s binary decomposition, largest first."""
    blocks, start = [], 0
    for bit in reversed(range(n.bit_length())):
        if n >> bit & 1:
            start += 1 << bit
            blocks.append((1 << bit, start))
    return blocks


def test_prefix_sums_of_the_released_noise_are_the_trees_nodes():
    released = _released_noise(tree_aggregation.TreeRestarts(), 11, size=3)
    cumulative = np.cumsum(released, axis=0)
    for n in range(1, 12):
        expected = sum(_node(0, span, end, size=3) for span, end in _dyadic_blocks(n))
        np.testing.assert_allclose(cumulative[n - 1], expected, rtol=1e-5, atol=1e-5)


def test_prefix_noise_variance_is_sigma_squared_times_the_nodes_of_n():
    # Var(cum(n)) = (σC)²·popcount(n): one node per set bit of n.
    stddev, size, steps = 0.5, 20000, 16
    cumulative = np.cumsum(_released_noise(
        tree_aggregation.TreeRestarts(), steps, size=size, stddev=stddev), axis=0)
    for n in range(1, steps + 1):
        expected = stddev**2 * bin(n).count("1")
        # Relative std of a variance estimate over `size` draws: sqrt(2 / size) = 1 %.
        np.testing.assert_allclose(np.var(cumulative[n - 1]), expected, rtol=0.05)
    # The released noise of step n − 1 has variance (1 + k)σ², 2^k the lowest bit of n.
    released = np.diff(np.concatenate([np.zeros((1, size)), cumulative]), axis=0)
    for n in (1, 2, 4, 8, 16):
        np.testing.assert_allclose(np.var(released[n - 1]),
                                   stddev**2 * (1 + int(math.log2(n))), rtol=0.05)


def test_restarts_start_a_new_tree():
    restarts = tree_aggregation.TreeRestarts(restart_period=4, restart_warmup=3)
    released = _released_noise(restarts, 10, size=2)
    # The first tree has 3 steps, then trees of 4: each one's prefix sums are its own nodes.
    for first, tree, size in ((0, 0, 3), (3, 1, 4), (7, 2, 3)):
        cumulative = np.cumsum(released[first:first + size], axis=0)
        for n in range(1, size + 1):
            expected = sum(_node(tree, span, end, size=2) for span, end in _dyadic_blocks(n))
            np.testing.assert_allclose(cumulative[n - 1], expected, rtol=1e-5, atol=1e-5)
    # Without warmup the trees are [0, 4), [4, 8), ...
    assert tree_aggregation.TreeRestarts(4).trees(10) == [(0, 4), (4, 4), (8, 2)]
    assert restarts.trees(10) == [(0, 3), (3, 4), (7, 3)]


@pytest.mark.parametrize("period,warmup", [(None, None), (4, None), (5, 2)])
def test_graph_tree_and_leaf_agree_with_the_schedule(period, warmup):
    restarts = tree_aggregation.TreeRestarts(period, warmup)
    for step in range(23):
        tree, leaf = tree_noise.tree_and_leaf(tf.constant(step, tf.int64), restarts)
        assert (int(tree), int(leaf)) == restarts.tree_and_leaf(step)


@pytest.mark.parametrize("kwargs,match", [
    ({"restart_warmup": 2}, "restart_warmup needs a restart_period"),
    ({"restart_period": 0}, "restart_period must be"),
    ({"restart_period": 4, "restart_warmup": 4}, "restart_warmup must be"),
])
def test_bad_restarts_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tree_aggregation.TreeRestarts(**kwargs)


def _rdp_epsilon(event, delta):
    accountant = dp_rdp.RdpAccountant(
        orders=accounting.RDP_ORDERS,
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    accountant.compose(event)
    return accountant.get_epsilon(delta)


def test_epsilon_is_dp_accountings_tree_event():
    # 1000 examples, B = 100: 10 steps a pass; restarts every 5 steps, 3 passes.
    ledger = tree_aggregation.TreeAggregationLedger(
        1.2, delta=1e-5, steps=30, dataset_size=1000, batch_size=100,
        restarts=tree_aggregation.TreeRestarts(5))
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SingleEpochTreeAggregationDpEvent(1.2, [5, 5]), 3)
    assert ledger.epsilon() == pytest.approx(_rdp_epsilon(event, 1e-5), rel=1e-9)
    # Replace-one: σ / 2. Microbatches (sensitivity 2): σ / 2 as well.
    half = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SingleEpochTreeAggregationDpEvent(0.6, [5, 5]), 3)
    assert ledger.epsilon_replace_one() == pytest.approx(_rdp_epsilon(half, 1e-5), rel=1e-9)


def test_a_tree_across_passes_counts_each_example_in_it_m_times():
    # One tree of 30 steps over 3 passes: each node moves by up to 3C and an
    # example's leaves cover up to 3·depth nodes: Gaussian σ / (3·√depth).
    ledger = tree_aggregation.TreeAggregationLedger(
        4.0, delta=1e-5, steps=30, dataset_size=1000, batch_size=100,
        restarts=tree_aggregation.TreeRestarts())
    depth = math.ceil(math.log2(31))
    event = dp_accounting.GaussianDpEvent(4.0 / (3 * math.sqrt(depth)))
    assert ledger.epsilon() == pytest.approx(_rdp_epsilon(event, 1e-5), rel=1e-9)
    # Within one pass the same tree is dp_accounting's single-epoch event.
    one_pass = tree_aggregation.TreeAggregationLedger(
        4.0, delta=1e-5, steps=10, dataset_size=1000, batch_size=100,
        restarts=tree_aggregation.TreeRestarts())
    event = dp_accounting.SingleEpochTreeAggregationDpEvent(4.0, [10])
    assert one_pass.epsilon() == pytest.approx(_rdp_epsilon(event, 1e-5), rel=1e-9)
    assert one_pass.max_steps_within(one_pass.epsilon()) >= 10


def test_optimizer_arguments():
    with pytest.raises(ValueError, match="restart_warmup needs a restart_period"):
        tensorflow_privacy.DPFTRLTreeAggregationOptimizer(1.0, 1.0, None, restart_warmup=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be"):
        tensorflow_privacy.DPFTRLTreeAggregationOptimizer(
            1.0, 1.0, None, gradient_accumulation_steps=0)
    accumulating = tensorflow_privacy.DPFTRLTreeAggregationOptimizer(
        1.0, 1.1, None, gradient_accumulation_steps=4, learning_rate=0.2)
    # σ is each tree node's, not scaled by √k: every leaf draws its own nodes.
    assert accumulating.noise_multiplier == 1.1
    assert accumulating.tf_privacy_noise_multiplier == 1.1
    config = accumulating.get_config()
    assert config["gradient_accumulation_steps"] == 4 and config["noise_multiplier"] == 1.1
    clone = tensorflow_privacy.DPFTRLTreeAggregationOptimizer.from_config(config)
    assert (clone.accumulation_steps, clone.noise_multiplier) == (4, 1.1)
    opt = tensorflow_privacy.DPFTRLTreeAggregationOptimizer(
        1.0, 1.1, None, num_microbatches=4, restart_period=8, restart_warmup=3,
        learning_rate=0.2, momentum=0.9)
    config = opt.get_config()
    assert config["restart_period"] == 8 and config["momentum"] == 0.9
    clone = tensorflow_privacy.DPFTRLTreeAggregationOptimizer.from_config(config)
    assert (clone.restart_period, clone.restart_warmup, clone.noise_multiplier) == (8, 3, 1.1)


def test_fit_releases_the_tree_noise_and_prints_its_epsilon():
    # σ > 0 and a zero clip norm: the weights move by -lr · noise / B only,
    # so the weights' drift is the tree's prefix noise.
    x, y = digits(64)
    model = tfdp.make_private(tiny_model())
    opt = tensorflow_privacy.DPFTRLTreeAggregationOptimizer(
        1e-9, 1e8, model, restart_period=4, noise_seed=3, learning_rate=1.0)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None))
    model.build((None, 8, 8, 1))
    before = model.model.trainable_variables[-1].numpy()  # The head's bias, 10 values.
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # 4 steps: one tree.
    after = model.model.trainable_variables[-1].numpy()
    key = opt.mechanism_builder.secret_key.derive("noise")
    like = [tf.zeros(v.shape) for v in model.model.trainable_variables]
    stddev = 1e-9 * 1e8
    prefix = noise_lib.gaussian_noise(like, stddev, tree_noise.node_seed(key, 0, 4, 4))[-1]
    np.testing.assert_allclose(after - before, -prefix.numpy() / 16, rtol=1e-4, atol=1e-6)
    ledger = opt.ledger()
    assert isinstance(ledger, tree_aggregation.TreeAggregationLedger)
    assert ledger.steps == 4 and ledger.adjacency == "zero_out"
    event = dp_accounting.SingleEpochTreeAggregationDpEvent(1e8, [4])
    assert ledger.epsilon() == pytest.approx(_rdp_epsilon(event, ledger.delta), rel=1e-9)
    text = opt.describe_epsilon()
    assert "zero_out adjacency" in text and "DP-FTRL tree aggregation" in text


@pytest.mark.slow
def test_dp_ftrl_learns_digits():
    x, y = digits()
    keras.utils.set_random_seed(0)
    model = tfdp.make_private(tiny_model())
    steps_per_epoch = len(x) // 64
    opt = tensorflow_privacy.DPFTRLTreeAggregationOptimizer(
        1.0, 1.0, model, restart_period=steps_per_epoch, learning_rate=0.5, momentum=0.9)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None), metrics=["accuracy"])
    history = model.fit(x, y, batch_size=64, epochs=6, verbose=0)
    assert history.history["accuracy"][-1] > 0.7
    assert math.isfinite(opt.ledger().epsilon())


def test_custom_loop_minimize_follows_the_noisy_prefix_sum():
    # Zero gradients (a constant loss): after n steps of plain SGD the weights
    # moved by -lr · cum(n) / B, the tree's prefix noise, here n = 3 = 2 + 1.
    model, (var,) = models.offsets_model(np.zeros([5]))
    opt = tensorflow_privacy.DPFTRLTreeAggregationOptimizer(
        1.0, 2.0, model, noise_seed=5, learning_rate=0.5)
    opt.declare_model(model, models.zero_loss)
    for _ in range(3):
        with tf.GradientTape() as tape:
            loss = models.zero_loss(None, model(tf.zeros([4, 5])))
        opt.minimize(loss, [var], tape=tape)
    key = opt.mechanism_builder.secret_key.derive("noise")
    like = [tf.zeros([5])]
    prefix = sum(noise_lib.gaussian_noise(like, 2.0, tree_noise.node_seed(key, 0, span, end))[0]
                 for span, end in _dyadic_blocks(3))
    np.testing.assert_allclose(var.numpy(), -0.5 * prefix.numpy() / 4, rtol=1e-4, atol=1e-6)
    assert opt.ledger(dataset_size=40).steps == 3


def test_fit_on_a_stream_is_refused_before_any_update():
    x, y = digits(64)
    model = tfdp.make_private(tiny_model())
    optimizer = tensorflow_privacy.DPFTRLTreeAggregationOptimizer(
        1.0, 1.0, learning_rate=0.1, noise_seed=1)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stream = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    with pytest.raises(ValueError, match="accounts its trees pass by pass"):
        model.fit(stream, verbose=0)
    assert int(optimizer.iterations.numpy()) == 0


# ----------------------------------------------------------------------
# gradient_accumulation_steps = k: a tree leaf per batch, as TF-Privacy's.
# ----------------------------------------------------------------------


def _released_step_noise(restarts, steps, leaves_per_step, size=1, stddev=1.0):
    aggregator = noisy_aggregator.NoisyAggregator(
        noise_stddev=stddev, expected_batch_size=1.0, noise_key=KEY, tree=restarts,
        leaves_per_step=leaves_per_step)
    zeros = [tf.Variable(tf.zeros([size]))]
    step_fn = tf.function(lambda s: aggregator.noisy_mean(zeros, s)[0])
    return np.stack([step_fn(tf.constant(s, tf.int64)).numpy() for s in range(steps)])


@pytest.mark.parametrize("period,warmup", [(None, None), (3, None), (5, 2)])
def test_a_step_of_k_leaves_releases_the_sum_of_their_increments(period, warmup):
    # TF-Privacy adds leaf j's increment to batch j and applies the mean of
    # k batches: step u holds the increments of leaves u·k … u·k + k − 1,
    # restarts counting leaves (here some steps straddle a restart).
    restarts = tree_aggregation.TreeRestarts(period, warmup)
    k, steps = 3, 5
    per_leaf = _released_noise(restarts, k * steps, size=4)
    per_step = _released_step_noise(restarts, steps, k, size=4)
    np.testing.assert_allclose(per_step, per_leaf.reshape(steps, k, 4).sum(axis=1),
                               rtol=1e-5, atol=1e-5)


def test_prefix_noise_after_u_steps_of_k_leaves_is_the_tree_at_leaf_u_k():
    # One tree: the noise in the weights after u updates is cum(u·k), whose
    # variance is (σC)²·popcount(u·k): each node of σ, no √k.
    stddev, size, k = 0.5, 20000, 2
    cumulative = np.cumsum(_released_step_noise(
        tree_aggregation.TreeRestarts(), 6, k, size=size, stddev=stddev), axis=0)
    for u in range(1, 7):
        np.testing.assert_allclose(np.var(cumulative[u - 1]),
                                   stddev**2 * bin(u * k).count("1"), rtol=0.05)
    expected = sum(_node(0, span, end, size=size, stddev=stddev)
                   for span, end in _dyadic_blocks(6 * k))
    np.testing.assert_allclose(cumulative[-1], expected, rtol=1e-4, atol=1e-4)


def test_accumulation_without_noise_is_tf_privacys_update():
    # TF-Privacy's testLargeBatchEmulationNoNoise: the update after k = 2
    # batches is the mean of their mean clipped gradients.
    # TF-Privacy's loss var0·xᵀ + var1 of each row: a Dense layer's output.
    model, (var0, var1) = models.linear_model([[1.0, 2.0]], [3.0])
    x1 = tf.constant([[2.0, 0.0], [0.0, 1.0]])
    x2 = tf.constant([[4.0, 2.0], [2.0, 1.0]])
    opt = tensorflow_privacy.DPFTRLTreeAggregationOptimizer(
        100.0, 0.0, model, gradient_accumulation_steps=2, learning_rate=1.0)
    opt.declare_model(model, models.prediction)
    expected = [([[1.0, 2.0]], [3.0], 0), ([[-1.0, 1.0]], [2.0], 1),
                ([[-1.0, 1.0]], [2.0], 1), ([[-4.0, -0.5]], [1.0], 2)]
    for x, (w0, w1, updates) in zip([x1, x2, x2, x2], expected):
        opt.minimize(lambda: models.prediction(None, model(x)), [var0, var1])
        np.testing.assert_allclose(var0.numpy().T, w0, rtol=1e-6)
        np.testing.assert_allclose(var1.numpy(), w1, rtol=1e-6)
        assert int(opt.iterations) == updates


def test_custom_loop_with_accumulation_applies_the_leaves_prefix_noise():
    # Zero gradients, k = 2 batches of 4 rows: after 3 updates the weights
    # moved by -lr · cum(6) / (k · 4), the prefix noise of 6 leaves.
    model, (var,) = models.offsets_model(np.zeros([5]))
    opt = tensorflow_privacy.DPFTRLTreeAggregationOptimizer(
        1.0, 2.0, model, gradient_accumulation_steps=2, noise_seed=5, learning_rate=0.5)
    opt.declare_model(model, models.zero_loss)
    for _ in range(6):
        with tf.GradientTape() as tape:
            loss = models.zero_loss(None, model(tf.zeros([4, 5])))
        opt.minimize(loss, [var], tape=tape)
    key = opt.mechanism_builder.secret_key.derive("noise")
    like = [tf.zeros([5])]
    prefix = sum(noise_lib.gaussian_noise(like, 2.0, tree_noise.node_seed(key, 0, span, end))[0]
                 for span, end in _dyadic_blocks(6))
    np.testing.assert_allclose(var.numpy(), -0.5 * prefix.numpy() / 8, rtol=1e-4, atol=1e-6)
    ledger = opt.ledger(dataset_size=48)
    assert (ledger.steps, ledger.leaves_per_step, ledger.batch_size) == (3, 2, 8)
    # 48 examples, batches of 4: a pass is 12 leaves, so the 6 leaves are one
    # tree within one pass.
    event = dp_accounting.SingleEpochTreeAggregationDpEvent(2.0, [6])
    assert ledger.epsilon() == pytest.approx(_rdp_epsilon(event, ledger.delta), rel=1e-9)


def test_epsilon_with_accumulation_accounts_the_leaves():
    # N = 1000, updates of B = 100 made of k = 2 leaves of 50: 10 updates and
    # 20 leaves a pass; restarts every 10 leaves; 3 passes = 30 updates.
    ledger = tree_aggregation.TreeAggregationLedger(
        1.2, delta=1e-5, steps=30, dataset_size=1000, batch_size=100,
        restarts=tree_aggregation.TreeRestarts(10), leaves_per_step=2)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SingleEpochTreeAggregationDpEvent(1.2, [10, 10]), 3)
    assert ledger.epsilon() == pytest.approx(_rdp_epsilon(event, 1e-5), rel=1e-9)
    assert ledger.max_steps_within(ledger.epsilon()) >= 30
    assert "2 batches a step" in ledger.describe_epsilon()
    # The same leaves without accumulation: the same ε (more updates, each of one leaf).
    leaves = tree_aggregation.TreeAggregationLedger(
        1.2, delta=1e-5, steps=60, dataset_size=1000, batch_size=50,
        restarts=tree_aggregation.TreeRestarts(10))
    assert leaves.epsilon() == pytest.approx(ledger.epsilon(), rel=1e-12)
    with pytest.raises(ValueError, match="leaves_per_step"):
        tree_aggregation.TreeAggregationLedger(
            1.2, delta=1e-5, steps=1, dataset_size=10, batch_size=2,
            restarts=tree_aggregation.TreeRestarts(), leaves_per_step=0)


def test_fit_with_accumulation_releases_the_leaves_noise_and_prints_its_epsilon():
    # 64 examples, fit batches of 16, k = 2: 2 updates, 4 leaves a pass.
    x, y = digits(64)
    model = tfdp.make_private(tiny_model())
    opt = tensorflow_privacy.DPFTRLTreeAggregationOptimizer(
        1e-9, 1e8, model, gradient_accumulation_steps=2, noise_seed=3, learning_rate=1.0)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None))
    model.build((None, 8, 8, 1))
    before = model.model.trainable_variables[-1].numpy()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    after = model.model.trainable_variables[-1].numpy()
    assert int(opt.iterations) == 2
    key = opt.mechanism_builder.secret_key.derive("noise")
    like = [tf.zeros(v.shape) for v in model.model.trainable_variables]
    prefix = noise_lib.gaussian_noise(like, 1e-9 * 1e8, tree_noise.node_seed(key, 0, 4, 4))[-1]
    np.testing.assert_allclose(after - before, -prefix.numpy() / 32, rtol=1e-4, atol=1e-6)
    ledger = opt.ledger()
    assert (ledger.steps, ledger.leaves_per_step) == (2, 2)
    event = dp_accounting.SingleEpochTreeAggregationDpEvent(1e8, [4])
    assert ledger.epsilon() == pytest.approx(_rdp_epsilon(event, ledger.delta), rel=1e-9)
