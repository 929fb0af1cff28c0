"""The banded_poisson sampler: b secret groups, step t samples group t mod b at rate q."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp import samplers
from tfdp.secret_key import SecretKey

KEY = SecretKey(np.array([11, 12])).derive("sampling")
OTHER_KEY = SecretKey(np.array([13, 14])).derive("sampling")


def _sampler(n, b, bands, hosts=1):
    return samplers.make_sampler("banded_poisson", dataset_size=n, logical_batch_size=b,
                                 bands=bands, num_hosts=hosts)


def _masks(sampler, steps, key=KEY):
    fn = tf.function(lambda s: sampler.mask(key, s), autograph=False)
    return np.stack([fn(tf.constant(s, tf.int64)).numpy() for s in range(steps)])


class TestGroups:

    @pytest.mark.parametrize("n, bands", [(1000, 4), (1003, 4), (101, 7)])
    def test_each_example_is_in_exactly_one_group(self, n, bands):
        groups = _sampler(n, 10, bands).groups(KEY).numpy()
        assert groups.shape == (n,) and groups.min() >= 0 and groups.max() < bands
        assert np.bincount(groups, minlength=bands).sum() == n

    def test_an_examples_group_does_not_depend_on_the_others(self):
        # The privacy argument conditions on the other units' groups: adding
        # a unit must leave theirs as they were (a balanced split moves them).
        for bands in (2, 3, 5):
            groups = [_sampler(n, 1, bands).groups(KEY).numpy() for n in range(bands, 40)]
            for shorter, longer in zip(groups, groups[1:]):
                np.testing.assert_array_equal(longer[:len(shorter)], shorter)

    def test_groups_are_independent_and_uniform_over_keys(self):
        # Chi-square over 3,000 keys: each unit's group is uniform, and each
        # pair of units' groups is uniform over the b² pairs (independence).
        from scipy import stats
        n, bands, keys = 5, 3, 3000
        sampler = _sampler(n, 1, bands)
        draw = tf.function(sampler.groups, autograph=False)
        rows = np.stack([draw(tf.constant([7, k], tf.int64)).numpy() for k in range(keys)])
        for i in range(n):
            assert stats.chisquare(np.bincount(rows[:, i], minlength=bands)).pvalue > 1e-3
        for i in range(n):
            for j in range(i + 1, n):
                pairs = np.bincount(rows[:, i] * bands + rows[:, j], minlength=bands**2)
                assert stats.chisquare(pairs).pvalue > 1e-3
        # The group sizes vary: Binomial(N, 1/b), not a balanced split.
        sizes = {tuple(np.bincount(r, minlength=bands)) for r in rows}
        assert (5, 0, 0) in sizes and (2, 2, 1) in sizes

    def test_the_split_is_secret(self):
        sampler = _sampler(1000, 10, 4)
        a, b = sampler.groups(KEY).numpy(), sampler.groups(OTHER_KEY).numpy()
        assert (a != b).mean() > 0.5
        assert not np.array_equal(np.sort(np.flatnonzero(a == 0)), np.arange(250))

    def test_the_split_is_drawn_once_per_key_and_is_the_same_in_a_graph(self):
        # Each step's mask reuses the key's groups; traced or eager, a key splits alike, and
        # a key known only when the graph runs is drawn there to the same split.
        sampler = _sampler(1000, 10, 4)
        eager = sampler.groups(KEY)
        assert sampler.groups(KEY) is eager
        traced = tf.function(lambda: sampler.groups(KEY), autograph=False)()
        fresh = _sampler(1000, 10, 4)
        symbolic = tf.function(fresh.groups, autograph=False)(tf.constant(KEY, tf.int64))
        np.testing.assert_array_equal(traced.numpy(), eager.numpy())
        np.testing.assert_array_equal(symbolic.numpy(), eager.numpy())
        assert not np.array_equal(sampler.groups(OTHER_KEY).numpy(), eager.numpy())

    def test_examples_are_sampled_only_on_their_groups_steps_at_rate_q(self):
        n, batch, bands, steps = 2000, 50, 4, 400
        sampler = _sampler(n, batch, bands)
        groups = sampler.groups(KEY).numpy()
        masks = _masks(sampler, steps)
        step_groups = np.arange(steps) % bands
        assert not np.any(masks & (groups[None, :] != step_groups[:, None]))
        q = sampler.group_sampling_rate
        assert q == bands * batch / n
        # Per example: its group's steps are steps / bands trials at rate q.
        own = masks[np.arange(steps)[:, None], np.arange(n)[None, :]][
            step_groups[:, None] == groups[None, :]]
        trials = own.size
        assert trials == n * steps // bands
        assert abs(own.mean() - q) < 5 * np.sqrt(q * (1 - q) / trials)
        assert abs(masks.sum(1).mean() - batch) < 5 * np.sqrt(batch / steps)

    def test_step_indices_hold_only_the_groups_examples(self):
        sampler = _sampler(500, 20, 5, hosts=2)
        groups = sampler.groups(KEY).numpy()
        for step in range(10):
            for host in range(2):
                indices, weights = sampler.step_indices(KEY, tf.constant(step, tf.int64), host)
                real = indices.numpy()[weights.numpy() > 0]
                assert np.all(groups[real] == step % 5)


class TestDpSgdAtOneBand:

    def test_one_band_draws_poissons_batches(self):
        banded = _sampler(3000, 64, 1)
        poisson = samplers.make_sampler("poisson", dataset_size=3000, logical_batch_size=64)
        np.testing.assert_array_equal(_masks(banded, 5), _masks(poisson, 5))
        assert banded.dp_event(1.0, 100) == poisson.dp_event(1.0, 100)


class TestSamplerContract:

    def test_with_hosts_and_accounting_keep_the_bands(self):
        sampler = _sampler(1000, 10, 4)
        assert sampler.with_hosts(2).bands == 4
        assert "bands=4" in repr(sampler) and "bands=4" in sampler.describe()
        accounted = samplers.for_accounting("banded_poisson", 0.01, 1000, 10, bands=4)
        assert accounted.dp_event(1.0, 10) == sampler.dp_event(1.0, 10)
        assert sampler != _sampler(1000, 10, 2)

    def test_refuses_more_bands_than_the_groups_can_fill(self):
        with pytest.raises(ValueError, match="bands × logical_batch_size"):
            _sampler(100, 30, 4)
        with pytest.raises(ValueError, match="bands"):
            _sampler(100, 10, 0)
