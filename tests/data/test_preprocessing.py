import numpy as np
import tensorflow as tf

from tfdp import data
from tfdp.data import benchmark
from tfdp.data import preprocessing


def _photo(height=375, width=500, seed=0):
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, size=(1, height // 8, width // 8, 3)).astype(np.float32)
    image = tf.image.resize(coarse, [height, width])[0]
    return tf.cast(tf.clip_by_value(image, 0, 255), tf.uint8)


class ImagenetPreprocessTest(tf.test.TestCase):
    def test_train_shapes_ranges_and_determinism(self):
        image = _photo()
        encoded = tf.io.encode_jpeg(image)
        fn = data.imagenet_train_preprocess(size=64, mean=None, std=None)
        seed = tf.constant([3, 4], tf.int64)
        for inp in (image, encoded):
            out = fn(inp, seed)
            self.assertEqual(out.shape, (64, 64, 3))
            self.assertEqual(out.dtype, tf.float32)
            self.assertGreaterEqual(float(tf.reduce_min(out)), 0.0)
            self.assertLessEqual(float(tf.reduce_max(out)), 1.0)
            self.assertAllEqual(out, fn(inp, seed))
            self.assertNotAllClose(out, fn(inp, tf.constant([3, 5], tf.int64)))
        # decode_and_crop_jpeg crops the same window as decode-then-crop (up
        # to JPEG loss).
        diff = tf.abs(fn(image, seed) - fn(encoded, seed))
        self.assertLess(float(tf.reduce_mean(diff)), 0.02)

    def test_crop_area_and_aspect(self):
        image = tf.zeros([300, 400, 3], tf.uint8)
        areas = []
        for i in range(40):
            begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
                tf.shape(image),
                tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
                seed=[i, 0],
                area_range=(0.08, 1.0),
                aspect_ratio_range=(3 / 4, 4 / 3),
                min_object_covered=0.0,
            )
            del begin
            areas.append(float(size[0] * size[1]) / (300 * 400))
        self.assertGreaterEqual(min(areas), 0.07)
        self.assertLess(min(areas), 0.5)
        # The op is the one used by random_resized_crop; the full function
        # keeps working on tiny images where sampling can fail.
        out = preprocessing.random_resized_crop(tf.ones([3, 50, 3], tf.uint8), [1, 2], size=16)
        self.assertEqual(out.shape, (16, 16, 3))

    def test_eval(self):
        fn = data.imagenet_eval_preprocess()
        for shape in ((375, 500), (500, 375), (20, 13)):
            out = fn(tf.io.encode_jpeg(_photo(*shape)))
            self.assertEqual(out.shape, (224, 224, 3))
            self.assertTrue(np.all(np.isfinite(out)))
        # Normalised with the ImageNet mean/std.
        gray = tf.fill([256, 256, 3], tf.constant(128, tf.uint8))
        expected = (128 / 255 - np.array(preprocessing.IMAGENET_MEAN)) / np.array(
            preprocessing.IMAGENET_STD
        )
        self.assertAllClose(fn(gray)[100, 100], expected, atol=1e-4)


class CifarPreprocessTest(tf.test.TestCase):
    def test_crop_and_flip(self):
        image = tf.random.stateless_uniform([32, 32, 3], seed=[0, 1])
        fn = data.cifar_train_preprocess()
        out = fn(image, tf.constant([1, 2], tf.int64))
        self.assertEqual(out.shape, (32, 32, 3))
        self.assertAllEqual(out, fn(image, tf.constant([1, 2], tf.int64)))
        # Without padding the crop is the identity; only the flip remains.
        no_pad = data.cifar_train_preprocess(padding=0)
        outs = [no_pad(image, tf.constant([i, 0], tf.int64)) for i in range(8)]
        flipped = image[:, ::-1]
        for out in outs:
            self.assertTrue(np.allclose(out, image) or np.allclose(out, flipped))
        self.assertTrue(any(np.allclose(o, flipped) for o in outs))
        self.assertAllClose(data.cifar_eval_preprocess()(tf.fill([4, 4, 3], tf.constant(255, tf.uint8))), tf.ones([4, 4, 3]))


class BenchmarkTest(tf.test.TestCase):
    def test_benchmark_runs(self):
        source = benchmark.mock_jpeg_source(num_images=8, height=60, width=80)
        self.assertTrue(source.encoded)
        ds = data.make_train_pipeline(
            source,
            sampler="shuffle",
            physical_batch_size=4,
            logical_batch_size=8,
            num_steps=10,
            seed=0,
            preprocess_fn=data.imagenet_train_preprocess(size=32),
        )
        rate = benchmark.benchmark_pipeline(ds, num_batches=3, warmup_batches=1)
        self.assertGreater(rate, 0.0)
        images = next(iter(ds))[0]
        self.assertEqual(images.shape, (4, 32, 32, 3))
        with self.assertRaisesRegex(ValueError, "num_batches=0"):
            benchmark.benchmark_pipeline(ds, 0)


if __name__ == "__main__":
    tf.test.main()
