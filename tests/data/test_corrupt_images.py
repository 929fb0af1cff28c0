"""Undecodable images are skipped (weight 0, zero image) and counted, not fatal."""

import numpy as np
import tensorflow as tf

from tfdp import data
from tfdp.data import preprocessing
from tfdp.data import sources

N = 40
SHAPE = (12, 12, 3)


def _images(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(N,) + SHAPE, dtype=np.uint8)


def _encoded_source(corrupt):
    """JPEGs of `_images()`; entries in `corrupt` replaced by bad bytes."""
    rng = np.random.default_rng(1)
    images = _images()
    encoded = [tf.io.encode_jpeg(image, quality=95).numpy() for image in images]
    kinds = ("random", "truncated", "empty", "header_only")
    for j, i in enumerate(sorted(corrupt)):
        kind = kinds[j % len(kinds)]
        if kind == "random":
            encoded[i] = rng.bytes(200)
        elif kind == "truncated":
            encoded[i] = encoded[i][: len(encoded[i]) // 2]
        elif kind == "empty":
            encoded[i] = b""
        else:  # A JPEG start-of-image marker and nothing else.
            encoded[i] = b"\xff\xd8\xff"
    labels = np.arange(N) % 7 + 1  # Never 0, so label 0 marks a blanked example.
    info = sources.DatasetInfo("corrupt_mock", 8, SHAPE)
    return sources.ArraySource(np.array(encoded, dtype=object), labels, info), images


class CorruptImagesTest(tf.test.TestCase):


    def test_train_pipeline_skips_and_counts_exactly(self):
        corrupt = {0, 3, 17, 22, 39}  # 0: padding also reads example 0.
        source, _ = _encoded_source(corrupt)
        clean_source, _ = _encoded_source(set())
        for sampler in ("shuffle", "poisson"):
            stats = data.DecodeStats()
            # One key for both pipelines: the same batches, corrupt or clean.
            kwargs = dict(sampler=sampler, physical_batch_size=8, logical_batch_size=16,
                          num_steps=10, seed=3, sampling_key=np.array([3, 4], np.int64))
            ds = data.make_train_pipeline(source, decode_stats=stats, **kwargs)
            self.assertIs(ds.decode_stats, stats)
            clean = data.make_train_pipeline(clean_source, **kwargs)
            expected_skipped = 0
            steps = 0
            for (images, labels, weights, last), (c_images, c_labels, c_weights, c_last) in zip(
                ds, clean
            ):
                self.assertEqual(bool(last), bool(c_last))
                steps += int(last)
                # Same sample as the clean source; corrupt ones drop to weight 0.
                for k in range(8):
                    if c_weights[k] == 0:  # Padding.
                        self.assertEqual(weights[k], 0)
                        self.assertAllEqual(images[k], np.zeros(SHAPE, np.float32))
                        continue
                    label = int(c_labels[k])
                    if weights[k] == 0:
                        expected_skipped += 1
                        self.assertAllEqual(images[k], np.zeros(SHAPE, np.float32))
                        self.assertEqual(int(labels[k]), 0)
                    else:
                        # Good images decode exactly as from the clean source.
                        self.assertEqual(int(labels[k]), label)
                        self.assertAllEqual(images[k], c_images[k])
            self.assertEqual(steps, 10)
            self.assertGreater(expected_skipped, 0, sampler)
            self.assertEqual(stats.value(), expected_skipped, sampler)

    def test_skipped_examples_are_exactly_the_corrupt_ones(self):
        corrupt = {1, 2, 9, 30}
        source, images = _encoded_source(corrupt)
        stats = data.DecodeStats()
        # One epoch of shuffle sampling visits every example once (N = 40 = 5 * 8).
        ds = data.make_train_pipeline(
            source, sampler="shuffle", physical_batch_size=8, logical_batch_size=8,
            num_steps=5, seed=0, decode_stats=stats,
        )
        total_weight = sum(float(tf.reduce_sum(w)) for _, _, w, _ in ds)
        self.assertEqual(total_weight, N - len(corrupt))
        self.assertEqual(stats.value(), len(corrupt))

    def test_eval_pipeline_skips_and_counts(self):
        corrupt = {0, 5, 6, 38}
        source, images = _encoded_source(corrupt)
        ds = data.make_eval_pipeline(source, batch_size=16)
        weights = np.concatenate([w.numpy() for _, _, w in ds])
        labels = np.concatenate([l.numpy() for _, l, _ in ds])
        self.assertLen(weights, 48)
        expected = np.array([0.0 if i in corrupt else 1.0 for i in range(N)] + [0.0] * 8)
        self.assertAllEqual(weights, expected)
        self.assertAllEqual(labels[:N][expected[:N] == 0], np.zeros(len(corrupt)))
        # Two passes count twice; reset() starts over.
        self.assertEqual(ds.decode_stats.value(), 2 * len(corrupt))
        ds.decode_stats.reset()
        list(ds)
        self.assertEqual(ds.decode_stats.value(), len(corrupt))
        # Good images decode as JPEG decodes them.
        first_good = next(iter(ds))[0][1].numpy()
        reference = preprocessing.to_float(tf.io.decode_jpeg(source.images[1], channels=3))
        self.assertAllClose(first_good, reference)

    def test_custom_preprocess_on_corrupt_jpegs(self):
        source, _ = _encoded_source({4, 5, 6, 7})
        stats = data.DecodeStats()
        ds = data.make_train_pipeline(
            source, sampler="shuffle", physical_batch_size=8, logical_batch_size=8,
            num_steps=5, seed=0, decode_stats=stats,
            preprocess_fn=preprocessing.imagenet_train_preprocess(size=16),
        )
        for images, _, weights, _ in ds:
            self.assertEqual(images.shape, (8, 16, 16, 3))
            self.assertTrue(np.isfinite(images.numpy()).all())
        self.assertEqual(stats.value(), 4)

    def test_no_decodable_image_is_an_error(self):
        info = sources.DatasetInfo("bad", 2, (4, 4, 3))
        source = sources.ArraySource(np.array([b"", b"xx"], dtype=object), np.array([0, 1]), info)
        with self.assertRaisesRegex(ValueError, "could be decoded"):
            data.make_train_pipeline(source, sampler="shuffle", physical_batch_size=1,
                                     logical_batch_size=1, num_steps=1, seed=0)

    def test_in_memory_decode_keeps_bytes_when_some_fail(self):
        images = _images()
        encoded = np.array([tf.io.encode_png(i).numpy() for i in images], dtype=object)
        info = sources.DatasetInfo("png", 8, SHAPE)
        decoded = sources.decode_in_memory(encoded, info)
        self.assertAllEqual(decoded, images)
        encoded[3] = b"\x89PNG\r\n\x1a\n"  # PNG signature, no data.
        self.assertIs(sources.decode_in_memory(encoded, info), encoded)


if __name__ == "__main__":
    tf.test.main()
