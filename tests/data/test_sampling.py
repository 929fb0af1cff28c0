import keras
import numpy as np
import tensorflow as tf

from tfdp import data
from tfdp import samplers


def _index_source(n, shape=(1, 1, 1)):
    # Labels equal indices, so a batch's labels say which examples it holds.
    images = np.arange(n, dtype=np.float32).reshape((n, 1, 1, 1)) * np.ones(shape, np.float32)
    return data.ArraySource(images, np.arange(n))


def _steps(ds):
    """Groups physical batches into steps: a list of lists of numpy tuples."""
    steps, current = [], []
    for batch in ds:
        current.append(tuple(np.asarray(t) for t in batch))
        if current[-1][3]:
            steps.append(current)
            current = []
    assert not current, "the final batch must be marked last"
    return steps


def _real_labels(step):
    return np.concatenate([labels[weights > 0] for _, labels, weights, _ in step])


class SamplerTest(tf.test.TestCase):
    def test_poisson_sampler(self):
        spec = samplers.make_sampler(
            "poisson", dataset_size=1000, logical_batch_size=50, physical_batch_size=16
        )
        self.assertAllClose(spec.sampling_rate, 0.05)
        self.assertAllClose(spec.expected_batch_size, 50.0)
        self.assertAllClose(spec.steps_per_epoch, 20.0)

    def test_shuffle_sampler(self):
        spec = data.train_sampler(
            1005, sampler="shuffle", logical_batch_size=50, physical_batch_size=25
        )
        self.assertEqual(spec.expected_batch_size, 50)
        self.assertEqual(spec.steps_per_epoch, 20)
        self.assertEqual(spec.physical_batches_per_step, 2)

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "physical_batch_size=16"):
            samplers.make_sampler(
                "shuffle", dataset_size=100, logical_batch_size=50, physical_batch_size=16
            )
        with self.assertRaisesRegex(ValueError, "logical_batch_size=200, dataset_size=100"):
            samplers.make_sampler(
                "poisson", dataset_size=100, logical_batch_size=200, physical_batch_size=16
            )
        with self.assertRaisesRegex(ValueError, "sampler='uniform'"):
            samplers.make_sampler(
                "uniform", dataset_size=100, logical_batch_size=20, physical_batch_size=4
            )
        with self.assertRaisesRegex(ValueError, "physical_batch_size=0"):
            samplers.make_sampler(
                "poisson", dataset_size=100, logical_batch_size=20, physical_batch_size=0
            )
        with self.assertRaisesRegex(ValueError, "physical_batch_size=16"):
            data.make_train_pipeline(
                _index_source(100),
                sampler="shuffle",
                physical_batch_size=16,
                logical_batch_size=50,
                num_steps=2,
                seed=0,
            )
        with self.assertRaisesRegex(ValueError, "start_step=5, num_steps=2"):
            data.make_train_pipeline(
                _index_source(100),
                sampler="poisson",
                physical_batch_size=16,
                logical_batch_size=50,
                num_steps=2,
                start_step=5,
                seed=0,
            )

    def test_poisson_mask_scales_to_imagenet(self):
        # One step at ImageNet scale with a 64x1024 logical batch.
        spec = samplers.make_sampler(
            "poisson", dataset_size=1_281_167, logical_batch_size=65536, physical_batch_size=128
        )
        indices, weights = spec.step_indices([0, 0], 7)
        n = float(tf.reduce_sum(weights))
        sd = np.sqrt(65536 * (1 - spec.sampling_rate))
        self.assertLess(abs(n - 65536), 5 * sd)
        self.assertEqual(int(tf.shape(indices)[0]) % 128, 0)


class PoissonPipelineTest(tf.test.TestCase):
    N, Q, STEPS = 1000, 0.05, 400

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        ds = data.make_train_pipeline(
            _index_source(cls.N),
            sampler="poisson",
            physical_batch_size=16,
            logical_batch_size=int(cls.Q * cls.N),
            num_steps=cls.STEPS,
            seed=123,
        )
        cls.steps = _steps(ds)

    def test_batch_size_mean_and_variance(self):
        sizes = np.array([len(_real_labels(step)) for step in self.steps])
        self.assertLen(sizes, self.STEPS)
        mean, var = self.N * self.Q, self.N * self.Q * (1 - self.Q)
        # 5 standard errors of the mean; the sample variance within 30%
        # (about 4 of its standard deviations). Fixed-size batches have
        # variance 0 and fail.
        self.assertLess(abs(sizes.mean() - mean), 5 * np.sqrt(var / self.STEPS))
        self.assertAllClose(sizes.var(ddof=1), var, rtol=0.3)

    def test_every_example_appears_with_frequency_q(self):
        counts = np.bincount(
            np.concatenate([_real_labels(step) for step in self.steps]), minlength=self.N
        )
        self.assertEqual(counts.max() <= self.STEPS, True)
        self.assertTrue(np.all(counts > 0), "some example was never sampled")
        freq = counts / self.STEPS
        self.assertAllClose(freq.mean(), self.Q, atol=0.002)
        # Per-example counts are Binomial(STEPS, q).
        self.assertAllClose(counts.var(), self.STEPS * self.Q * (1 - self.Q), rtol=0.3)
        # No example appears twice in a step.
        for step in self.steps[:50]:
            labels = _real_labels(step)
            self.assertLen(np.unique(labels), len(labels))

    def test_padding_and_last(self):
        for step in self.steps:
            for i, (images, labels, weights, last) in enumerate(step):
                self.assertEqual(images.shape, (16, 1, 1, 1))
                self.assertEqual(images.dtype, np.float32)
                self.assertEqual(labels.dtype, np.int32)
                self.assertEqual(weights.dtype, np.float32)
                self.assertEqual(bool(last), i == len(step) - 1)
                self.assertTrue(np.all((weights == 0) | (weights == 1)))
                self.assertAllEqual(images[weights == 0], np.zeros_like(images[weights == 0]))
                self.assertAllEqual(labels[weights == 0], np.zeros_like(labels[weights == 0]))
                # Real examples hold their own image (image value == index).
                self.assertAllEqual(images[weights == 1][:, 0, 0, 0], labels[weights == 1])
            # Padding only at the end of a step, fewer than P of it.
            weights = np.concatenate([b[2] for b in step])
            n = int(weights.sum())
            self.assertAllEqual(weights[:n], np.ones(n))
            self.assertLess(len(weights) - n, 16 + (n == 0) * 16)

    def test_empty_step_yields_one_padding_batch(self):
        ds = data.make_train_pipeline(
            _index_source(100),
            sampler="poisson",
            physical_batch_size=8,
            logical_batch_size=1,
            num_steps=30,
            seed=0,
        )
        steps = _steps(ds)
        self.assertLen(steps, 30)
        empty = [s for s in steps if len(_real_labels(s)) == 0]
        self.assertNotEmpty(empty)  # P(empty) = 0.99^100, about 37%
        for step in empty:
            self.assertLen(step, 1)
            images, _, weights, last = step[0]
            self.assertTrue(last)
            self.assertAllEqual(weights, np.zeros(8))
            self.assertAllEqual(images, np.zeros_like(images))


class PadGranuleTest(tf.test.TestCase):
    """A finer padding granule: same examples, shorter last batches."""

    def _steps(self, pad_granule, host=0, num_hosts=1, n=300, steps=40):
        ctx = tf.distribute.InputContext(
            num_input_pipelines=num_hosts, input_pipeline_id=host, num_replicas_in_sync=num_hosts
        )
        return _steps(data.make_train_pipeline(
            _index_source(n), sampler="poisson", physical_batch_size=16,
            logical_batch_size=20, num_steps=steps, seed=1,
            sampling_key=np.array([3, 4], np.int64), pad_granule=pad_granule,
            input_context=ctx if num_hosts > 1 else None,
        ))

    def test_same_examples_and_less_padding(self):
        whole, fine = self._steps(None), self._steps(4)
        self.assertLen(fine, len(whole))
        sizes = set()
        for w, f in zip(whole, fine):
            # Every sampled example exactly once, in the same order, with
            # the same image: the granule changes only the padding.
            self.assertAllEqual(_real_labels(f), _real_labels(w))
            self.assertLen(np.unique(_real_labels(f)), len(_real_labels(f)))
            for images, labels, weights, _ in f:
                self.assertAllEqual(images[weights > 0][:, 0, 0, 0], labels[weights > 0])
                self.assertAllEqual(images[weights == 0], np.zeros_like(images[weights == 0]))
            lengths = [len(b[2]) for b in f]
            sizes.update(lengths)
            # Whole physical batches, then one shorter one, a multiple of 4.
            self.assertAllEqual(lengths[:-1], [16] * (len(lengths) - 1))
            self.assertEqual(lengths[-1] % 4, 0)
            n = len(_real_labels(f))
            self.assertEqual(sum(lengths), max(-(-n // 4), 1) * 4)
            self.assertEqual([bool(b[3]) for b in f], [False] * (len(f) - 1) + [True])
            self.assertLessEqual(len(f), len(w))
        self.assertLessEqual(sizes, {4, 8, 12, 16})
        self.assertGreater(len(sizes), 1)
        self.assertLess(sum(len(b[2]) for s in fine for b in s),
                        sum(len(b[2]) for s in whole for b in s))

    def test_hosts_stay_in_lockstep(self):
        single = self._steps(4)
        hosts = [self._steps(4, h, 2) for h in range(2)]
        for s, step in enumerate(single):
            union = np.concatenate([_real_labels(h[s]) for h in hosts])
            self.assertAllEqual(np.sort(union), np.sort(_real_labels(step)))
            self.assertEqual([len(b[2]) for b in hosts[0][s]], [len(b[2]) for b in hosts[1][s]])

    def test_resolve_pad_granule(self):
        self.assertEqual(data.batch_padding.resolve_pad_granule(None, 256), 256)
        self.assertEqual(data.batch_padding.resolve_pad_granule("auto", 256), 32)
        self.assertEqual(data.batch_padding.resolve_pad_granule("auto", 250), 125)
        self.assertEqual(data.batch_padding.resolve_pad_granule("auto", 7), 7)
        for bad in (0, 3, 32.0, "fine", True):
            with self.assertRaisesRegex(ValueError, "pad_granule"):
                data.batch_padding.resolve_pad_granule(bad, 16)


class _PerExampleSource:
    """The same examples without `fetch_batch`: read one example at a time."""

    random_access = True
    encoded = False

    def __init__(self, source):
        self.source = source
        self.info = source.info

    def __len__(self):
        return len(self.source)

    def fetch(self, index):
        return self.source.fetch(index)

    def as_dataset(self, **kwargs):
        return self.source.as_dataset(**kwargs)


class BatchReadTest(tf.test.TestCase):
    """Decoded in-memory sources are read a physical batch at a time.

    The batches must be the ones the per-example route builds: same
    examples, same augmentations, same padding, same static shapes.
    """

    def _both(self, preprocess_fn, pad_granule, host=0, num_hosts=1, start_step=0):
        train, _, _ = data.load_offline("digits")
        ctx = tf.distribute.InputContext(
            num_input_pipelines=num_hosts, input_pipeline_id=host, num_replicas_in_sync=num_hosts
        )
        pipelines = [
            data.make_train_pipeline(
                source, sampler="poisson", physical_batch_size=16, logical_batch_size=40,
                num_steps=7, start_step=start_step, seed=3,
                sampling_key=np.array([8, 9], np.int64), preprocess_fn=preprocess_fn,
                pad_granule=pad_granule, input_context=ctx if num_hosts > 1 else None,
            )
            for source in (train, _PerExampleSource(train))
        ]
        self.assertTrue(data.pipeline_parts.reads_batches(train))
        self.assertFalse(data.pipeline_parts.reads_batches(_PerExampleSource(train)))
        return pipelines

    def assertSameBatches(self, batched, per_example):
        self.assertEqual(batched.element_spec, per_example.element_spec)
        got, want = _steps(batched), _steps(per_example)
        self.assertLen(got, len(want))
        self.assertNotEmpty(got)
        for got_step, want_step in zip(got, want):
            self.assertEqual(len(got_step), len(want_step))
            for got_batch, want_batch in zip(got_step, want_step):
                for g, w in zip(got_batch, want_batch):
                    self.assertEqual(g.dtype, w.dtype)
                    self.assertAllEqual(g, w)

    def test_augmented_batches_match_per_example(self):
        # Random crops and flips have no batched op: the map_fn route.
        augment = data.cifar_train_preprocess(padding=2)
        for pad_granule in (None, 4):
            self.assertSameBatches(*self._both(augment, pad_granule))
        self.assertSameBatches(*self._both(augment, 4, host=1, num_hosts=2, start_step=3))

    def test_plain_batches_match_per_example(self):
        # Scaling alone is vectorized.
        self.assertSameBatches(*self._both(None, None))
        self.assertSameBatches(*self._both(lambda image: image * 2.0 - 1.0, 8))

    def test_user_preprocessing_keeps_autograph(self):
        # tfdp's own pipeline functions are traced as written; a user's
        # preprocess_fn may still branch on a tensor with a Python `if`.
        def brighten_dark(image, seed):
            del seed
            if tf.reduce_mean(image) < 0.5:
                image = image + 1.0
            return image

        def brighten_dark_eval(image):
            return brighten_dark(image, None)

        self.assertSameBatches(*self._both(brighten_dark, 4))
        _, test, _ = data.load_offline("digits")
        for source in (test, _PerExampleSource(test)):
            images = next(iter(data.make_eval_pipeline(source, 32, brighten_dark_eval)))[0]
            self.assertGreaterEqual(float(tf.reduce_min(tf.reduce_max(images, [1, 2, 3]))), 1.0)


class DeterminismTest(tf.test.TestCase):
    def _pipeline(self, sampling_name, start_step, seed=7, num_steps=8, key=(5, 6)):
        train, _, _ = data.load_offline("digits")
        return data.make_train_pipeline(
            train,
            sampler=sampling_name,
            physical_batch_size=16,
            logical_batch_size=64,
            num_steps=num_steps,
            start_step=start_step,
            seed=seed,
            sampling_key=None if key is None else np.array(key, np.int64),
            preprocess_fn=data.cifar_train_preprocess(padding=2),
        )

    def test_resume_is_exact(self):
        for name in ("poisson", "shuffle"):
            full = _steps(self._pipeline(name, 0))
            resumed = _steps(self._pipeline(name, 5))
            self.assertLen(full, 8)
            self.assertLen(resumed, 3)
            for got_step, want_step in zip(resumed, full[5:]):
                self.assertEqual(len(got_step), len(want_step))
                for got, want in zip(got_step, want_step):
                    for g, w in zip(got, want):
                        self.assertAllEqual(g, w)

    def test_sampling_key_changes_sample_and_public_seed_does_not(self):
        for name in ("poisson", "shuffle"):
            base = _real_labels(_steps(self._pipeline(name, 0, num_steps=1))[0])
            other_key = _real_labels(_steps(self._pipeline(name, 0, num_steps=1, key=(5, 7)))[0])
            other_seed = _real_labels(_steps(self._pipeline(name, 0, num_steps=1, seed=8))[0])
            self.assertNotAllEqual(base[:20], other_key[:20])
            # The public seed only moves the augmentations, not which
            # examples are drawn.
            self.assertAllEqual(base, other_seed)

    def test_sampling_is_secret_by_default_even_under_global_seeds(self):
        # Without a key the pipeline draws a fresh one from the OS's entropy:
        # seeding Keras and TF globally does not make the batches predictable.
        samples = []
        for _ in range(2):
            keras.utils.set_random_seed(0)
            tf.random.set_seed(0)
            samples.append(_real_labels(_steps(self._pipeline("poisson", 0, num_steps=1, key=None))[0]))
        self.assertNotAllEqual(samples[0][:20], samples[1][:20])


class ShufflePipelineTest(tf.test.TestCase):
    def test_each_epoch_is_a_permutation(self):
        n, b = 105, 20  # 5 steps per epoch, 5 examples left out each epoch
        ds = data.make_train_pipeline(
            _index_source(n),
            sampler="shuffle",
            physical_batch_size=5,
            logical_batch_size=b,
            num_steps=10,
            seed=3,
        )
        steps = _steps(ds)
        self.assertLen(steps, 10)
        for step in steps:
            self.assertLen(step, 4)
            self.assertAllEqual([bool(x[3]) for x in step], [False] * 3 + [True])
            self.assertEqual(sum(float(x[2].sum()) for x in step), b)
        epochs = [np.concatenate([_real_labels(s) for s in steps[e * 5 : e * 5 + 5]]) for e in (0, 1)]
        for labels in epochs:
            self.assertLen(np.unique(labels), 100)
            self.assertTrue(np.all((labels >= 0) & (labels < n)))
        self.assertNotAllEqual(epochs[0], epochs[1])


    def test_one_argument_preprocess_fn(self):
        ds = data.make_train_pipeline(
            _index_source(10),
            sampler="shuffle",
            physical_batch_size=5,
            logical_batch_size=5,
            num_steps=1,
            seed=0,
            preprocess_fn=lambda image: image + 0.5,
        )
        images, labels, _, last = next(iter(ds))
        self.assertTrue(bool(last))
        self.assertAllEqual(images[:, 0, 0, 0], tf.cast(labels, tf.float32) + 0.5)


class ShardingTest(tf.test.TestCase):
    def _host_steps(self, sampling_name, host, num_hosts):
        ctx = tf.distribute.InputContext(
            num_input_pipelines=num_hosts, input_pipeline_id=host, num_replicas_in_sync=num_hosts
        )
        ds = data.make_train_pipeline(
            _index_source(300),
            sampler=sampling_name,
            physical_batch_size=8,
            logical_batch_size=48,
            num_steps=6,
            seed=11,
            # Every host must hold the run's one key (the trainer agrees it).
            sampling_key=np.array([11, 12], np.int64),
            input_context=ctx if num_hosts > 1 else None,
        )
        return _steps(ds)

    def test_union_of_hosts_is_the_sample(self):
        for name in ("poisson", "shuffle"):
            single = self._host_steps(name, 0, 1)
            hosts = [self._host_steps(name, h, 3) for h in range(3)]
            for s, step in enumerate(single):
                union = np.concatenate([_real_labels(h[s]) for h in hosts])
                self.assertAllEqual(np.sort(union), np.sort(_real_labels(step)))
                # Hosts stay in lockstep: same number of physical batches.
                self.assertLen({len(h[s]) for h in hosts}, 1)


class EvalPipelineTest(tf.test.TestCase):
    def test_in_memory_batches_are_kept_and_identical_every_pass(self):
        source = _index_source(23, shape=(2, 2, 1))
        ds = data.make_eval_pipeline(source, 5, preprocess_fn=lambda image: image + 0.5)
        passes = [[tuple(np.asarray(t) for t in b) for b in ds] for _ in range(3)]
        for later in passes[1:]:
            for got, want in zip(later, passes[0]):
                for g, w in zip(got, want):
                    self.assertAllEqual(g, w)
        labels = np.concatenate([b[1][b[2] > 0] for b in passes[2]])
        self.assertAllEqual(labels, np.arange(23))
        self.assertTrue(data.eval_pipeline.small_decoded_array(source, ds, 2**20))
        self.assertFalse(data.eval_pipeline.small_decoded_array(source, ds, 16))

    def test_every_example_once_with_padding(self):
        source = _index_source(23, shape=(2, 2, 1))
        batches = list(data.make_eval_pipeline(source, 5))
        self.assertLen(batches, 5)
        labels = np.concatenate([b[1][b[2] > 0] for b in batches])
        self.assertAllEqual(labels, np.arange(23))
        for images, labels, weights in batches:
            self.assertEqual(images.shape, (5, 2, 2, 1))
            self.assertEqual(labels.dtype, tf.int32)
        self.assertAllEqual(batches[-1][2], [1, 1, 1, 0, 0])
        self.assertAllEqual(batches[-1][0][3:], np.zeros((2, 2, 2, 1)))

    def test_batch_reads_match_per_example(self):
        train, _, _ = data.load_offline("digits")
        normalize = data.cifar_eval_preprocess(mean=(0.5,), std=(0.25,))
        for preprocess_fn in (None, normalize):
            for host, num_hosts in ((0, 1), (1, 3)):
                ctx = tf.distribute.InputContext(
                    num_input_pipelines=num_hosts, input_pipeline_id=host,
                    num_replicas_in_sync=num_hosts,
                )
                batched, per_example = (
                    data.make_eval_pipeline(
                        source, 64, preprocess_fn=preprocess_fn,
                        input_context=ctx if num_hosts > 1 else None,
                    )
                    for source in (train, _PerExampleSource(train))
                )
                self.assertEqual(batched.element_spec, per_example.element_spec)
                got, want = list(batched), list(per_example)
                self.assertLen(got, len(want))
                for got_batch, want_batch in zip(got, want):
                    for g, w in zip(got_batch, want_batch):
                        self.assertEqual(g.dtype, w.dtype)
                        self.assertAllEqual(g, w)


class _IndexStream:
    """A streaming source of N examples whose labels are their indices."""

    random_access = False

    def __init__(self, n):
        self.n = n
        self.info = None

    def __len__(self):
        return self.n

    def as_dataset(self, shuffle=False, seed=0, input_context=None):
        del shuffle, seed, input_context
        return tf.data.Dataset.range(self.n).map(
            lambda i: (tf.fill([1, 1, 1], tf.cast(i, tf.float32)), tf.cast(i, tf.int32))
        )


class StreamingShuffleTest(tf.test.TestCase):
    # N=1000, B=100: a `.repeat().shuffle(buffer)` stream used to put an
    # example up to 9 times into one step and let steps straddle passes.

    def _steps(self, num_steps, n=1000, b=100, buffer=16384):
        return _steps(data.make_train_pipeline(
            _IndexStream(n), sampler="shuffle", physical_batch_size=b // 2,
            logical_batch_size=b, num_steps=num_steps, seed=0, shuffle_buffer=buffer,
            sampling_key=np.array([8, 9], np.int64),
        ))

    def test_no_step_holds_an_example_twice_nor_spans_two_passes(self):
        n, b = 1000, 100
        steps = self._steps(35, n, b)  # 3.5 passes of 10 steps.
        self.assertLen(steps, 35)
        for step in steps:
            labels = _real_labels(step)
            self.assertLen(labels, b)
            self.assertLen(np.unique(labels), b)
        for first in range(0, 30, 10):  # Each whole pass: every example once.
            labels = np.concatenate([_real_labels(s) for s in steps[first:first + 10]])
            self.assertAllEqual(np.sort(labels), np.arange(n))
        # A small buffer still keeps each pass a set of distinct examples.
        small = self._steps(20, n, b, buffer=10)
        for first in (0, 10):
            labels = np.concatenate([_real_labels(s) for s in small[first:first + 10]])
            self.assertLen(np.unique(labels), n)

    def test_streaming_is_accounted_without_amplification(self):
        sampler = data.train_sampler(1000, sampler="shuffle", logical_batch_size=100)
        self.assertFalse(sampler.amplified)
        self.assertEqual(sampler.unit_count(35), 4)  # 3.5 passes count as 4.
        self.assertFalse(samplers.make_sampler(
            "shuffle", dataset_size=1000, logical_batch_size=100).needs_random_access)
        with self.assertRaisesRegex(ValueError, "random-access.*sampler='shuffle'"):
            data.make_train_pipeline(_IndexStream(1000), sampler="poisson",
                                     logical_batch_size=100, num_steps=1, seed=0)


if __name__ == "__main__":
    tf.test.main()
