"""banded_user_poisson: b secret groups of users, step t samples group t mod b's users."""

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import privacy
from tfdp import samplers
from tfdp.secret_key import SecretKey

KEY = SecretKey(np.array([21, 22])).derive("sampling")


def _user_ids(users, per_user=3):
    return np.random.default_rng(0).permutation(np.repeat(np.arange(users), per_user))


def _sampler(users, per_step, bands, k=2, name="banded_user_poisson", hosts=1):
    banded = {"bands": bands} if name == "banded_user_poisson" else {}
    return samplers.make_sampler(
        name, dataset_size=users, logical_batch_size=per_step, num_hosts=hosts,
        user_ids=_user_ids(users), max_examples_per_user=k, **banded)


def _traced(sampler, fn):
    return tf.function(lambda s: fn(sampler, s), autograph=False)


def _masks(sampler, steps):
    fn = _traced(sampler, lambda sm, s: sm.mask(KEY, s))
    return np.stack([fn(tf.constant(s, tf.int64)).numpy() for s in range(steps)])


class TestGroupsOfUsers:

    @pytest.mark.parametrize("users, bands", [(400, 4), (403, 4), (101, 7)])
    def test_each_user_is_in_exactly_one_group(self, users, bands):
        groups = _sampler(users, 10, bands).groups(KEY).numpy()
        assert groups.shape == (users,) and groups.min() >= 0 and groups.max() < bands
        assert np.bincount(groups, minlength=bands).sum() == users

    def test_the_users_split_is_banded_poissons_split_of_as_many_units(self):
        # One group-split code for examples and users: N units split alike.
        users = _sampler(400, 10, 4).groups(KEY).numpy()
        examples = samplers.make_sampler("banded_poisson", dataset_size=400,
                                         logical_batch_size=10, bands=4).groups(KEY).numpy()
        np.testing.assert_array_equal(users, examples)

    def test_users_are_sampled_only_on_their_groups_steps_at_rate_q(self):
        users, per_step, bands, steps = 600, 15, 4, 400
        sampler = _sampler(users, per_step, bands)
        groups = sampler.groups(KEY).numpy()
        masks = _masks(sampler, steps)
        step_groups = np.arange(steps) % bands
        assert not np.any(masks & (groups[None, :] != step_groups[:, None]))
        q = sampler.group_sampling_rate
        assert q == bands * per_step / users
        own = masks[step_groups[:, None] == groups[None, :]]
        assert own.size == users * steps // bands
        assert abs(own.mean() - q) < 5 * np.sqrt(q * (1 - q) / own.size)

    def test_each_step_holds_only_its_groups_users_with_at_most_k_examples(self):
        users, k = 120, 2
        sampler = _sampler(users, 6, 3, k=k, hosts=2)
        ids = sampler.user_ids
        groups = sampler.groups(KEY).numpy()
        fn = {host: _traced(sampler, lambda sm, s, h=host: sm.step_indices(KEY, s, h))
              for host in range(2)}
        for step in range(9):
            for host in range(2):
                indices, weights = fn[host](tf.constant(step, tf.int64))
                blocks = indices.numpy().reshape(-1, k)
                for block in blocks:
                    real = block[block >= 0]
                    if real.size:
                        assert len(set(ids[real])) == 1  # One user per block of k rows.
                        assert groups[ids[real[0]]] == step % 3


class TestOneBandIsUserPoisson:

    def test_one_band_draws_user_poissons_batches_and_events(self):
        banded = _sampler(300, 20, 1, k=3)
        plain = _sampler(300, 20, None, k=3, name="user_poisson")
        np.testing.assert_array_equal(_masks(banded, 5), _masks(plain, 5))
        for step in range(3):
            s = tf.constant(step, tf.int64)
            for got, want in zip(banded.step_indices(KEY, s), plain.step_indices(KEY, s)):
                np.testing.assert_array_equal(got.numpy(), want.numpy())
        assert banded.dp_event(1.0, 100) == plain.dp_event(1.0, 100)
        assert banded.privacy_unit == "user" and banded.adjacency == plain.adjacency


class TestAccounting:

    @pytest.mark.parametrize("accountant", ["rdp", "pld"])
    def test_epsilon_is_the_rounds_at_the_users_group_rate(self, accountant):
        users, per_step, bands, steps, sigma, delta = 500, 10, 4, 101, 1.1, 1e-5
        sampler = _sampler(users, per_step, bands)
        config = tfdp.DPSGDConfig(1.0, sigma, delta=delta, accountant=accountant,
                                  privacy_unit="user", max_examples_per_user=2, bands=bands)
        ledger = tfdp.DPSGD.from_config(config, sampler=sampler).ledger(steps)
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(bands * per_step / users,
                                                dp_accounting.GaussianDpEvent(sigma)),
            -(-steps // bands))
        if accountant == "rdp":
            reference = dp_accounting.rdp.RdpAccountant()
        else:
            reference = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
        reference.compose(event)
        assert ledger.epsilon() == pytest.approx(reference.get_epsilon(delta),
                                                 rel=1e-9 if accountant == "rdp" else 1e-2)
        assert ledger.privacy_unit == "user" and ledger.bands == bands
        # The ledger rebuilt from its record accounts the same rounds.
        again = privacy.PrivacyLedger.from_json(ledger.to_json())
        assert again.sampler == "banded_user_poisson" and again.epsilon() == ledger.epsilon()

    def test_private_tuning_rebuilds_the_runs_event_from_its_ledger(self):
        from tfdp.tuning import selection_accounting

        sampler = _sampler(500, 10, 4)
        ledger = tfdp.DPSGD(1.0, 1.2, sampler=sampler, delta=1e-5).ledger(37)
        event, relation = selection_accounting.run_event(ledger)
        assert event == sampler.dp_event(1.2, 37)
        assert relation == sampler.neighboring_relation

    def test_accounting_sampler_keeps_bands_and_hosts(self):
        sampler = _sampler(500, 10, 4)
        assert sampler.with_hosts(2).bands == 4 and sampler.with_hosts(2).user_ids is not None
        accounted = samplers.for_accounting("banded_user_poisson", 0.02, 500, 10, bands=4)
        assert accounted.dp_event(1.0, 10) == sampler.dp_event(1.0, 10)
        assert "bands=4" in repr(sampler) and "N_users=500" in sampler.describe()

    def test_refuses_more_bands_than_the_users_can_fill(self):
        with pytest.raises(ValueError, match="bands × logical_batch_size must not exceed.*users"):
            _sampler(100, 30, 4)

    def test_the_group_privacy_comparison_is_refused_for_banded_runs(self):
        ledger = tfdp.DPSGD(1.0, 1.0, sampler=_sampler(500, 10, 4)).ledger(10)
        with pytest.raises(ValueError, match="bands=4"):
            privacy.example_level_claim(ledger, 2)
