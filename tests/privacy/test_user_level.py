"""User-level sampling: users per step, each user's examples, the blocks, the accounting."""

import json
import os
import subprocess

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from tfdp import privacy
from tfdp import samplers
from tfdp.dp import user_groups
from tests.test_train import run_train

KEY = tf.constant([7, 11], tf.int64)


def _user_ids(counts):
    """Example i's user, for users with `counts[u]` examples, shuffled order."""
    ids = np.repeat(np.arange(len(counts)), counts)
    return np.random.default_rng(0).permutation(ids)


def _sampler(counts, users_per_step, k, physical=None, hosts=1):
    return samplers.make_sampler(
        "user_poisson", dataset_size=len(counts), logical_batch_size=users_per_step,
        physical_batch_size=physical, num_hosts=hosts, user_ids=_user_ids(counts),
        max_examples_per_user=k,
    )


_TRACED = {}


def _blocks(sampler, step, key=KEY, host=0, granule=None):
    # One trace per sampler and layout: hundreds of eager draws were slow.
    fn = _TRACED.setdefault((sampler, host, granule), tf.function(
        lambda key, step: sampler.step_indices(key, step, host, granule), autograph=False))
    indices, weights = fn(tf.constant(key, tf.int64), tf.constant(step, tf.int64))
    k = sampler.max_examples_per_user
    return indices.numpy().reshape(-1, k), weights.numpy().reshape(-1, k)


class UserPoissonSamplerTest(tf.test.TestCase):

    def test_users_per_step_are_poisson(self):
        # 400 users, 40 expected per step: Binomial(400, 0.1), mean 40, var 36.
        counts = np.full(400, 2)
        sampler = _sampler(counts, 40, k=2)
        drawn = []
        for step in range(300):
            blocks, weights = _blocks(sampler, step)
            drawn.append(int(np.sum(weights[:, 0] > 0)))
        drawn = np.array(drawn)
        self.assertAllClose(sampler.expected_batch_size, 40.0)
        self.assertLess(abs(drawn.mean() - 40.0), 4 * np.sqrt(36.0 / 300))
        # A fixed-size draw has variance 0: the realised sizes vary as Binomial's.
        self.assertBetween(drawn.var(ddof=1), 36.0 * 0.7, 36.0 * 1.3)

    def test_each_user_brings_min_k_and_n_of_their_own_examples(self):
        counts = np.array([1, 2, 3, 4, 9, 5, 1, 7])
        ids = _user_ids(counts)
        k = 4
        sampler = samplers.make_sampler(
            "user_poisson", dataset_size=len(counts), logical_batch_size=4,
            physical_batch_size=8, user_ids=ids, max_examples_per_user=k)
        seen = 0
        for step in range(20):
            blocks, weights = _blocks(sampler, step, granule=4)
            self.assertEqual(blocks.size % 4, 0)
            for rows, w in zip(blocks, weights):
                real = rows >= 0
                c = int(real.sum())
                if c == 0:
                    self.assertAllEqual(w, np.zeros(k))
                    continue
                seen += 1
                # Real rows first, then padding; all from one user, distinct.
                self.assertAllEqual(real, np.arange(k) < c)
                users = set(ids[rows[real]].tolist())
                self.assertLen(users, 1)
                user = users.pop()
                self.assertEqual(c, min(k, counts[user]))
                self.assertLen(set(rows[real].tolist()), c)
                self.assertAllClose(w, np.where(real, k / c, 0.0))
        self.assertGreater(seen, 20)

    def test_chosen_examples_are_uniform(self):
        # Every user is drawn every step (q = 1); user 0 has 10 examples, k = 3.
        counts = np.array([10, 1])
        ids = _user_ids(counts)
        sampler = samplers.make_sampler(
            "user_poisson", dataset_size=2, logical_batch_size=2, user_ids=ids,
            max_examples_per_user=3)
        steps = 600
        picks = np.zeros(len(ids))
        for step in range(steps):
            blocks, _ = _blocks(sampler, step)
            for rows in blocks:
                picks[rows[rows >= 0]] += 1
        mine = picks[ids == 0]
        self.assertAllEqual(mine.sum(), 3 * steps)
        # Each example is chosen with probability 3/10 at every step.
        _, p_value = stats.chisquare(mine)
        self.assertGreater(p_value, 1e-4)
        self.assertAllEqual(picks[ids == 1], [steps])

    def test_a_pure_function_of_the_key_and_step(self):
        sampler = _sampler(np.full(50, 5), 10, k=3)
        a = _blocks(sampler, 3)[0]
        self.assertAllEqual(a, _blocks(sampler, 3)[0])
        self.assertNotAllEqual(a, _blocks(sampler, 4)[0])
        self.assertNotAllEqual(a, _blocks(sampler, 3, key=tf.constant([1, 2], tf.int64))[0])

    def test_hosts_split_the_users_and_pad_alike(self):
        counts = np.full(60, 3)
        one = _sampler(counts, 20, k=2, physical=8)
        two = one.with_hosts(2, 4)
        for step in range(5):
            blocks, _ = _blocks(one, step)
            first, _ = _blocks(two, step, host=0)
            second, _ = _blocks(two, step, host=1)
            self.assertEqual(first.shape, second.shape)
            self.assertEqual(first.size % 4, 0)
            mine = np.concatenate([first, second])
            self.assertCountEqual(blocks[blocks >= 0].tolist(), mine[mine >= 0].tolist())

    def test_granule_and_physical_batch_must_hold_whole_blocks(self):
        with self.assertRaisesRegex(ValueError, "multiple of `max_examples_per_user`"):
            _sampler(np.full(10, 3), 4, k=3, physical=8)
        sampler = _sampler(np.full(10, 3), 4, k=3, physical=6)
        with self.assertRaisesRegex(ValueError, "granule must be a multiple"):
            sampler.step_indices(KEY, tf.constant(0, tf.int64), granule=2)
        with self.assertRaisesRegex(ValueError, "user id must be in"):
            samplers.make_sampler("user_poisson", dataset_size=2, logical_batch_size=1,
                                  user_ids=np.array([0, 2]), max_examples_per_user=1)
        accounting_only = samplers.for_accounting("user_poisson", 0.01)
        with self.assertRaisesRegex(ValueError, "accounting only"):
            accounting_only.step_indices(KEY, tf.constant(0, tf.int64))

    def test_states_its_unit_and_relation(self):
        sampler = _sampler(np.full(10, 3), 4, k=3, physical=6)
        self.assertEqual(sampler.privacy_unit, "user")
        self.assertEqual(sampler.adjacency_description, "add or remove one user's data")
        self.assertEqual(samplers.sampler_class("poisson").privacy_unit, "example")
        self.assertEqual(sampler.dataset_size, 10)
        self.assertEqual(sampler.num_examples, 30)
        self.assertIn("N_users=10", sampler.describe())
        self.assertNotEqual(sampler, _sampler(np.full(10, 3), 4, k=2, physical=6))


class UserLevelAccountingTest(tf.test.TestCase):

    def test_user_epsilon_is_poisson_epsilon_with_n_users(self):
        users, per_step, sigma, steps, delta = 500, 50, 1.1, 300, 1e-5
        for accountant in ("rdp", "pld"):
            user_level = privacy.epsilon(sigma, steps, delta, dataset_size=users,
                                         batch_size=per_step, sampler="user_poisson",
                                         accountant=accountant)
            example_level = privacy.epsilon(sigma, steps, delta, dataset_size=users,
                                            batch_size=per_step, sampler="poisson",
                                            accountant=accountant)
            self.assertAllClose(user_level, example_level, rtol=1e-9)
            # N counts users: 4,000 examples at the same B would be far cheaper.
            self.assertGreater(user_level, 1.5 * privacy.epsilon(
                sigma, steps, delta, dataset_size=4000, batch_size=per_step,
                accountant=accountant))

    def test_ledger_states_the_unit_and_refuses_a_change_of_unit(self):
        kwargs = dict(delta=1e-5, steps=10, dataset_size=500, batch_size=50)
        user = privacy.PrivacyLedger(1.0, sampler="user_poisson", **kwargs)
        example = privacy.PrivacyLedger(1.0, sampler="poisson", **kwargs)
        self.assertEqual(user.privacy_unit, "user")
        self.assertEqual(example.privacy_unit, "example")
        self.assertIn("add or remove one user's data", user.describe_epsilon())
        self.assertIn("privacy_unit", user.differences(example))
        self.assertEqual(user.differences(example)["privacy_unit"], ("user", "example"))
        self.assertEqual(privacy.PrivacyLedger.from_json(user.to_json()), user)

    def test_group_privacy_conversion(self):
        eps, delta = privacy.group_privacy(0.5, 1e-7, 4)
        self.assertAllClose(eps, 2.0)
        self.assertAllClose(delta, 4 * np.exp(1.5) * 1e-7)
        eps_ex, delta_ex = privacy.example_level_budget(8.0, 1e-5, 20)
        self.assertAllClose(privacy.group_privacy(eps_ex, delta_ex, 20), (8.0, 1e-5))


class UserBlocksTest(tf.test.TestCase):

    def test_blocks_from_row_user_ids(self):
        rows, weights = user_groups.user_blocks([5, 3, 5, -1, 5, 9], 3)
        self.assertAllEqual(rows, [0, 2, 4, 1, -1, -1, 5, -1, -1])
        self.assertAllClose(weights, [1, 1, 1, 3, 0, 0, 3, 0, 0])
        with self.assertRaisesRegex(ValueError, "more rows than"):
            user_groups.user_blocks([1, 1, 1], 2)
        ids, n = user_groups.compact_user_ids(["b", "a", "b", "c"])
        self.assertAllEqual(ids, [1, 0, 1, 2])
        self.assertEqual(n, 3)


class UserLevelTrainerTest(tf.test.TestCase):

    @pytest.mark.slow  # 12-20 s of a whole run or a memory measurement (CI runs it).
    def test_user_level_run_states_its_unit_and_refuses_another_on_resume(self):
        rng = np.random.default_rng(0)
        path = os.path.join(self.create_tempdir().full_path, "users.npz")
        x = rng.integers(0, 255, size=(240, 8, 8, 1)).astype("uint8")
        y = np.arange(240) % 10
        users = rng.integers(0, 60, size=240)
        np.savez(path, x_train=x, y_train=y, user_ids=users, x_test=x[:40], y_test=y[:40])
        workdir = self.create_tempdir().full_path
        common = [f"--gin_param=DataConfig.dataset = 'npz:{path}'",
                  "--gin_param=OptimizationConfig.epochs = 1",
                  "--gin_param=OptimizationConfig.logical_batch_size = 12",
                  "--gin_param=RunConfig.physical_batch_size = 24",
                  "--gin_param=RunConfig.pad_granule = 'auto'",
                  "--gin_param=RunConfig.export_model = False",
                  "--gin_param=RunConfig.write_html_report = False"]
        result = run_train(*common, "--gin_param=PrivacyConfig.privacy_unit = 'user'",
                           "--gin_param=PrivacyConfig.max_examples_per_user = 3", workdir=workdir)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
        users_n = len(np.unique(users))
        self.assertEqual(summary["privacy_unit"], "user")
        self.assertEqual(summary["not_covered_by_epsilon"]["dataset_size"], users_n)
        self.assertEqual(summary["adjacency_description"], "add or remove one user's data")
        self.assertIn("N=%d users" % users_n, result.stdout)
        self.assertIn("sensitivity probe", result.stdout)
        sigma = float(result.stdout.split("privacy: sigma=")[1].split()[0])
        self.assertAllClose(summary["epsilon"], privacy.epsilon(
            sigma, summary["steps"], 1e-5, dataset_size=users_n, batch_size=12), rtol=1e-3)
        claim = summary["example_level_group_privacy"]
        self.assertEqual(claim["group_size"], 3)
        self.assertGreater(claim["group_epsilon"], 3 * claim["example_epsilon"])
        self.assertEqual(claim["group_delta"], 1e-5)
        self.assertGreater(claim["group_epsilon"], summary["epsilon"])
        # The same workdir under example-level privacy: refused, naming the unit.
        again = run_train(*common, "--gin_param=OptimizationConfig.epochs = 2", workdir=workdir)
        self.assertEqual(again.returncode, 2, again.stdout[-2000:])
        self.assertIn("privacy_unit: checkpoint 'user' vs this run 'example'", again.stderr)


@pytest.mark.slow
class UserLevelExampleTest(tf.test.TestCase):

    def test_worked_example_script_runs_on_tiny_settings(self):
        out = self.create_tempdir().full_path
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        result = subprocess.run(
            [os.path.join(root, "launch", "user_level_example.sh"), out], capture_output=True,
            text=True, env=dict(os.environ, EPOCHS="0.2"), timeout=1800)
        self.assertEqual(result.returncode, 0, result.stdout[-2000:] + result.stderr[-2000:])
        self.assertIn("simulated users: 500 users, 4000 images", result.stdout)
        for name in ("user_level ", "example_level_group ", "example_level "):
            self.assertIn(name, result.stdout)
        self.assertRegex(result.stdout, r"example_level_group .* users of <= 20 images: "
                                        r"epsilon=[0-9.]+ delta=")


if __name__ == "__main__":
    tf.test.main()
