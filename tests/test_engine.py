"""One engine per route: the trainer and Keras `fit` both bind their request with
`tfdp.engine.make_engine`, and the same request, sampler and key give the same
σ, noise, batches and ε on both."""

import keras
import tensorflow as tf

import tfdp
from tfdp import data
from tfdp import engine as engine_lib
from tfdp import secret_key
from tfdp.training import model_setup
from tfdp.training import run_contract

N = 1000
BATCH = 50
PHYSICAL = 64
SEED = 11
SIGMA = 1.1
CLIP = 0.7


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    return model


def _trainer_contract(workdir):
    sampler = data.train_sampler(N, sampler="poisson", physical_batch_size=PHYSICAL,
                                 logical_batch_size=BATCH)

    def make(steps, key):
        config = tfdp.DPSGDConfig(CLIP, SIGMA, accountant="rdp")
        return run_contract.make_engine(config, sampler, steps=steps, key=key)

    return run_contract.make_run_contract(
        sampler, epochs=1.0, key=secret_key.SecretKey.insecure_from_seed(SEED),
        workdir=workdir, read_checkpoint=False, engine_fn=make)


def _fit_builder():
    optimizer = tfdp.keras.DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=CLIP, noise_multiplier=SIGMA,
        expected_batch_size=BATCH, insecure_reproducible_seed=SEED, sampler="poisson")
    builder = optimizer.mechanism_builder
    builder.route_fit(arrays=True, dataset_size=N, physical_batch_size=PHYSICAL)
    return builder


def _noise(aggregator, step):
    """The released mean of an empty step: the noise / B."""
    accumulators = [tf.Variable(tf.zeros([4, 3]))]
    return aggregator.noisy_mean(accumulators, tf.constant(step, tf.int64))[0].numpy()


class EngineTest(tf.test.TestCase):

    def test_each_route_holds_one_engine(self):
        contract = _trainer_contract(self.create_tempdir().full_path)
        self.assertIsInstance(contract.engine, engine_lib.DPEngine)
        self.assertIs(contract.mechanism, contract.engine.mechanism)
        batching = run_contract.Batching(
            sampler=contract.sampler, physical_batch_size=PHYSICAL,
            replica_batch_size=PHYSICAL, pad_granule=None, group_size=1)
        step = model_setup.make_train_step(
            _model(), keras.optimizers.SGD(0.1), contract, batching, method="auto",
            weight_decay=0.0, seed=0, jit_compile=False, augmentation_multiplicity=1)
        self.assertIs(step.aggregator, contract.engine.aggregator)
        self.assertIs(step.mechanism, contract.engine.mechanism)

        builder = _fit_builder()
        self.assertIsInstance(builder.engine, engine_lib.DPEngine)
        self.assertIs(builder.mechanism, builder.engine.mechanism)
        self.assertIs(builder.aggregator, builder.engine.aggregator)

    def test_an_engine_is_made_by_make_engine_only(self):
        with self.assertRaises(TypeError):
            engine_lib.DPEngine(None, None, {}, object())

    def test_same_request_sampler_and_key_same_release(self):
        trainer = _trainer_contract(self.create_tempdir().full_path).engine
        fit = _fit_builder().engine
        self.assertEqual(trainer.key, fit.key)
        self.assertEqual(trainer.noise_multiplier, fit.noise_multiplier)
        self.assertEqual(trainer.delta, fit.delta)
        self.assertEqual(trainer.aggregator.noise_stddev, fit.aggregator.noise_stddev)
        self.assertEqual(trainer.aggregator.expected_batch_size,
                         fit.aggregator.expected_batch_size)
        for step in (0, 7):
            self.assertAllEqual(_noise(trainer.aggregator, step), _noise(fit.aggregator, step))
        self.assertAllEqual(trainer.mechanism.sampling_key, fit.mechanism.sampling_key)
        steps = trainer.sampler.steps_for_epochs(1.0)
        self.assertEqual(trainer.ledger().epsilon_after(steps),
                         fit.ledger().epsilon_after(steps))
        self.assertEqual(trainer.mechanism.epsilon(steps), fit.mechanism.epsilon(steps))
        self.assertEqual(trainer.budget_steps(steps), fit.budget_steps(steps))

    def test_the_engine_binds_as_from_config(self):
        sampler = data.train_sampler(N, sampler="poisson", physical_batch_size=PHYSICAL,
                                     logical_batch_size=BATCH)
        config = tfdp.DPSGDConfig(CLIP, None, target_epsilon=3.0)
        key = secret_key.SecretKey.insecure_from_seed(SEED)
        engine = engine_lib.make_engine(config, sampler=sampler, steps=40, key=key)
        direct = tfdp.DPSGD.from_config(config, sampler=sampler, steps=40, secret_key=key)
        self.assertEqual(engine.noise_multiplier, direct.noise_multiplier)
        self.assertTrue(engine.mechanism.calibrated)
        self.assertEqual(engine.budget_steps(40), direct.budget_steps(40))
        settings = engine.probe_settings(method="bk", weight_decay=0.0,
                                         augmentation_multiplicity=2, group_size=3)
        self.assertEqual(settings, dict(l2_norm_clip=CLIP, clipping="standard",
                                        clipping_gamma=0.01, method="bk", weight_decay=0.0,
                                        augmentation_multiplicity=6))
        resumed = engine.with_key(secret_key.SecretKey.insecure_from_seed(SEED + 1))
        self.assertEqual(resumed.noise_multiplier, engine.noise_multiplier)
        self.assertNotEqual(resumed.key, engine.key)
        self.assertNotAllClose(_noise(resumed.aggregator, 0), _noise(engine.aggregator, 0))
        again = engine.with_key(secret_key.SecretKey.insecure_from_seed(SEED + 1))
        self.assertAllEqual(_noise(resumed.aggregator, 0), _noise(again.aggregator, 0))


if __name__ == "__main__":
    tf.test.main()


class EngineDpEventTest(tf.test.TestCase):
    """The engine accounts through its noise scheme's DP event, which is what
    each route's ledger composes: DP-SGD's and banded noise's sampler event,
    DP-FTRL's trees."""

    def _engine(self, sampler, noise_options=None, config=None):
        config = config or tfdp.DPSGDConfig(CLIP, SIGMA, accountant="rdp")
        return engine_lib.make_engine(
            config, sampler=sampler, key=secret_key.SecretKey.insecure_from_seed(SEED),
            noise_options=noise_options)

    def test_gaussian_and_banded_events_are_the_ledgers(self):
        from tfdp import samplers
        for name, config in (
                ("poisson", None),
                ("banded_poisson", tfdp.DPSGDConfig(CLIP, SIGMA, accountant="rdp", bands=3))):
            extra = {"bands": 3} if name == "banded_poisson" else {}
            sampler = samplers.make_sampler(name, dataset_size=N, logical_batch_size=BATCH,
                                            physical_batch_size=PHYSICAL, **extra)
            engine = self._engine(sampler, config=config)
            self.assertEqual(engine.dp_event(30), engine.mechanism.dp_event(30))

    def test_tree_event_is_dp_ftrl_ledgers(self):
        from tfdp import samplers
        from tfdp.privacy import tree_aggregation
        restarts = tree_aggregation.TreeRestarts(8, None)
        sampler = samplers.make_sampler("shuffle", dataset_size=N, logical_batch_size=BATCH,
                                        physical_batch_size=BATCH)
        engine = self._engine(sampler, {"tree": restarts, "leaves_per_step": 2})
        ledger = tree_aggregation.TreeAggregationLedger(
            SIGMA, delta=1e-5, dataset_size=N, batch_size=BATCH, steps=30, restarts=restarts,
            leaves_per_step=2)
        self.assertEqual(engine.dp_event(30), ledger.dp_event())
        # And not the sampler's own event: the tree's noise is accounted as a tree.
        self.assertNotEqual(engine.dp_event(30), sampler.dp_event(SIGMA, 30))

    def test_a_banded_scheme_over_a_plain_sampler_is_refused(self):
        from tfdp import samplers
        sampler = samplers.make_sampler("poisson", dataset_size=N, logical_batch_size=BATCH,
                                        physical_batch_size=PHYSICAL)
        from tfdp.dp import noise_schemes
        banded = noise_schemes.scheme_class("banded").from_options(coefficients=(0.8, 0.6))
        with self.assertRaisesRegex(ValueError, "banded"):
            banded.dp_event(sampler, SIGMA, 30)
