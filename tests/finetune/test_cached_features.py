"""`tfdp.finetune.split_last_layer` and `cache_features`: the same release, faster.

A private fit of the head on cached features must release what the same
fit of the whole model, backbone frozen, releases: the same weights for the
same key and data, and the same ε. A backbone for which that fails is
refused.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf

import tfdp
from tfdp.dp import model_probe

N, BATCH = 64, 16


def backbone_layers(x, extra=None):
    """Conv → GroupNorm → pool → Dense features, with `extra` (a layer) after the conv."""
    h = keras.layers.Conv2D(4, 3, activation="tanh", name="conv")(x)
    if extra is not None:
        h = extra(h)
    h = keras.layers.GroupNormalization(2, name="norm")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.layers.Dense(6, activation="tanh", name="features")(h)


def model(extra=None, seed=0):
    keras.utils.set_random_seed(seed)
    x = keras.Input((8, 8, 1), name="image")
    return keras.Model(x, keras.layers.Dense(10, name="head")(backbone_layers(x, extra)),
                       name="tiny")


def digits():
    train, _, _ = tfdp.data.load_offline("digits")
    return train.images[:N].astype("float32"), train.labels[:N].astype("int32")


def private_fit(net, x, y, epochs=2):
    private = tfdp.make_private(net)
    private.compile(
        optimizer=tfdp.DPOptimizer(keras.optimizers.SGD(0.5, momentum=0.5), l2_norm_clip=1.0,
                                   noise_multiplier=1.0, insecure_reproducible_seed=3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # The insecure seed's warning.
        private.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0)
    return private


def freeze_all_but(net, layer_name):
    for layer in net.layers:
        layer.trainable = layer.name == layer_name


class SplitTest(tf.test.TestCase):
    def test_default_head_is_the_last_dense_layer(self):
        net = model()
        backbone, head = tfdp.finetune.split_last_layer(net)
        self.assertEqual([layer.name for layer in head.layers if layer.weights], ["head"])
        self.assertEqual(backbone.output.shape, (None, 6))
        self.assertIn("features", [layer.name for layer in backbone.layers])
        self.assertEqual((backbone.name, head.name), ("tiny_backbone", "tiny_head"))
        x, _ = digits()
        # The two halves compose to the model, and share its variables.
        self.assertAllClose(head(backbone(x[:4])), net(x[:4]), atol=1e-6)
        self.assertIs(head.get_layer("head"), net.get_layer("head"))

    def test_head_by_name_cuts_earlier(self):
        net = model()
        backbone, head = tfdp.finetune.split_last_layer(net, head=["head", "features"])
        self.assertEqual([layer.name for layer in head.layers if layer.weights],
                         ["features", "head"])
        self.assertEqual(backbone.output.shape, (None, 4))

    def test_sequential(self):
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                                keras.layers.Dense(5, name="hidden"),
                                keras.layers.Dense(3, name="out")])
        backbone, head = tfdp.finetune.split_last_layer(net)
        self.assertEqual(backbone.output.shape, (None, 5))
        x = np.ones((2, 8, 8, 1), "float32")
        self.assertAllClose(head(backbone(x)), net(x))

    def test_refusals(self):
        x = keras.Input((8, 8, 1))
        no_dense = keras.Model(x, keras.layers.GlobalAveragePooling2D()(
            keras.layers.Conv2D(3, 3)(x)))
        with self.assertRaisesRegex(ValueError, "no head.*no Dense layer"):
            tfdp.finetune.split_last_layer(no_dense)
        with self.assertRaisesRegex(ValueError, "not a layer.*Received: head='missing'"):
            tfdp.finetune.split_last_layer(model(), head="missing")
        # A connection around the cut: the output reads a tensor before the features.
        h = keras.layers.Flatten()(x)
        features = keras.layers.Dense(4, name="features")(h)
        around = keras.layers.Add()([keras.layers.Dense(4, name="last")(features),
                                     keras.layers.Dense(4, name="skip")(h)])
        with self.assertRaisesRegex(ValueError, "around the cut"):
            tfdp.finetune.split_last_layer(keras.Model(x, around), head="last")


class CachedReleaseTest(tf.test.TestCase):
    """The head trained on cached features is the head trained through the backbone."""

    def test_same_weights_and_epsilon(self):
        x, y = digits()
        whole = model()
        freeze_all_but(whole, "head")
        uncached = private_fit(whole, x, y)

        net = model()
        backbone, head = tfdp.finetune.split_last_layer(net)
        backbone.trainable = False
        features = tfdp.finetune.cache_features(backbone, x, batch_size=BATCH)
        self.assertEqual(features.shape, (N, 6))
        cached = private_fit(head, features, y)

        moved = np.abs(net.get_layer("head").kernel.numpy()
                       - model().get_layer("head").kernel.numpy()).max()
        self.assertGreater(moved, 1e-2)  # Training moved the head: the check can fail.
        for a, b in zip(whole.get_layer("head").weights, net.get_layer("head").weights):
            self.assertAllClose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
        # The backbone did not train either way.
        for a, b in zip(whole.get_layer("features").weights, net.get_layer("features").weights):
            self.assertAllEqual(a.numpy(), b.numpy())
        self.assertEqual(uncached.describe_epsilon(), cached.describe_epsilon())
        self.assertEqual(uncached.privacy_ledger().steps, cached.privacy_ledger().steps)
        self.assertGreater(cached.privacy_ledger().steps, 0)

    def test_file_cache(self):
        x, _ = digits()
        backbone, _ = tfdp.finetune.split_last_layer(model())
        backbone.trainable = False
        in_memory = tfdp.finetune.cache_features(backbone, x, batch_size=24)
        path = self.create_tempdir().full_path + "/features.npy"
        on_disk = tfdp.finetune.cache_features(backbone, x, batch_size=24, path=path)
        self.assertIsInstance(on_disk, np.memmap)
        self.assertAllClose(np.asarray(on_disk), in_memory, atol=1e-6)
        self.assertAllClose(np.load(path), backbone(x, training=False), atol=1e-5)
        with self.assertRaisesRegex(ValueError, r"\.npy file.*Received: path="):
            tfdp.finetune.cache_features(backbone, x, path=path[:-4] + ".txt")


class RefusalTest(tf.test.TestCase):
    def refuse(self, net, pattern, freeze=True):
        backbone, _ = tfdp.finetune.split_last_layer(net)
        if freeze:
            backbone.trainable = False
        x, _ = digits()
        with self.assertRaisesRegex(ValueError, pattern):
            tfdp.finetune.cache_features(backbone, x[:8], batch_size=8)
        return backbone

    def test_trainable_backbone(self):
        self.refuse(model(), r"frozen backbone: layer 'conv'.*Received: layer='conv'",
                    freeze=False)

    def test_one_trainable_weight(self):
        net = model()
        backbone, _ = tfdp.finetune.split_last_layer(net)
        backbone.trainable = False
        net.get_layer("norm").trainable = True
        net.get_layer("norm").gamma.trainable = False  # Its beta still trains.
        x, _ = digits()
        with self.assertRaisesRegex(ValueError, r"layer 'norm'.*norm/beta"):
            tfdp.finetune.cache_features(backbone, x[:8])

    def test_dropout_in_training_mode(self):
        self.refuse(model(keras.layers.Dropout(0.5, name="drop")),
                    r"layer 'drop' \(Dropout\).*training mode.*Received: layer='drop'")

    def test_random_augmentation(self):
        self.refuse(model(keras.layers.GaussianNoise(0.1, name="noise")),
                    r"layer 'noise' \(GaussianNoise\).*training mode")

    def test_batchnorm_with_batch_statistics(self):
        bn = keras.layers.BatchNormalization(name="bn")
        net = model(bn)
        backbone, _ = tfdp.finetune.split_last_layer(net)
        backbone.trainable = False
        # Only its variables frozen: the layer trains, so it uses batch statistics.
        bn.trainable = True
        for v in bn.trainable_weights:
            v.trainable = False
        before = [v.numpy().copy() for v in bn.weights]
        x, _ = digits()
        with self.assertRaisesRegex(ValueError, r"layer 'bn' \(BatchNormalization\)"):
            tfdp.finetune.cache_features(backbone, x[:8])
        # The check's training passes left the moving statistics as they were.
        for a, b in zip(before, bn.weights):
            self.assertAllEqual(a, b.numpy())

    def test_frozen_batchnorm_and_inactive_dropout_are_cached(self):
        # Frozen BatchNorm runs in inference mode; Dropout(0) changes nothing.
        net = model(keras.Sequential([keras.layers.BatchNormalization(name="bn"),
                                      keras.layers.Dropout(0.0, name="drop")], name="block"))
        backbone, _ = tfdp.finetune.split_last_layer(net)
        backbone.trainable = False
        x, _ = digits()
        features = tfdp.finetune.cache_features(backbone, x[:8])
        self.assertAllClose(features, backbone(x[:8], training=True), atol=1e-6)

    def test_randomness_in_inference_mode(self):
        class AlwaysNoisy(keras.layers.Layer):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.seed_generator = keras.random.SeedGenerator(1)

            def call(self, h, training=None):
                return h + keras.random.normal(tf.shape(h), seed=self.seed_generator)

        self.refuse(model(AlwaysNoisy(name="noisy")), r"draws random values in inference")

    def test_mixing_layer(self):
        centre = keras.layers.Lambda(lambda h: h - tf.reduce_mean(h, axis=0), name="centre")
        self.refuse(model(centre), r"'centre' mixes examples")

    def test_model_probe_not_left_holding_the_random_state(self):
        # The mode check restores what a training pass moved: seed generators too.
        drop = keras.layers.Dropout(0.5, name="drop")
        net = model(drop)
        backbone, _ = tfdp.finetune.split_last_layer(net)
        backbone.trainable = False
        state = model_probe.RandomState(backbone)
        with self.assertRaises(ValueError):
            tfdp.finetune.cache_features(backbone, digits()[0][:8])
        for v in state.variables:
            self.assertAllEqual(v.numpy(), state.initial[0][id(v)])
