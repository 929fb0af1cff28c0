"""Misuse fails loudly and never trains non-privately."""

import keras
import numpy as np

import tfdp
from tests.keras import keras_test_case as ktc


class SafetyTest(ktc.KerasTestCase):
    def test_dp_optimizer_on_plain_model_raises_and_does_not_train(self):
        x, y = ktc.digits(16)
        model = ktc.tiny_model()
        model.compile(
            optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(0.1), l2_norm_clip=1.0,
                                       noise_multiplier=1.0),
            loss=ktc.xent(),
        )
        before = ktc.weights(model)
        with self.assertRaisesRegex(RuntimeError, "make_private"):
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        self.assertWeightsClose(ktc.weights(model), before, rtol=0, atol=0)

    def test_dp_optimizer_apply_raises(self):
        model = ktc.tiny_model()
        opt = tfdp.DPOptimizer("sgd", l2_norm_clip=1.0, noise_multiplier=1.0)
        grads = [np.zeros(v.shape, "float32") for v in model.trainable_variables]
        with self.assertRaisesRegex(RuntimeError, "plain optimizer"):
            opt.apply_gradients(zip(grads, model.trainable_variables))
        with self.assertRaisesRegex(RuntimeError, "plain optimizer"):
            opt.apply(grads, model.trainable_variables)

    def test_private_model_with_plain_optimizer_raises(self):
        dp = tfdp.make_private(ktc.tiny_model())
        for optimizer in ("sgd", keras.optimizers.Adam()):
            with self.assertRaisesRegex(TypeError, "DPOptimizer"):
                dp.compile(optimizer=optimizer, loss=ktc.xent())

    def test_batchnorm_raises_pointing_to_replace_batchnorm(self):
        model = keras.Sequential([
            keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3),
            keras.layers.BatchNormalization(), keras.layers.Flatten(), keras.layers.Dense(10),
        ])
        with self.assertRaisesRegex(ValueError, r"tfdp\.models\.replace_batchnorm"):
            tfdp.make_private(model)
        fixed = tfdp.models.replace_batchnorm(model, groups=2)
        tfdp.make_private(fixed)  # Now fine.

    def test_regularizers_raise(self):
        model = keras.Sequential([
            keras.Input((8, 8, 1)), keras.layers.Flatten(),
            keras.layers.Dense(10, kernel_regularizer="l2"),
        ])
        dp = self.private(model)
        x, y = ktc.digits(8)
        with self.assertRaisesRegex(NotImplementedError, "weight_decay"):
            dp.fit(x, y, batch_size=8, verbose=0)

    def test_bad_arguments(self):
        with self.assertRaisesRegex(ValueError, "gradient_accumulation_steps"):
            tfdp.DPOptimizer("sgd", l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=4)
        with self.assertRaisesRegex(ValueError, "l2_norm_clip"):
            tfdp.DPOptimizer("sgd", l2_norm_clip=0.0, noise_multiplier=1.0)
        with self.assertRaisesRegex(ValueError, "noise_multiplier"):
            tfdp.DPOptimizer("sgd", l2_norm_clip=1.0, noise_multiplier=-1.0)
        with self.assertRaisesRegex(ValueError, "gradient_accumulation_steps"):
            tfdp.DPOptimizer("sgd", l2_norm_clip=1.0, noise_multiplier=1.0,
                             gradient_accumulation_steps=0)
        with self.assertRaisesRegex(ValueError, "wrapped"):
            tfdp.DPOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2),
                             l2_norm_clip=1.0, noise_multiplier=1.0)
        with self.assertRaisesRegex(ValueError, "method"):
            tfdp.DPOptimizer("sgd", l2_norm_clip=1.0, noise_multiplier=1.0, method="nope")

    def test_jit_compile_defaults_to_false(self):
        dp = self.private(ktc.tiny_model())
        self.assertFalse(dp.jit_compile)

    def test_optimizer_delegates(self):
        inner = keras.optimizers.SGD(0.25, momentum=0.9)
        opt = tfdp.DPOptimizer(inner, l2_norm_clip=1.0, noise_multiplier=1.0)
        self.assertAllClose(opt.learning_rate, 0.25)
        opt.learning_rate = 0.5
        self.assertAllClose(inner.learning_rate, 0.5)
        self.assertIs(opt.iterations, inner.iterations)
        config = opt.get_config()
        again = tfdp.DPOptimizer.from_config(config)
        self.assertEqual(again.get_config()["noise_multiplier"], 1.0)
        self.assertEqual(type(again.inner_optimizer), keras.optimizers.SGD)
