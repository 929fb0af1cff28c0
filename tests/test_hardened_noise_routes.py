"""`hardened_noise` on every route: `tfdp.DPSGDConfig` through the engine to the
aggregator's noise scheme, the trainer's `PrivacyConfig` (gin), `tfdp.DPOptimizer`
and Keras `fit`, and the TF-Privacy compat optimizers and models."""

import contextlib
import io

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tests.keras.keras_test_case import digits
from tests.keras.keras_test_case import tiny_model
from tests.keras.keras_test_case import xent
from tfdp import data
from tfdp import engine as engine_lib
from tfdp import samplers
from tfdp import config as config_lib
from tfdp import secret_key
from tfdp import train
from tfdp import training
from tfdp.compat import tensorflow_privacy
from tfdp.privacy import tree_aggregation
from tfdp.training import run_contract

N = 1000
BATCH = 50
PHYSICAL = 64
SEED = 11
SIGMA = 1.1
CLIP = 0.7


def _sampler(name="poisson", physical_batch_size=PHYSICAL, **options):
    return samplers.make_sampler(name, dataset_size=N, logical_batch_size=BATCH,
                                 physical_batch_size=physical_batch_size, **options)


def _engine(config, sampler=None, noise_options=None):
    return engine_lib.make_engine(
        config, sampler=sampler or _sampler(), key=secret_key.SecretKey.insecure_from_seed(SEED),
        noise_options=noise_options)


def _release(aggregator, step=3):
    """The released mean of a zero sum: the noise / B."""
    accumulators = [tf.Variable(tf.zeros([4, 3]))]
    return aggregator.noisy_mean(accumulators, tf.constant(step, tf.int64))[0].numpy()


def _trainer_engine(hardened_noise):
    sampler = data.train_sampler(N, sampler="poisson", physical_batch_size=PHYSICAL,
                                 logical_batch_size=BATCH)

    def make(steps, key):
        config = tfdp.DPSGDConfig(CLIP, SIGMA, accountant="rdp", hardened_noise=hardened_noise)
        return run_contract.make_engine(config, sampler, steps=steps, key=key)

    return run_contract.make_run_contract(
        sampler, epochs=1.0, key=secret_key.SecretKey.insecure_from_seed(SEED),
        workdir=None, read_checkpoint=False, engine_fn=make).engine


def _fit_aggregator(**kwargs):
    optimizer = tfdp.keras.DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=CLIP, noise_multiplier=SIGMA,
        expected_batch_size=BATCH, insecure_reproducible_seed=SEED, sampler="poisson", **kwargs)
    optimizer.mechanism_builder.route_fit(arrays=True, dataset_size=N,
                                          physical_batch_size=PHYSICAL)
    return optimizer.mechanism_builder.aggregator


class ConfigAndEngineTest(tf.test.TestCase):

    def test_the_config_reaches_every_schemes_aggregator(self):
        self.assertFalse(_engine(tfdp.DPSGDConfig(CLIP, SIGMA)).aggregator.hardened_noise)
        gaussian = _engine(tfdp.DPSGDConfig(CLIP, SIGMA, hardened_noise=True))
        self.assertTrue(gaussian.mechanism.hardened_noise)
        self.assertEqual(gaussian.aggregator.scheme.name, "gaussian")
        self.assertTrue(gaussian.aggregator.scheme.hardened_noise)
        self.assertIn("hardened_noise", gaussian.mechanism.describe())
        banded = _engine(tfdp.DPSGDConfig(CLIP, SIGMA, bands=3, hardened_noise=True),
                         _sampler("banded_poisson", bands=3))
        self.assertEqual(banded.aggregator.scheme.name, "banded")
        self.assertTrue(banded.aggregator.scheme.hardened_noise)
        tree = _engine(tfdp.DPSGDConfig(CLIP, SIGMA, hardened_noise=True),
                       _sampler("shuffle", physical_batch_size=BATCH),
                       {"tree": tree_aggregation.TreeRestarts(8)})
        self.assertEqual(tree.aggregator.scheme.name, "tree")
        self.assertTrue(tree.aggregator.scheme.hardened_noise)
        # A resumed run's engine (another key) keeps it.
        resumed = gaussian.with_key(secret_key.SecretKey.insecure_from_seed(SEED + 1))
        self.assertTrue(resumed.aggregator.hardened_noise)
        # The users' constructor takes it too; ε does not change.
        mechanism = tfdp.DPSGD(CLIP, SIGMA, sampler=_sampler(), hardened_noise=True)
        plain = tfdp.DPSGD(CLIP, SIGMA, sampler=_sampler())
        self.assertTrue(mechanism.hardened_noise)
        self.assertEqual(mechanism.epsilon(40), plain.epsilon(40))

    def test_a_flag_that_is_not_a_bool_is_refused(self):
        with self.assertRaisesRegex(ValueError, "Received: hardened_noise='true'"):
            tfdp.DPSGDConfig(CLIP, SIGMA, hardened_noise="true")
        with self.assertRaisesRegex(ValueError, "hardened_noise must be True or False"):
            tfdp.DPOptimizer("sgd", CLIP, SIGMA, hardened_noise=1)


class TrainerAndFitTest(tf.test.TestCase):

    def test_trainer_and_fit_release_the_same_hardened_noise(self):
        trainer = _trainer_engine(hardened_noise=True).aggregator
        fit = _fit_aggregator(hardened_noise=True)
        self.assertTrue(trainer.hardened_noise)
        self.assertTrue(fit.hardened_noise)
        for step in (0, 7):
            self.assertAllEqual(_release(trainer, step), _release(fit, step))
        self.assertNotAllClose(_release(trainer), _release(_trainer_engine(False).aggregator))
        self.assertNotAllClose(_release(fit), _release(_fit_aggregator()))

    def test_privacy_config_binds_it_through_gin(self):
        gin.clear_config()
        try:
            gin.parse_config("PrivacyConfig.hardened_noise = True\n"
                             "PrivacyConfig.noise_multiplier = 1.0\n"
                             "PrivacyConfig.insecure_reproducible_seed = 3")
            privacy_config = training.PrivacyConfig()
        finally:
            gin.clear_config()
        self.assertTrue(privacy_config.dpsgd_config.hardened_noise)
        rng = np.random.default_rng(0)
        source = data.ArraySource(rng.normal(size=(200, 2, 2, 1)).astype("float32"),
                                  np.zeros(200, np.int64), data.DatasetInfo("mock", 2, (2, 2, 1)))
        contract, _ = run_contract.make_contract_and_batching(
            source, tf.distribute.get_strategy(), privacy=privacy_config,
            optimization=training.OptimizationConfig(epochs=1.0, logical_batch_size=20),
            run=training.RunConfig(), workdir=self.create_tempdir().full_path,
            read_checkpoint=False)
        self.assertTrue(contract.engine.aggregator.hardened_noise)
        # "optimized" band coefficients are fitted per run: the flag stays.
        banded = training.PrivacyConfig(noise_multiplier=1.0, bands=2,
                                        band_coefficients="optimized", hardened_noise=True)
        self.assertTrue(banded.request_for(30).hardened_noise)
        with self.assertRaisesRegex(ValueError, "for private training"):
            training.PrivacyConfig(private=False, hardened_noise=True)

    def test_dp_optimizer_saves_it_and_a_mechanism_carries_it(self):
        optimizer = tfdp.DPOptimizer("sgd", CLIP, SIGMA, hardened_noise=True)
        self.assertTrue(optimizer.hardened_noise)
        config = optimizer.get_config()
        self.assertIs(config["hardened_noise"], True)
        self.assertTrue(tfdp.DPOptimizer.from_config(config).hardened_noise)
        mechanism = tfdp.DPSGD(CLIP, SIGMA, sampler=_sampler(), hardened_noise=True,
                               insecure_reproducible_seed=SEED)
        given = tfdp.DPOptimizer("sgd", mechanism=mechanism)
        given.mechanism_builder.route_fit(arrays=True, dataset_size=N,
                                          physical_batch_size=PHYSICAL)
        self.assertTrue(given.mechanism_builder.aggregator.hardened_noise)
        with self.assertRaisesRegex(ValueError, "in the mechanism only"):
            tfdp.DPOptimizer("sgd", mechanism=mechanism, hardened_noise=True)

    def test_fit_trains_with_hardened_noise(self):
        x, y = digits(64)
        model = tfdp.make_private(tiny_model())
        model.compile(optimizer=tfdp.DPOptimizer(
            keras.optimizers.SGD(0.1), l2_norm_clip=1.0, noise_multiplier=1.0,
            insecure_reproducible_seed=SEED, hardened_noise=True), loss=xent())
        before = [w.copy() for w in model.get_weights()]
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        optimizer = model.optimizer
        self.assertTrue(optimizer.mechanism_builder.aggregator.hardened_noise)
        self.assertGreater(int(optimizer.iterations.numpy()), 0)
        after = model.get_weights()
        self.assertTrue(all(np.all(np.isfinite(w)) for w in after))
        self.assertFalse(all(np.array_equal(a, b) for a, b in zip(before, after)))


@pytest.mark.slow  # Two short trainer runs.
class TrainerRunTest(tf.test.TestCase):

    def _train(self, *bindings):
        config_lib.parse(["mnist_default.gin"], [
            "DataConfig.dataset = 'digits'", "OptimizationConfig.epochs = 1",
            "OptimizationConfig.logical_batch_size = 128", "RunConfig.physical_batch_size = 64",
            "RunConfig.export_model = False", "RunConfig.write_html_report = False",
            "PrivacyConfig.target_epsilon = 4.0", "PrivacyConfig.insecure_reproducible_seed = 7",
            *bindings])
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                summary = train.train(self.create_tempdir().full_path)
        finally:
            gin.clear_config()
        return summary, out.getvalue()

    def test_a_hardened_run_says_so_and_spends_the_same_epsilon(self):
        plain, plain_log = self._train()
        hardened, log = self._train("PrivacyConfig.hardened_noise = True")
        self.assertIn("noise: hardened against floating-point attacks", log)
        self.assertNotIn("noise: hardened", plain_log)
        for name in ("epsilon", "noise_multiplier", "steps"):
            self.assertEqual(hardened[name], plain[name], name)
        # Other noise, the same training: within a few points of accuracy.
        self.assertLess(abs(hardened["test_accuracy"] - plain["test_accuracy"]), 0.15)


class CompatTest(tf.test.TestCase):

    def test_compat_optimizers_take_it_and_save_it(self):
        sgd = tensorflow_privacy.DPKerasSGDOptimizer(CLIP, SIGMA, hardened_noise=True,
                                                     learning_rate=0.1)
        self.assertTrue(sgd.hardened_noise)
        config = sgd.get_config()
        self.assertIs(config["hardened_noise"], True)
        self.assertTrue(tensorflow_privacy.DPKerasSGDOptimizer.from_config(config).hardened_noise)
        self.assertFalse(tensorflow_privacy.DPKerasAdamOptimizer(CLIP, SIGMA).hardened_noise)
        ftrl = tensorflow_privacy.DPFTRLTreeAggregationOptimizer(
            CLIP, SIGMA, None, restart_period=4, hardened_noise=True, learning_rate=0.1)
        ftrl.mechanism_builder.route_fit(arrays=True, dataset_size=N, physical_batch_size=BATCH)
        scheme = ftrl.mechanism_builder.aggregator.scheme
        self.assertEqual((scheme.name, scheme.hardened_noise), ("tree", True))
        self.assertTrue(tensorflow_privacy.DPFTRLTreeAggregationOptimizer.from_config(
            ftrl.get_config()).hardened_noise)

    def test_compat_models_hand_it_to_their_optimizer(self):
        model = tensorflow_privacy.DPSequential(
            l2_norm_clip=CLIP, noise_multiplier=SIGMA, hardened_noise=True,
            layers=[keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=xent())
        self.assertTrue(model.optimizer.hardened_noise)
        self.assertIs(model.get_config()["hardened_noise"], True)


if __name__ == "__main__":
    tf.test.main()
