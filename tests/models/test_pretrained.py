"""Fine-tuning from pretrained weights that the tests save themselves."""

import functools
import os

import keras
import numpy as np
import tensorflow as tf

import tfdp
import pytest
from tests.models.model_test_case import ModelTestCase
from tfdp import dp
from tfdp import models

_SHAPE = (32, 32, 3)
_tiny_vit = functools.partial(models.vit, width=32, depth=1, num_heads=2, mlp_dim=64)


class TransposedDense(keras.layers.Layer):
    """Uses another Dense layer's kernel, transposed (tied weights)."""

    def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense

    def call(self, x):
        return tf.matmul(x, self.dense.kernel, transpose_b=True)


class Shift(keras.layers.Layer):
    """A weight the registry has no rule for: the generic rule clips it."""

    def build(self, shape):
        self.shift = self.add_weight(shape=(shape[-1],), initializer="zeros", name="shift")

    def call(self, x):
        return x + tf.sin(self.shift)


def _xent(y_true, logits):
    return keras.losses.sparse_categorical_crossentropy(y_true, logits, from_logits=True)


class PretrainedTest(ModelTestCase):

    def setUp(self):
        super().setUp()
        self.dir = self.get_temp_dir()

    def test_vit_from_keras_and_weights_files_fine_tuned_privately(self):
        source = _tiny_vit(5, _SHAPE)
        keras_path = os.path.join(self.dir, "source.keras")
        h5_path = os.path.join(self.dir, "source.weights.h5")
        source.save(keras_path)
        source.save_weights(h5_path)
        loaded = {}
        for path in (keras_path, h5_path):
            model, frozen = models.load_pretrained(
                3, _SHAPE, model_fn=_tiny_vit, weights=path, source_num_classes=5,
                freeze_layers=("stem_patch_embed",))
            loaded[path] = model
            self.assertEqual(frozen, ["stem_patch_embed (freeze_layers)"])
            self.assertEqual(model.get_layer("head_dense").units, 3)
            self.assertIsNone(model.get_layer("head_dense").activation(None))
            for name in ("stem_patch_embed", "stem_class_token", "block1_attention",
                         "block1_mlp_dense2", "head_norm"):
                for got, want in zip(model.get_layer(name).get_weights(),
                                     source.get_layer(name).get_weights()):
                    self.assertAllEqual(got, want)
        model = loaded[keras_path]

        # A few private steps: the frozen layer keeps the loaded weights, the rest train.
        x = np.random.RandomState(0).uniform(-1, 1, (16,) + _SHAPE).astype("float32")
        y = np.arange(16) % 3
        private = tfdp.make_private(model)
        private.compile(
            optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(0.5), l2_norm_clip=1.0,
                                       noise_multiplier=0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        private.fit(x, y, batch_size=8, epochs=1, verbose=0)
        self.assertAllEqual(model.get_layer("stem_patch_embed").kernel,
                            source.get_layer("stem_patch_embed").kernel)
        self.assertNotAllClose(model.get_layer("block1_mlp_dense1").kernel,
                               source.get_layer("block1_mlp_dense1").kernel)

    def save_mobilenet_v2_notop(self):
        source = keras.applications.MobileNetV2(
            include_top=False, weights=None, input_shape=_SHAPE, alpha=0.35, pooling="avg")
        for layer in source.layers:  # Statistics a fresh model would not have.
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.moving_mean.assign(np.random.uniform(-1, 1, layer.moving_mean.shape))
        path = os.path.join(self.dir, "mobilenet_v2_notop.weights.h5")
        source.save_weights(path)
        kwargs = dict(architecture="mobilenet_v2", weights=path,
                      application_kwargs={"alpha": 0.35})
        return source, kwargs

    @pytest.mark.slow  # 20-40 s on 2 cores: with the slow tests (CI runs them).
    def test_keras_application_notop_weights_with_group_norm(self):
        source, kwargs = self.save_mobilenet_v2_notop()
        group_norm, frozen = models.load_pretrained(4, _SHAPE, **kwargs)
        self.assertEqual(frozen, [])
        self.assertNoBatchNorm(group_norm)
        self.assertAllEqual(group_norm.get_layer("block_16_project").kernel,
                            source.get_layer("block_16_project").kernel)
        self.assertEqual(group_norm.get_layer("head_dense").units, 4)

        # Kurakin et al.'s recipe: a model pretrained on one task (its GroupNorm
        # trained too), saved, then fine-tuned on another with a new head.
        group_norm.get_layer("bn_Conv1").gamma.assign(np.full([16], 0.5))
        path = os.path.join(self.dir, "places.keras")
        group_norm.save(path)
        model, _ = models.load_pretrained(2, _SHAPE, architecture="mobilenet_v2",
                                          weights=path, application_kwargs={"alpha": 0.35})
        self.assertAllEqual(model.get_layer("bn_Conv1").gamma, np.full([16], 0.5))
        self.assertAllEqual(model.get_layer("block_16_project").kernel,
                            source.get_layer("block_16_project").kernel)
        self.assertEqual(model.get_layer("head_dense").units, 2)

    @pytest.mark.slow  # 20-40 s on 2 cores: with the slow tests (CI runs them).
    def test_keras_application_notop_weights_with_frozen_batchnorm(self):
        source, kwargs = self.save_mobilenet_v2_notop()
        frozen_bn, frozen = models.load_pretrained(4, _SHAPE, batchnorm="freeze", **kwargs)
        bn_names = models.find_batchnorm(source)
        self.assertLen(bn_names, 52)
        self.assertEqual(frozen, [f"{n} (BatchNorm in inference mode)" for n in bn_names])
        for name in ("bn_Conv1", "block_16_project_BN"):
            self.assertFalse(frozen_bn.get_layer(name).trainable)
            self.assertAllEqual(frozen_bn.get_layer(name).moving_mean,
                                source.get_layer(name).moving_mean)
        # Pretrained weights are public: their statistics are not listed as
        # adapted state; the same statistics in a model of the user's are.
        self.assertEqual(dp.find_adapted_state(frozen_bn), [])
        listed = dp.find_adapted_state(source)
        self.assertLen(listed, 52)
        self.assertEqual(listed[0].variable, "bn_Conv1/moving_mean")
        x = self.random_inputs(frozen_bn, batch_size=2)
        figure = dp.check_sensitivity(frozen_bn, _xent, (x, np.array([0, 1])), 1e-3, "bk")
        self.assertLessEqual(figure, 1 + 1e-4)

    def test_a_missing_file_says_where_to_put_it(self):
        path = os.path.join(self.dir, "nowhere", "vit.keras")
        with self.assertRaisesRegex(ValueError, "not found.*Put the file at that path"):
            models.load_pretrained(3, _SHAPE, model_fn=_tiny_vit, weights=path)
        with self.assertRaisesRegex(ValueError, "needs a keras.applications `architecture`"):
            models.load_pretrained(3, _SHAPE, model_fn=_tiny_vit, weights="imagenet")

    def test_freezes_tied_weights_and_the_rules_asked_for(self):
        x = keras.Input((8,))
        encoder = keras.layers.Dense(4, activation="tanh", name="encoder")
        h = TransposedDense(encoder, name="decoder")(encoder(x))
        h = Shift(name="shift")(h)
        model = keras.Model(x, keras.layers.Dense(3, name="head")(h))
        with self.assertRaisesRegex(ValueError, "reads variable"):
            dp.check_sensitivity(model, _xent, (np.ones((2, 8)), np.array([0, 1])), 1.0, "bk")

        frozen = models.freeze_unclippable(model)
        self.assertLen(frozen, 1)
        self.assertRegex(frozen[0], r"^encoder \(variable encoder/kernel read by 'decoder'\)")
        self.assertFalse(model.get_layer("encoder").trainable)
        self.assertTrue(model.get_layer("shift").trainable)
        figure = dp.check_sensitivity(model, _xent, (np.ones((2, 8)), np.array([0, 1])), 1e-3,
                                      "bk")
        self.assertLessEqual(figure, 1 + 1e-4)

        self.assertEqual(models.freeze_unclippable(model, freeze_rules=("generic",)),
                         ["shift (rule 'generic')"])
        self.assertEqual({v.path for v in model.trainable_variables},
                         {"head/kernel", "head/bias"})


class PretrainedGinTest(ModelTestCase):

    def test_the_trainer_s_model_fn_from_gin(self):
        import gin

        from tfdp import train  # noqa: F401 (registers ModelConfig.model_fn)

        source = _tiny_vit(5, _SHAPE)
        path = os.path.join(self.get_temp_dir(), "source.keras")
        source.save(path)
        gin_file = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "gin",
                                "models", "pretrained.gin")
        try:
            gin.parse_config_files_and_bindings(
                [gin_file],
                [f"PRETRAINED_WEIGHTS = '{path}'", "load_pretrained.model_fn = @tfdp.models.vit",
                 "vit.width = 32", "vit.depth = 1", "vit.num_heads = 2", "vit.mlp_dim = 64"])
            with gin.unlock_config():
                model_fn = gin.query_parameter("ModelConfig.model_fn")
            self.assertEqual(model_fn.selector, "tfdp.models.pretrained")
            # As the trainer calls it.
            model = models.pretrained(num_classes=3, input_shape=_SHAPE)
        finally:
            gin.clear_config()
        self.assertEqual(model.output_shape, (None, 3))
        self.assertAllEqual(model.get_layer("block1_mlp_dense1").kernel,
                            source.get_layer("block1_mlp_dense1").kernel)
