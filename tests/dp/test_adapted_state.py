"""State set before training is listed as not covered by epsilon, unless declared public.

`norm = keras.layers.Normalization(); norm.adapt(train_images)` stores the
private data's exact mean and variance in the model: every route names it
before training (the trainer in its plan and `summary.json`, Keras and the
TF-Privacy compat route in a warning), and `declare_public` takes it off
the list.
"""

import contextlib
import io
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.dp import adapted_state
from tfdp.training import guards
from tfdp.training import reporting


def _normalized_model(x):
    norm = keras.layers.Normalization(name="norm")
    norm.adapt(x)
    return keras.Sequential([keras.Input(x.shape[1:]), norm, keras.layers.Flatten(),
                             keras.layers.Dense(3, name="head")]), norm


class FindAdaptedStateTest(tf.test.TestCase):

    def test_an_adapted_normalization_is_listed_until_declared_public(self):
        x = np.random.default_rng(0).normal(3.0, 2.0, (64, 4, 4, 1)).astype("float32")
        model, norm = _normalized_model(x)
        found = tfdp.find_adapted_state(model)
        self.assertEqual([e.variable for e in found], ["norm/mean", "norm/variance"])
        self.assertIn("exact mean", found[0].reason)
        text = adapted_state.describe_adapted_state(found)
        self.assertIn("NOT COVERED by epsilon", text)
        self.assertIn("norm/mean", text)
        self.assertIn("tfdp.declare_public", text)
        self.assertIs(tfdp.declare_public(norm), norm)
        self.assertEqual(tfdp.find_adapted_state(model), [])

    def test_what_is_and_is_not_listed(self):
        x = np.random.default_rng(0).uniform(size=(40, 3)).astype("float32")
        adapted_lookup = keras.layers.StringLookup(name="adapted_lookup")
        adapted_lookup.adapt(["a", "b", "b"])
        quantiles = keras.layers.Discretization(num_bins=3, name="quantiles")
        quantiles.adapt(x)
        tokens = keras.layers.TextVectorization(max_tokens=8, name="tokens")
        tokens.adapt(["a b", "b c"])
        for layer, listed in [
            (adapted_lookup, ["adapted_lookup/vocabulary"]),
            (keras.layers.StringLookup(vocabulary=["a", "b"]), []),  # Given: the caller's.
            (quantiles, ["quantiles/bin_boundaries"]),
            (keras.layers.Discretization(bin_boundaries=[0.5]), []),
            (tokens, ["tokens/vocabulary"]),  # Once, not again for its inner lookup.
        ]:
            self.assertEqual([e.variable for e in adapted_state.find_adapted_state(layer)],
                             listed, layer.name)

        constants = keras.layers.Normalization(mean=0.5, variance=0.25)
        frozen_bn = keras.layers.BatchNormalization(name="bn")
        dense = keras.layers.Dense(2, name="dense")
        model = keras.Sequential([keras.Input((3,)), constants, keras.layers.Dropout(0.5),
                                  frozen_bn, dense], name="model")
        frozen_bn.trainable = False
        dense.trainable = False
        dense.bias.assign([1.0, 2.0])  # A frozen parameter: the initial model's.
        self.assertEqual(adapted_state.find_adapted_state(model), [])
        # Statistics a fresh BatchNorm would not have: listed, frozen or not.
        frozen_bn.moving_variance.assign(np.full([3], 4.0, "float32"))
        found = adapted_state.find_adapted_state(model)
        self.assertEqual([(e.layer, e.variable) for e in found],
                         [("bn", "model/bn/moving_variance")])
        self.assertIn("differs from its ones initializer", found[0].reason)
        tfdp.declare_public(frozen_bn.moving_variance)
        self.assertEqual(adapted_state.find_adapted_state(model), [])
        with self.assertRaisesRegex(ValueError, "Received: str"):
            tfdp.declare_public("bn")

    def test_the_list_is_short(self):
        found = [adapted_state.AdaptedState(f"l{i}", f"l{i}/mean", "adapted")
                 for i in range(25)]
        lines = adapted_state.describe_adapted_state(found).splitlines()
        self.assertLen(lines, 1 + 10 + 1 + 1)
        self.assertEqual(lines[11], "  ... and 15 more")


class RoutesNameAdaptedStateTest(tf.test.TestCase):

    def test_keras_fit_warns_before_the_first_update(self):
        rng = np.random.default_rng(0)
        x = rng.normal(3.0, 2.0, (32, 4, 4, 1)).astype("float32")
        y = (np.arange(32) % 3).astype("int32")
        model, norm = _normalized_model(x)
        private = tfdp.make_private(model)
        private.compile(
            optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
                                       noise_multiplier=1.0, insecure_reproducible_seed=0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        with self.assertWarnsRegex(UserWarning, r"NOT COVERED by epsilon(.|\n)*norm/mean"):
            private.fit(x, y, batch_size=16, epochs=1, verbose=0)

    @pytest.mark.slow  # The same hook as Keras fit (`probe_before_training`); 4 s.
    def test_the_tf_privacy_compat_route_warns_too(self):
        from tfdp.compat import tensorflow_privacy

        x = np.random.default_rng(0).normal(3.0, 2.0, (32, 4, 4, 1)).astype("float32")
        y = (np.arange(32) % 3).astype("int32")
        norm = keras.layers.Normalization(name="compat_norm")
        norm.adapt(x)
        model = tensorflow_privacy.DPSequential(
            l2_norm_clip=1.0, noise_multiplier=1.0,
            layers=[keras.Input((4, 4, 1)), norm, keras.layers.Flatten(), keras.layers.Dense(3)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True, reduction=None))
        with self.assertWarnsRegex(UserWarning, r"compat_norm/mean"):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)

    def test_the_trainer_logs_the_list_and_writes_it_to_the_summary(self):
        x = np.random.default_rng(0).normal(3.0, 2.0, (64, 4, 4, 1)).astype("float32")
        model, norm = _normalized_model(x)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            records = guards.check_adapted_state(model)
        self.assertIn("adapted state: 2 value(s) set before training are NOT COVERED",
                      out.getvalue())
        self.assertIn("  norm/mean: Normalization adapted", out.getvalue())
        workdir = self.create_tempdir().full_path
        reporter = reporting.RunReporter(workdir, steps_per_epoch=1, total_steps=1, delta=None,
                                         adapted_state=records, progress_bar=False)
        with contextlib.redirect_stdout(io.StringIO()):
            reporter.evaluation(1, epsilon=float("inf"), test={"accuracy": 0.5, "loss": 1.0})
            reporter.summary(epsilon=float("inf"), delta=None, steps=1, noise_multiplier=0.0,
                             dataset_size=64, validation_size=0, privacy_guarantee="none")
        with open(os.path.join(workdir, "summary.json")) as f:
            not_covered = json.load(f)["not_covered_by_epsilon"]
        self.assertEqual([r["variable"] for r in not_covered["adapted_state"]],
                         ["norm/mean", "norm/variance"])
        self.assertEqual(not_covered["dataset_size"], 64)
        # Declared public: nothing to say.
        tfdp.declare_public(norm)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(guards.check_adapted_state(model), [])
        self.assertEqual(out.getvalue(), "")
