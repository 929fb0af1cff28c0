import keras
import tensorflow as tf

from tfdp import dp
from tfdp import models
from tfdp import optim


class WarmupCosineScheduleTest(tf.test.TestCase):
    def test_values(self):
        schedule = optim.warmup_cosine_schedule(
            base_lr=0.03, logical_batch_size=65536, total_steps=100, warmup_steps=10
        )
        peak = 0.03 * 65536 / 256
        self.assertAllClose(peak, 7.68)
        self.assertAllClose(schedule(0), 0.0)
        self.assertAllClose(schedule(5), peak / 2, rtol=1e-6)
        self.assertAllClose(schedule(10), peak, rtol=1e-6)
        self.assertAllClose(schedule(55), peak / 2, rtol=1e-5)
        self.assertAllClose(schedule(100), 0.0, atol=1e-6)
        self.assertAllClose(schedule(150), 0.0, atol=1e-6)
        values = [float(schedule(s)) for s in range(10, 101)]
        self.assertTrue(all(a >= b for a, b in zip(values, values[1:])))

    def test_no_warmup(self):
        schedule = optim.warmup_cosine_schedule(0.1, 256, 10)
        self.assertAllClose(schedule(0), 0.1)
        self.assertAllClose(schedule(10), 0.0, atol=1e-7)

    def test_serialization(self):
        schedule = optim.warmup_cosine_schedule(0.1, 512, 100, 5)
        restored = keras.optimizers.schedules.deserialize(
            keras.optimizers.schedules.serialize(schedule)
        )
        self.assertIsInstance(restored, optim.WarmupCosineSchedule)
        self.assertEqual(restored.get_config(), schedule.get_config())
        optimizer = optim.make_optimizer(learning_rate=schedule)
        restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
        self.assertIsInstance(restored._learning_rate, optim.WarmupCosineSchedule)

    def test_invalid(self):
        with self.assertRaisesRegex(ValueError, "warmup_steps=10"):
            optim.warmup_cosine_schedule(0.1, 256, 10, 10)


class MakeOptimizerTest(tf.test.TestCase):
    def test_default_is_nesterov_sgd_without_decay(self):
        optimizer = optim.make_optimizer(learning_rate=0.5)
        self.assertIsInstance(optimizer, keras.optimizers.SGD)
        self.assertTrue(optimizer.nesterov)
        self.assertAllClose(optimizer.momentum, 0.9)
        self.assertIsNone(optimizer.weight_decay)
        self.assertAllClose(optimizer.learning_rate, 0.5)

    def test_nesterov_flag(self):
        self.assertFalse(optim.make_optimizer(nesterov=False).nesterov)

    def test_coupled_decay_refused(self):
        with self.assertRaisesRegex(ValueError, "weight_decay=0.0001"):
            optim.make_optimizer(weight_decay=1e-4)

    def test_decoupled_decay_skips_bias_and_norm(self):
        model = models.small_convnet()
        optimizer = optim.make_optimizer(
            learning_rate=0.1, momentum=0.0, weight_decay=0.5, decoupled_weight_decay=True
        )
        self.assertAllClose(optimizer.weight_decay, 0.5)
        variables = model.trainable_variables
        before = [v.numpy().copy() for v in variables]
        optimizer.apply_gradients([(keras.ops.zeros_like(v), v) for v in variables])
        decayed = {id(v) for v in optim.weight_decay_variables(model)}
        for v, b in zip(variables, before):
            expected = b * (1 - 0.1 * 0.5) if id(v) in decayed else b
            self.assertAllClose(v.numpy(), expected, rtol=1e-6, msg=v.path)

    def test_adam(self):
        self.assertIsInstance(optim.make_optimizer("Adam", 1e-3), keras.optimizers.Adam)
        with self.assertRaisesRegex(ValueError, "name='lamb'"):
            optim.make_optimizer("lamb")


class WeightDecayVariablesTest(tf.test.TestCase):
    def test_kernels_only(self):
        model = models.resnet18(10, (32, 32, 3), width=8)
        variables = optim.weight_decay_variables(model)
        self.assertEqual({v.name for v in variables}, {"kernel"})
        # 20 convs (stem, 16 block convs, 3 projections) + the head dense.
        self.assertLen(variables, 21)
        self.assertEqual(variables[0].path, "stem_conv/kernel")
        self.assertEqual(variables[-1].path, "head_dense/kernel")

    def test_frozen_and_nested(self):
        model = models.resnet18(10, (32, 32, 3), width=8, weight_standardization=True)
        models.freeze_sub_blocks(model, 4)
        self.assertLen(optim.weight_decay_variables(model), 6)  # group 4 (5) + head
        self.assertLen(optim.weight_decay_variables(model, trainable_only=False), 21)
        inputs = keras.Input((28, 28, 1))
        outer = keras.Model(inputs, models.small_convnet()(inputs))
        self.assertLen(optim.weight_decay_variables(outer), 4)

    def test_the_engine_decays_the_same_variables(self):
        # One list: the clipping rules decide, for in-loss and decoupled decay alike.
        model = models.vit(num_classes=3, input_shape=(16, 16, 3), patch_size=8, width=16,
                           depth=1, num_heads=2, mlp_dim=16)
        ours = [v.path for v in optim.weight_decay_variables(model)]
        self.assertEqual(ours, [v.path for v in dp.default_weight_decay_variables(model)])
        self.assertIn("block1_attention/query/kernel", ours)  # Sublayers of attention too.
        self.assertTrue(all(path.endswith("/kernel") for path in ours))

    def test_transposed_and_separable_kernels(self):
        inputs = keras.Input((8, 8, 3))
        h = keras.layers.Conv2DTranspose(4, 3, name="up")(inputs)
        h = keras.layers.SeparableConv2D(4, 3, name="sep")(h)
        model = keras.Model(inputs, h)
        self.assertEqual([v.path for v in optim.weight_decay_variables(model)],
                         ["up/kernel", "sep/depthwise_kernel", "sep/pointwise_kernel"])
