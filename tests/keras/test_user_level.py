"""User-level privacy on the Keras `fit` route (`privacy_unit="user"`).

Each logical step draws users by Poisson sampling with the secret key, each
drawn user brings at most k = `max_examples_per_user` of their examples, and
the mean of those examples' gradients is clipped to C as one vector; N is the
number of users and ε protects all of one user's data.
"""

import contextlib
import io

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tests.keras import keras_test_case as ktc

SEED = 3


def _linear_loss(y_true, y_pred):
    del y_true
    return tf.reshape(y_pred, [-1])


def _user_optimizer(**kwargs):
    kw = dict(l2_norm_clip=1.0, noise_multiplier=0.0, privacy_unit="user",
              max_examples_per_user=3, insecure_reproducible_seed=SEED)
    kw.update(kwargs)
    return tfdp.DPOptimizer(keras.optimizers.SGD(kw.pop("learning_rate", 1.0)), **kw)


class KernelSteps(keras.callbacks.Callback):
    """The change of the last kernel at each Keras batch (a logical step here)."""

    def __init__(self):
        super().__init__()
        self.changes = []

    def _kernel(self):
        return self.model.model.layers[-1].kernel.numpy()[:, 0].copy()

    def on_train_begin(self, logs=None):
        self._before = self._kernel()

    def on_train_batch_end(self, batch, logs=None):
        after = self._kernel()
        self.changes.append(after - self._before)
        self._before = after


class UserBlocksTest(ktc.KerasTestCase):
    """Which examples a step holds, and how a user's are weighed."""

    def test_at_most_k_examples_per_user_and_their_mean_gradient(self):
        # One-hot inputs e_i and loss w·e_i: example i's gradient is e_i. A
        # user's clipped term is the mean of their c chosen examples' e_i
        # (norm 1/sqrt(c) < C: no clipping), so with SGD(1) and q = 1 (all
        # 3 users every step) -B·Δw_i = 1/c for a chosen example i, else 0.
        x, y = np.eye(8, dtype="float32"), np.zeros([8], "float32")
        user_ids = np.array(["ann", "bob", "bob"] + ["cy"] * 5)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(
            1, use_bias=False, kernel_initializer="zeros")])
        dp = tfdp.make_private(model)
        with self.assertWarnsRegex(UserWarning, "INSECURE"):
            optimizer = _user_optimizer(l2_norm_clip=2.0, expected_batch_size=3)
        dp.compile(optimizer=optimizer, loss=_linear_loss)
        steps = KernelSteps()
        dp.fit(x, y, user_ids=user_ids, batch_size=3, steps_per_epoch=12, epochs=1,
               verbose=0, callbacks=[steps])
        self.assertEqual(int(dp.optimizer.iterations), 12)
        self.assertLen(steps.changes, 12)  # One Keras batch per logical step.
        chosen_of_cy = np.zeros(5)
        for change in steps.changes:
            counts = -3.0 * change
            self.assertAllClose(counts[0], 1.0)  # ann's one example.
            self.assertAllClose(counts[1:3], [0.5, 0.5])  # bob's two.
            cy = counts[3:]
            chosen = cy > 1e-6
            self.assertEqual(int(chosen.sum()), 3)  # k = 3 of cy's 5.
            self.assertAllClose(cy[chosen], np.full(3, 1 / 3))
            chosen_of_cy += chosen
        # A random 3 of 5 each step, not always the same ones.
        self.assertTrue(np.all(chosen_of_cy > 0), chosen_of_cy)
        self.assertEqual(dp.optimizer.fit_route.group_size, 3)


class UserSensitivityTest(ktc.KerasTestCase):
    """(a) One user moves a step's clipped sum by at most C."""

    C = 0.05

    def _data(self):
        x, y = ktc.digits(200)
        # User 0 has one example, user 1 two, user 2 six of one class (their
        # gradients agree, so their per-example clipped sum is well above C),
        # and users 3 to 9 one each.
        same = np.flatnonzero(y == 0)[:6]
        others = np.flatnonzero(y != 0)[:10]
        order = np.concatenate([others[:3], same, others[3:]])
        user_ids = np.concatenate([[0, 1, 1], np.full(6, 2), np.arange(3, 10)])
        return x[order], y[order], user_ids

    def _one_step_update(self, weights, x, y, user_ids, sample_weight):
        keras.utils.set_random_seed(0)
        inner = ktc.tiny_model()
        inner.set_weights(weights)
        dp = tfdp.make_private(inner)
        with self.assertWarnsRegex(UserWarning, "INSECURE"):
            # q = 1 (every user, every step), k = 4 of a user's examples.
            optimizer = _user_optimizer(l2_norm_clip=self.C, max_examples_per_user=4,
                                        expected_batch_size=10)
        dp.compile(optimizer=optimizer, loss=ktc.xent())
        dp.fit(x, y, user_ids=user_ids, sample_weight=sample_weight, batch_size=8,
               steps_per_epoch=1, epochs=1, verbose=0)
        self.assertEqual(int(dp.optimizer.iterations), 1)
        return [w - w0 for w, w0 in zip(ktc.weights(inner), weights)]

    def test_leave_one_user_out_moves_the_sum_by_at_most_c(self):
        x, y, user_ids = self._data()
        weights = ktc.weights(ktc.tiny_model())
        ones = np.ones([len(x)], "float32")
        full = self._one_step_update(weights, x, y, user_ids, ones)
        for user in (0, 1, 2):
            with self.subTest(user=user):
                # The user's rows kept in place with weight 0 (as the sampler
                # pads), so every other user's block and the draw are as before.
                without = self._one_step_update(
                    weights, x, y, user_ids, np.where(user_ids == user, 0.0, 1.0))
                # SGD(1), σ = 0: the update is -(clipped sum) / B, B = 10 users.
                moved = 10.0 * float(tf.linalg.global_norm(
                    [a - b for a, b in zip(full, without)]))
                self.assertLessEqual(moved, self.C * (1 + 1e-4))
                self.assertGreater(moved, 0.5 * self.C)  # The user did take part.
        # Clipped per example instead, user 2's examples would move it by > C.
        model = ktc.tiny_model()
        model.set_weights(weights)
        rows = user_ids == 2
        per_example, _ = tfdp.dp.clipped_grad_sum(
            model, tfdp.keras.per_example_loss_fn(ktc.xent()), x[rows][:4], y[rows][:4],
            l2_norm_clip=self.C)
        self.assertGreater(float(tf.linalg.global_norm(per_example)), 1.5 * self.C)

    def test_the_engine_bounds_every_user_block(self):
        # tfdp.dp.sensitivity on the layout the sampler makes: user blocks of
        # k rows, weights k / c, clipped as one group.
        x, y, user_ids = self._data()
        # Users 0, 1 and 2 with 1, 2 and 4 rows.
        rows, block_weights = tfdp.dp.user_groups.user_blocks(user_ids[:7], 4)
        safe = np.maximum(rows, 0)
        xs = x[safe] * (rows >= 0)[:, None, None, None]
        figure = tfdp.dp.sensitivity.check_sensitivity(
            ktc.tiny_model(), tfdp.keras.per_example_loss_fn(ktc.xent()),
            (xs, y[safe], block_weights), self.C, augmentation_multiplicity=4)
        self.assertBetween(figure, 0.5, 1 + 1e-4)


class UserAccountingTest(ktc.KerasTestCase):
    """(b) ε is DP-SGD's with N = users at the users' rate; (c) the unit is stated."""

    SIGMA, DELTA = 1.0, 1e-3

    def _users(self):
        # 40 users with 1, 2, 3 or 4 examples each (100 examples).
        counts = np.tile([1, 2, 3, 4], 10)
        user_ids = np.random.default_rng(0).permutation(np.repeat(np.arange(40), counts))
        x, y = ktc.digits(len(user_ids))
        return x, y, user_ids

    def _epsilon(self, steps, n=40, batch=4):
        return tfdp.privacy.epsilon(self.SIGMA, steps, self.DELTA, dataset_size=n,
                                    batch_size=batch)

    def test_epsilon_counts_users_and_states_the_unit(self):
        x, y, user_ids = self._users()
        dp = tfdp.make_private(ktc.tiny_model())
        dp.compile(optimizer=tfdp.DPOptimizer(
            keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=self.SIGMA,
            delta=self.DELTA, privacy_unit="user", max_examples_per_user=2),
            loss=ktc.xent(), metrics=["accuracy"])
        logger = tfdp.callbacks.PrivacyLogger()
        # batch_size=8 rows: 4 users of 2 rows per physical batch, so B = 4
        # users per step (q = 0.1) and an epoch is 40 / 4 = 10 steps.
        budget = tfdp.callbacks.PrivacyBudget(self._epsilon(15) + 1e-9, verbose=0)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            history = dp.fit(x, y, user_ids=user_ids, batch_size=8, epochs=3, verbose=0,
                             callbacks=[logger, budget])
        self.assertEqual(int(dp.optimizer.iterations), 15)  # The budget stopped it.
        expected = self._epsilon(15)
        self.assertAllClose(dp.epsilon(), expected)
        self.assertAllClose(history.history["user_epsilon"][-1], expected)
        self.assertAllClose(history.history["user_delta"][-1], self.DELTA)
        self.assertNotIn("epsilon", history.history)
        # Counting examples (N = 100) instead would claim less.
        self.assertGreater(expected, 1.2 * self._epsilon(15, n=100))
        ledger = dp.privacy_ledger()
        self.assertEqual(ledger.privacy_unit, "user")
        self.assertEqual((ledger.dataset_size, ledger.batch_size), (40, 4))
        line = dp.describe_epsilon()
        for words in ("at delta=0.001", "add or remove one user's data",
                      "privacy unit: user", "N=40 users", "at most 2 examples of a user"):
            self.assertIn(words, line)
        self.assertIn(f"PrivacyLogger: {dp.describe_epsilon(steps=0)}", printed.getvalue())
        # What example-level accounting (N = 40 units at the same rate, group
        # privacy for k = 2 at the same delta) would claim, stated on the line.
        claim = dp.example_level_claim()
        self.assertAllClose(claim["example_epsilon"], expected)
        self.assertAllClose(claim["group_epsilon"], tfdp.privacy.group_epsilon(
            self.SIGMA, 15, self.DELTA, 2, sampling_rate=0.1))
        self.assertGreater(claim["group_epsilon"], 2 * claim["example_epsilon"])
        self.assertEqual(claim["group_delta"], self.DELTA)
        self.assertIn("group privacy for 2 examples would claim "
                      f"epsilon={claim['group_epsilon']:.4g}", line)
        with self.assertRaisesRegex(ValueError, "privacy_unit='example'"):
            tfdp.DPOptimizer("sgd", 1.0, 1.0).example_level_claim()

    def test_refusals_name_the_cause(self):
        x, y, user_ids = self._users()
        with self.assertRaisesRegex(ValueError, "needs max_examples_per_user"):
            tfdp.DPOptimizer("sgd", 1.0, 1.0, privacy_unit="user")
        with self.assertRaisesRegex(ValueError, "privacy_unit='user' only"):
            tfdp.DPOptimizer("sgd", 1.0, 1.0, max_examples_per_user=2)
        with self.assertRaisesRegex(ValueError, "privacy_unit must be one of"):
            tfdp.DPOptimizer("sgd", 1.0, 1.0, privacy_unit="household",
                             max_examples_per_user=2)
        with self.assertRaisesRegex(ValueError, "protects one example"):
            tfdp.DPOptimizer("sgd", 1.0, 1.0, privacy_unit="user", max_examples_per_user=2,
                             sampler="poisson")
        dp = tfdp.make_private(ktc.tiny_model())
        dp.compile(optimizer=tfdp.DPOptimizer("sgd", 1.0, 1.0, privacy_unit="user",
                                              max_examples_per_user=2), loss=ktc.xent())
        stream = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
        cases = [
            ("user of every example.*user_ids=None", (x, y), dict(batch_size=8)),
            ("tf.data input carries no user ids", (stream, None), {}),
            ("shuffle=True", (x, y), dict(batch_size=8, user_ids=user_ids, shuffle=False)),
            ("multiple of it.*batch_size=7", (x, y), dict(batch_size=7, user_ids=user_ids)),
            ("one user per example", (x, y), dict(batch_size=8, user_ids=user_ids[:-1])),
        ]
        for pattern, (xs, ys), kw in cases:
            with self.subTest(pattern=pattern):
                with self.assertRaisesRegex(ValueError, pattern):
                    dp.fit(xs, ys, epochs=1, verbose=0, **kw)
        self.assertEqual(int(dp.optimizer.iterations), 0)
        example_level = tfdp.make_private(ktc.tiny_model())
        example_level.compile(optimizer=tfdp.DPOptimizer("sgd", 1.0, 1.0), loss=ktc.xent())
        with self.assertRaisesRegex(ValueError, "user_ids=.*privacy_unit='user'"):
            example_level.fit(x, y, user_ids=user_ids, batch_size=8, epochs=1, verbose=0)

    def test_bad_user_ids_are_refused_with_their_count(self):
        # Today's silent failures: NaN ids merged into one user, None ids
        # failing inside np.unique. One rule (`validate_user_ids`) for every route.
        x, y, user_ids = self._users()
        floats = user_ids.astype(float)
        floats[[3, 50, 70]] = np.nan
        infinite = user_ids.astype(float)
        infinite[7] = np.inf
        missing = list(user_ids)
        missing[1] = missing[9] = None
        mixed = [str(u) if i < 5 else int(u) for i, u in enumerate(user_ids)]
        dp = tfdp.make_private(ktc.tiny_model())
        dp.compile(optimizer=_user_optimizer(), loss=ktc.xent())
        cases = [
            (floats, r"3 of 100 rows are not .*row 3: nan"),
            (missing, r"2 of 100 rows are not .*row 1: None"),
            (infinite, r"1 of 100 rows are not .*row 7: inf"),
            (mixed, r"mixes numbers and strings \(95 and 5 rows\)"),
        ]
        for ids, pattern in cases:
            with self.subTest(pattern=pattern):
                with self.assertRaisesRegex(ValueError, pattern):
                    dp.fit(x, y, user_ids=ids, batch_size=12, epochs=1, verbose=0)
                with self.assertRaisesRegex(ValueError, pattern):  # The trainer's sources.
                    tfdp.data.ArraySource(x, y, user_ids=ids)
        self.assertEqual(int(dp.optimizer.iterations), 0)

    def test_validation_split_holds_out_whole_users(self):
        x, y, user_ids = self._users()
        names = np.array([f"user{u}" for u in user_ids])
        kept, held = tfdp.dp.user_groups.split_last_users(user_ids, 0.25)
        # The last 10 of 40 users, in the order of their first example.
        _, first = np.unique(user_ids, return_index=True)
        last_users = set(np.argsort(first)[30:])
        self.assertEqual(set(user_ids[held]), last_users)
        self.assertEmpty(set(user_ids[kept]) & set(user_ids[held]))
        self.assertEqual(len(kept) + len(held), len(user_ids))
        dp = tfdp.make_private(ktc.tiny_model())
        dp.compile(optimizer=_user_optimizer(), loss=ktc.xent())
        history = dp.fit(x, y, user_ids=names, validation_split=0.25, batch_size=30,
                         epochs=1, verbose=0)
        self.assertIn("val_loss", history.history)
        self.assertEqual(dp.privacy_ledger().dataset_size, 30)  # N counts the kept users.
        with self.assertRaisesRegex(ValueError, "validation_split.*both sides.*1 users"):
            dp.fit(x, y, user_ids=np.zeros(len(x)), validation_split=0.5, batch_size=12,
                   verbose=0)

    def test_config_round_trip(self):
        optimizer = tfdp.DPOptimizer("sgd", 1.0, 1.0, privacy_unit="user",
                                     max_examples_per_user=2, delta=1e-4)
        config = optimizer.get_config()
        self.assertEqual((config["privacy_unit"], config["max_examples_per_user"]), ("user", 2))
        again = tfdp.DPOptimizer.from_config(config)
        self.assertEqual(again.get_config(), config)
        self.assertEqual(again.privacy_unit, "user")


if __name__ == "__main__":
    tf.test.main()
