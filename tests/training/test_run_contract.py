"""The trainer's stages: one contract per run, the resume point, the progress output."""

import contextlib
import io
import os

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tfdp import checkpointing
from tfdp import data
from tfdp import privacy
from tfdp import secret_key
from tfdp.training import reporting
from tfdp.training import run_contract

N = 1000


def _engine_fn(noise_multiplier=1.1, delta=None):
    def make(steps, key):
        config = tfdp.DPSGDConfig(0.7, noise_multiplier, delta=delta, accountant="rdp")
        return run_contract.make_engine(config, sampler, steps=steps, key=key)
    return make


sampler = data.train_sampler(N, sampler="poisson", physical_batch_size=64,
                             logical_batch_size=50)


class RunContractTest(tf.test.TestCase):

    def _contract(self, workdir, engine_fn, seed=None):
        key = (secret_key.SecretKey.insecure_from_seed(seed) if seed is not None
               else secret_key.SecretKey.generate())
        return run_contract.make_run_contract(sampler, epochs=1.0, key=key, workdir=workdir,
                                              read_checkpoint=True, engine_fn=engine_fn)

    def test_the_contract_reads_everything_from_its_mechanism(self):
        contract = self._contract(self.create_tempdir().full_path, _engine_fn())
        mechanism = contract.mechanism
        self.assertIs(contract.key, mechanism.secret_key)
        self.assertIs(contract.sampler, mechanism.sampler)
        self.assertEqual(contract.delta, mechanism.delta)
        self.assertAllEqual(contract.sampling_key, mechanism.sampling_key)
        self.assertEqual(mechanism.l2_norm_clip, 0.7)
        self.assertEqual(contract.total_steps, sampler.steps_for_epochs(1.0))
        self.assertEqual(contract.ledger.noise_multiplier, mechanism.noise_multiplier)
        # delta=None is the default of every route.
        self.assertEqual(mechanism.delta, privacy.default_delta(N))

    def test_a_non_private_contract_has_a_key_and_no_mechanism(self):
        contract = self._contract(self.create_tempdir().full_path, None)
        self.assertIsNone(contract.mechanism)
        self.assertIsNone(contract.ledger)
        self.assertIsNone(contract.delta)
        self.assertTrue(contract.key.is_secret)
        self.assertEqual(contract.budget_steps, contract.total_steps)

    def _checkpoint(self, workdir, contract):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD()
        optimizer.build(model.trainable_variables)
        ckpt = checkpointing.RunCheckpoint(os.path.join(workdir, "checkpoints"), model,
                                           optimizer, secret_key=contract.key)
        ckpt.save(0, contract.ledger)

    def test_a_resumed_contract_continues_the_checkpoints_key(self):
        workdir = self.create_tempdir().full_path
        first = self._contract(workdir, _engine_fn())
        self._checkpoint(workdir, first)
        resumed = self._contract(workdir, _engine_fn())
        self.assertIsNotNone(resumed.resume_point)
        self.assertEqual(resumed.key.words.tolist(), first.key.words.tolist())
        self.assertIs(resumed.key, resumed.mechanism.secret_key)

    def test_a_checkpoint_of_another_contract_is_refused(self):
        workdir = self.create_tempdir().full_path
        self._checkpoint(workdir, self._contract(workdir, _engine_fn()))
        with self.assertRaisesRegex(ValueError, "another privacy configuration.*noise_multiplier"):
            self._contract(workdir, _engine_fn(noise_multiplier=2.0))
        with self.assertRaisesRegex(ValueError, "written by a private run"):
            self._contract(workdir, None)

    def test_batching_refuses_a_logical_batch_above_n(self):
        with self.assertRaisesRegex(ValueError, "must not exceed the dataset size"):
            run_contract.make_batching(40, sampler="poisson", privacy_unit="example",
                                       group_size=1, logical_batch_size=50,
                                       physical_batch_size=64, pad_granule="auto", replicas=1)

    def test_banded_batching_draws_from_b_groups_of_at_least_b_times_the_batch(self):
        batching = run_contract.make_batching(
            N, sampler="banded_poisson", privacy_unit="example", group_size=1,
            logical_batch_size=50, physical_batch_size=64, pad_granule="auto", replicas=1,
            bands=4)
        self.assertEqual(batching.sampler.name, "banded_poisson")
        self.assertEqual(batching.sampler.bands, 4)
        self.assertAllClose(batching.sampler.group_sampling_rate, 4 * 50 / N)
        with self.assertRaisesRegex(ValueError, "bands × logical_batch_size must not exceed"):
            run_contract.make_batching(
                N, sampler="banded_poisson", privacy_unit="example", group_size=1,
                logical_batch_size=50, physical_batch_size=64, pad_granule="auto",
                replicas=1, bands=21)

    def test_a_banded_budget_stops_at_its_last_round_within_the_target(self):
        banded = run_contract.make_batching(
            N, sampler="banded_poisson", privacy_unit="example", group_size=1,
            logical_batch_size=50, physical_batch_size=64, pad_granule="auto", replicas=1,
            bands=4).sampler

        def make(steps, key):
            config = tfdp.DPSGDConfig(1.0, 1.0, target_epsilon=2.0, delta=1e-5, bands=4)
            return run_contract.make_engine(config, banded, steps=steps, key=key)

        contract = run_contract.make_run_contract(
            banded, epochs=20.0, key=secret_key.SecretKey.generate(),
            workdir=self.create_tempdir().full_path, read_checkpoint=True, engine_fn=make)
        budget = contract.budget_steps
        self.assertLess(budget, contract.total_steps)
        self.assertLessEqual(contract.mechanism.epsilon(budget), 2.0)
        self.assertGreater(contract.mechanism.epsilon(budget + 1), 2.0)
        # ε moves once per round of b = 4 steps: the stop is a round's last step.
        self.assertEqual(budget % 4, 0)
        self.assertEqual(contract.ledger.bands, 4)

    def test_user_batching_counts_users(self):
        rng = np.random.default_rng(0)
        source = data.ArraySource(rng.normal(size=(60, 2, 2, 1)).astype("float32"),
                                  np.zeros(60, np.int64), data.DatasetInfo("mock", 2, (2, 2, 1)),
                                  user_ids=np.repeat(np.arange(20), 3))
        batching = run_contract.make_batching(
            source, sampler="poisson", privacy_unit="user", group_size=2, logical_batch_size=5,
            physical_batch_size=8, pad_granule="auto", replicas=1)
        self.assertEqual(batching.sampler.dataset_size, 20)
        self.assertEqual(batching.pad_granule % 2, 0)
        with self.assertRaisesRegex(ValueError, "multiple of max_examples_per_user"):
            run_contract.make_batching(
                source, sampler="poisson", privacy_unit="user", group_size=3,
                logical_batch_size=5, physical_batch_size=8, pad_granule="auto", replicas=1)


class ProgressTest(tf.test.TestCase):

    def _reporter(self, progress_bar):
        return reporting.RunReporter(self.create_tempdir().full_path, steps_per_epoch=10,
                                     total_steps=40, delta=1e-5, start_step=10,
                                     progress_bar=progress_bar)

    def test_eta_from_the_pace_since_the_start_step(self):
        reporter = self._reporter(False)
        reporter.t_start -= 30.0  # 10 steps in 30 s: 20 steps left take 60 s.
        self.assertIsNone(reporter.eta(10))
        self.assertAllClose(reporter.eta(20), 60.0, atol=1.0)
        self.assertEqual(reporter.eta(40), 0.0)

    def test_bar_on_a_terminal_and_plain_lines_in_a_log(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self._reporter(False).tick(20)
        self.assertEqual(out.getvalue(), "")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            reporter = self._reporter(True)
            reporter.t_start -= 30.0
            reporter.tick(20)
            reporting.log("next line")
        text = out.getvalue()
        self.assertRegex(text, r"^\r  \[#{15}\.{15}\] step 20/40  ETA 60 s")
        # The next line overwrites the bar instead of following it.
        self.assertIn("\r\033[Knext line\n", text)

    def test_progress_line_shows_the_fraction_and_eta(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            reporter = self._reporter(False)
            reporter.t_start -= 30.0
            reporter.progress(20, learning_rate=0.1, examples_per_second=5.0,
                              stats={"mean_grad_norm": 1.0, "clipped_fraction": 0.5,
                                     "nonfinite": 0.0})
        self.assertRegex(out.getvalue(), r"^the figures after '\| non-DP:' are computed from "
                                         r"private data without noise: they are NOT COVERED "
                                         r"BY EPSILON\n  step 20/40 \(50%, ETA 60 s\) lr=0.1 5 ex/s \| "
                                         r"non-DP: grad_norm=1.000")

    def test_duration_units(self):
        self.assertEqual(reporting.duration(59), "59 s")
        self.assertEqual(reporting.duration(600), "10 min")
        self.assertEqual(reporting.duration(3 * 3600), "3.0 h")


class ClippingBudgetTest(tf.test.TestCase):

    def test_a_memory_budget_makes_auto_choose_and_say_why(self):
        from tfdp import config
        from tfdp import train as train_lib

        # mnist_default's model on 8x8 digits at batch 64 needs 0.25 MiB with
        # bk and 0.15 MiB with mixed (`dp.plan`): a budget between takes mixed.
        config.parse(["mnist_default.gin"], [
            "DataConfig.dataset = 'digits'", "OptimizationConfig.epochs = 1",
            "OptimizationConfig.logical_batch_size = 128",
            "RunConfig.physical_batch_size = 64", "PrivacyConfig.noise_multiplier = 1.0",
            "PrivacyConfig.target_epsilon = None", "PrivacyConfig.clipping_memory_budget_mb = 0.2"])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            train_lib.train(self.create_tempdir().full_path, dry_run=True)
        self.assertIn("DP plan: method=mixed, physical batch=64", out.getvalue())
        self.assertRegex(out.getvalue(), r"auto chose mixed, its estimated [\d.]+ MiB fits the "
                         r"clipping-memory budget of 0.2 MiB \(bk needs [\d.]+ MiB\)")
        # The probe ran the chosen method.
        self.assertIn("(method=mixed, physical batch of", out.getvalue())
