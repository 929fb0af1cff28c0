"""Noise std σ·C (statistically), seeds, virtual steps, plan, errors."""

import pytest
import logging

import keras
import numpy as np
from scipy import stats
import tensorflow as tf

from tests.dp import dp_test_case
from tfdp import dp
from tfdp import models
from tfdp import privacy
from tfdp.dp import noise as noise_lib
from tfdp.secret_key import SecretKey


def _noise_std_test(samples, stddev, alpha=1e-6):
    """Two-sided chi-square test that `samples` ~ N(0, stddev²). True = accept."""
    n = samples.size
    statistic = float(np.sum(np.square(samples))) / stddev**2
    p_low = stats.chi2.cdf(statistic, n)
    return min(p_low, 1.0 - p_low) * 2 > alpha


class NoiseTest(tf.test.TestCase):

    def test_noise_std_is_sigma_times_c(self):
        zeros = [tf.zeros([300, 400]), tf.zeros([50_000])]
        sigma, clip = 1.3, 0.7
        noisy = dp.add_noise(zeros, l2_norm_clip=clip, noise_multiplier=sigma,
                             seed=dp.step_seed([0, 0], 5))
        samples = np.concatenate([t.numpy().ravel() for t in noisy])
        self.assertTrue(_noise_std_test(samples, sigma * clip))
        # The same test rejects 0.9x and 1.1x of the true std: it has power.
        self.assertFalse(_noise_std_test(samples, 0.9 * sigma * clip))
        self.assertFalse(_noise_std_test(samples, 1.1 * sigma * clip))
        self.assertLess(abs(float(np.mean(samples))), 5 * sigma * clip / np.sqrt(samples.size))

    def test_noise_is_added_to_the_gradients(self):
        grads = [tf.fill([1000], 3.0)]
        noisy = dp.add_noise(grads, l2_norm_clip=1.0, noise_multiplier=1.0, seed=dp.step_seed([1, 0], 1))
        self.assertAllClose(np.mean(noisy[0].numpy()), 3.0, atol=0.2)
        self.assertGreater(np.std(noisy[0].numpy()), 0.8)

    def test_seeds_reproducible_and_distinct_per_step(self):
        g = [tf.zeros([64])]
        a = dp.add_noise(g, l2_norm_clip=1.0, noise_multiplier=1.0, seed=dp.step_seed([7, 0], 3))[0]
        b = dp.add_noise(g, l2_norm_clip=1.0, noise_multiplier=1.0, seed=dp.step_seed([7, 0], 3))[0]
        c = dp.add_noise(g, l2_norm_clip=1.0, noise_multiplier=1.0, seed=dp.step_seed([7, 0], 4))[0]
        d = dp.add_noise(g, l2_norm_clip=1.0, noise_multiplier=1.0, seed=dp.step_seed([8, 0], 3))[0]
        self.assertAllEqual(a, b)
        self.assertNotAllClose(a, c)
        self.assertNotAllClose(a, d)

    def test_largest_draw_is_beyond_nine_sigma(self):
        # The smallest u1 (hi = lo = 0) gives the largest radius, 9.49: no
        # draw is capped below 9σ (TF's sampler stops at 5.68σ).
        quarter_turn = tf.constant([2**30], tf.uint32)  # θ = π/2: sin θ = 1.
        z_sin, _ = noise_lib.box_muller(tf.constant([0], tf.uint32), tf.constant([0], tf.uint32),
                                        quarter_turn, 1.0)
        self.assertGreater(float(z_sin[0]), 9.0)
        self.assertAllClose(float(z_sin[0]), noise_lib.MAX_ABS_NORMAL, rtol=1e-5)
        self.assertGreater(noise_lib.MAX_ABS_NORMAL, 9.0)

    def test_radius_is_exact_in_the_tail(self):
        # r² = -2 ln u1 with u1 = (hi·2³² + lo + ½)·2⁻⁶⁴, to float32 precision
        # even where u1 is far below float32's uniform resolution (2⁻²³).
        hi = np.array([0, 0, 0, 1, 7, 2**10, 2**20, 2**31, 2**32 - 1], np.uint64)
        lo = np.array([0, 1, 2**31, 0, 123, 2**32 - 1, 5, 0, 2**32 - 1], np.uint64)
        u1 = (hi.astype(np.float64) * 2.0**32 + lo.astype(np.float64) + 0.5) * 2.0**-64
        expected = np.sqrt(-2.0 * np.log(u1))
        zero_angle = tf.zeros([len(hi)], tf.uint32)  # θ ≈ 0: cos θ = 1.
        _, z_cos = noise_lib.box_muller(tf.constant(hi.astype(np.uint32)),
                                        tf.constant(lo.astype(np.uint32)), zero_angle, 1.0)
        self.assertAllClose(z_cos, expected, rtol=2e-5, atol=2e-4)
        self.assertTrue(np.all(np.isfinite(z_cos.numpy())))
        # Scaling by the std happens inside the transform.
        _, scaled = noise_lib.box_muller(tf.constant(hi.astype(np.uint32)),
                                         tf.constant(lo.astype(np.uint32)), zero_angle, 2.5)
        self.assertAllClose(scaled, 2.5 * z_cos, rtol=1e-5)

    def test_truncation_costs_at_most_a_hundredth_of_delta(self):
        # The accountant's tail mass is the sampler's: P(R > cap) = 2^-65.
        self.assertAllClose(np.exp(-noise_lib.MAX_ABS_NORMAL**2 / 2),
                            privacy.deltas.NOISE_TAIL_MASS_PER_PAIR, rtol=1e-9)
        # The default run (469 steps, 26,106 parameters, δ = 1e-5) and the
        # paper's (1,369 steps, ResNet-18's 11.7 M, δ = 1e-6).
        self.assertLess(privacy.noise_truncation_delta(469, 26_106), 1e-5 / 100)
        self.assertLess(privacy.noise_truncation_delta(1369, 11_687_720), 1e-6 / 100)
        # TF's sampler: P(u1 < 1e-7) per pair would cost ~1e-7·d/2 per step.
        self.assertGreater(469 * 26_106 / 2 * 1e-7, 1e-5)

    def test_step_seeds_depend_on_the_whole_key(self):
        # Both 64-bit words of the key matter: a key is 128 secret bits.
        base = dp.step_seed([5, 6], 3).numpy()
        self.assertNotAllEqual(base, dp.step_seed([5, 7], 3).numpy())
        self.assertNotAllEqual(base, dp.step_seed([4, 6], 3).numpy())
        self.assertNotAllEqual(base, dp.step_seed([5, 6], 4).numpy())
        self.assertAllEqual(base, dp.step_seed([5, 6], 3).numpy())

    def test_noise_is_standard_normal_and_independent(self):
        shapes = [[3, 3, 64, 64], [64], [1], [7, 5], [513]]  # Odd and tiny sizes too.
        tensors = [tf.zeros(s) for s in shapes]
        noise = noise_lib.gaussian_noise(tensors, 2.0, dp.step_seed([4, 0], 9))
        for t, n in zip(tensors, noise):
            self.assertEqual(n.shape, t.shape)
            self.assertEqual(n.dtype, t.dtype)
        big = noise[0].numpy().ravel() / 2.0
        # Kolmogorov-Smirnov against N(0, 1): the shape, not just the variance.
        self.assertGreater(stats.kstest(big, "norm").pvalue, 1e-4)
        self.assertLess(stats.kstest(big * 1.05, "norm").pvalue, 1e-4)
        # The sin and cos halves of one draw are uncorrelated, and so are
        # two tensors of one step and one tensor in two steps.
        half = big.size // 2
        again = noise_lib.gaussian_noise(tensors, 2.0, dp.step_seed([4, 0], 10))[0].numpy().ravel()
        limit = 5.0 / np.sqrt(half)
        self.assertLess(abs(np.corrcoef(big[:half], big[half:])[0, 1]), limit)
        self.assertLess(abs(np.corrcoef(big, again)[0, 1]), 5.0 / np.sqrt(big.size))
        pair = noise_lib.gaussian_noise([tf.zeros([4096])] * 2, 1.0, dp.step_seed([0, 0], 0))
        self.assertLess(abs(np.corrcoef(pair[0].numpy(), pair[1].numpy())[0, 1]), 5.0 / 64)
        # Tails: P(|z| > 3) = 0.0027.
        self.assertAllClose(np.mean(np.abs(big) > 3.0), 0.0027, atol=0.0015)

    def test_draws_are_box_muller_of_tensorflows_philox_words(self):
        # Each value is the Box–Muller pair of TF's own Philox words for the
        # draw's seed, laid out as `_normal_halves` documents, against a
        # float64 evaluation of the same words.
        seed = dp.step_seed([11, 12], 3)
        for size in (1, 2, 15, 64, 65, 1001, 2**18 + 3):
            with self.subTest(size=size):
                half = max((size + 1) // 2, 1)
                padded = -(-half // 32) * 32
                words = tf.random.stateless_uniform(
                    [3, padded], seed, minval=None, maxval=None, dtype=tf.uint32
                ).numpy().astype(np.float64)
                hi, lo, angle = words[:, :half]
                radius = 1.5 * np.sqrt(-2.0 * np.log((hi * 2.0**32 + lo + 0.5) * 2.0**-64))
                theta = 2.0 * np.pi * (angle + 0.5) * 2.0**-32
                sin_half, cos_half = (h.numpy() for h in noise_lib._normal_halves(size, seed, 1.5))
                self.assertEqual(sin_half.shape, (half,))
                # Near u1 = 1, ln x − 32 ln 2 cancels in float32: 1.2e-3 σ at
                # worst over 16.8 M normals. A wrong word, pair order or sign
                # is off by about σ.
                self.assertAllClose(sin_half, radius * np.sin(theta), rtol=0, atol=3e-3 * 1.5)
                self.assertAllClose(cos_half, radius * np.cos(theta), rtol=0, atol=3e-3 * 1.5)
        # The big draw reached the tail, where the low word sets u1: about 1
        # pair in 256 has a high word below 2²⁴.
        self.assertGreater(int(np.sum(hi < 2**24)), 200)
        self.assertGreater(float(np.max(np.abs(np.concatenate([sin_half, cos_half])))), 4.5 * 1.5)

    def test_xla_draws_the_same_law(self):
        # XLA lays out TF's Philox stream its own way: another draw of the
        # same law, not the same values.
        g = [tf.zeros([2**16])]
        seed = dp.step_seed([1, 2], 3)
        eager = noise_lib.noisy_divided(g, 1.0, seed, 1.0)[0].numpy()
        with_xla = tf.function(
            lambda: noise_lib.noisy_divided(g, 1.0, seed, 1.0)[0], jit_compile=True
        )().numpy()
        self.assertEqual(with_xla.shape, eager.shape)
        self.assertGreater(stats.kstest(with_xla, "norm").pvalue, 1e-4)
        self.assertLess(stats.kstest(with_xla * 1.05, "norm").pvalue, 1e-4)

    def test_draws_share_small_tensors_and_split_large_ones(self):
        n = noise_lib._DRAW_ELEMENTS
        shapes = [[5], [2 * n + 7], [3], [n - 2], [4], [0], [2]]
        pieces = noise_lib._draw_pieces([tf.zeros(s) for s in shapes])
        # A large tensor's pieces are its own draws, aligned to the draw
        # size; small tensors share draws but are never split between two.
        self.assertEqual(pieces, [[(0, 0, 5)], [(1, 0, n)], [(1, n, n)], [(1, 2 * n, 7)],
                                  [(2, 0, 3)], [(3, 0, n - 2)], [(4, 0, 4), (6, 0, 2)]])
        # A draw's values are its sin half, then its cos half, each used
        # once, also for a tensor that spans the two halves.
        seed = dp.step_seed([3, 0], 5)
        shared = noise_lib.gaussian_noise([tf.zeros([5]), tf.zeros([2, 3]), tf.zeros([4])], 1.0, seed)
        draw_seed = tf.random.experimental.stateless_split(seed, 1)[0]
        expected = tf.concat(noise_lib._normal_halves(15, draw_seed, 1.0), 0)[:15]
        self.assertAllEqual(tf.concat([tf.reshape(t, [-1]) for t in shared], 0), expected)
        self.assertEqual(noise_lib.gaussian_noise([tf.zeros([0, 3])], 1.0, seed)[0].shape, (0, 3))
        tensors = [tf.zeros([3])] * 3000 + [tf.zeros([2, 2], tf.float64),
                                           tf.zeros([n // 2, 5])]
        noise = noise_lib.gaussian_noise(tensors, 1.0, dp.step_seed([3, 0], 2))
        self.assertEqual(noise[-2].dtype, tf.float64)
        self.assertEqual(noise[-1].shape, (n // 2, 5))
        rows = np.stack([n.numpy() for n in noise[:3000]])
        self.assertEqual(len(np.unique(rows, axis=0)), 3000)  # No tensor repeats another.
        values = np.concatenate([n.numpy().ravel() for n in noise])
        self.assertGreater(stats.kstest(values, "norm").pvalue, 1e-4)
        # Neighbouring tensors of one draw, and the pieces of a split one,
        # are uncorrelated.
        firsts = np.array([n.numpy()[0] for n in noise[:3000]])
        self.assertLess(abs(np.corrcoef(firsts[:-1], firsts[1:])[0, 1]), 5.0 / np.sqrt(3000))
        split = noise[-1].numpy().ravel()
        a, b = split[: n // 2], split[n // 2: n]
        self.assertLess(abs(np.corrcoef(a, b)[0, 1]), 5.0 / np.sqrt(a.size))
        # Each piece is added to its own slice of the tensor.
        ramp = tf.reshape(tf.range(3 * n, dtype=tf.float32), [3, n])
        noised = noise_lib.noisy_divided([ramp], 0.0, dp.step_seed([3, 0], 2), 2.0)[0]
        self.assertAllEqual(noised, ramp / 2.0)

    def test_float64_and_bfloat16_noise(self):
        tensors = [tf.zeros([20_000], tf.float64), tf.zeros([20_000], tf.bfloat16)]
        noise = noise_lib.gaussian_noise(tensors, 1.0, dp.step_seed([0, 0], 1))
        self.assertEqual(noise[0].dtype, tf.float64)
        self.assertEqual(noise[1].dtype, tf.bfloat16)
        self.assertTrue(_noise_std_test(noise[0].numpy(), 1.0, alpha=1e-4))
        self.assertAllClose(np.std(tf.cast(noise[1], tf.float32).numpy()), 1.0, atol=0.05)

    def test_noise_needs_static_floating_shapes(self):
        with self.assertRaisesRegex(ValueError, "static shape"):
            tf.function(
                lambda t: noise_lib.gaussian_noise([t], 1.0, dp.step_seed([0, 0], 0)),
                input_signature=[tf.TensorSpec([None], tf.float32)],
            ).get_concrete_function()
        with self.assertRaisesRegex(ValueError, "floating"):
            noise_lib.gaussian_noise([tf.zeros([3], tf.int32)], 1.0, dp.step_seed([0, 0], 0))

    def test_zero_sigma_adds_nothing(self):
        g = [tf.ones([5])]
        self.assertAllEqual(dp.add_noise(g, l2_norm_clip=1.0, noise_multiplier=0.0, seed=[0, 0])[0], g[0])


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return models.small_convnet(num_classes=10, input_shape=(28, 28, 1))


def _batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return (tf.constant(rng.normal(size=(n, 28, 28, 1)).astype("float32")),
            tf.constant(rng.integers(0, 10, n), tf.int32))


class PrivateTrainStepTest(tf.test.TestCase):

    def _weights_after(self, batches, *, sigma=0.0, clip=1e6, method="bk", private=True, seed=0,
                       traces=None, trace_for_any_length=False):
        model = _model()
        optimizer = keras.optimizers.SGD(0.1)
        if private:
            step = dp.PrivateTrainStep(
                model, optimizer, dp_test_case.per_example_xent, l2_norm_clip=clip,
                noise_multiplier=sigma, expected_batch_size=8.0, method=method,
                secret_key=SecretKey.insecure_from_seed(seed),
            )
        else:
            step = dp.NonPrivateTrainStep(
                model, optimizer, dp_test_case.per_example_xent, expected_batch_size=8.0
            )
        if trace_for_any_length:
            x, y = batches[0]
            step.trace_for((
                tf.TensorSpec([None] + list(x.shape[1:]), x.dtype),
                tf.TensorSpec([None], y.dtype), tf.TensorSpec([None], tf.float32),
            ))
        for x, y in batches:
            step.accumulate(x, y, tf.ones([x.shape[0]]))
        step.apply()
        self.assertEqual(int(optimizer.iterations), 1)
        if traces is not None:
            traces.append(step._accumulate_fn.experimental_get_tracing_count())
        return [v.numpy() for v in model.trainable_variables]

    def test_step_without_batches_applies_a_zero_sum(self):
        # The accumulators still hold the previous step's sum; a logical step
        # that accumulated nothing must not apply it again (σ = 0, plain SGD:
        # the weights stay where they are).
        model = _model()
        optimizer = keras.optimizers.SGD(0.1)
        step = dp.PrivateTrainStep(
            model, optimizer, dp_test_case.per_example_xent, l2_norm_clip=1.0,
            noise_multiplier=0.0, expected_batch_size=8.0, method="bk",
            secret_key=SecretKey.insecure_from_seed(0),
        )
        x, y = _batch(8)
        step.accumulate(x, y, tf.ones([8]))
        step.apply()
        after_one = [v.numpy() for v in model.trainable_variables]
        self.assertTrue(any(np.any(a != b) for a, b in zip(
            after_one, [v.numpy() for v in _model().trainable_variables])))
        step.apply()
        self.assertEqual(int(optimizer.iterations), 2)
        for a, v in zip(after_one, model.trainable_variables):
            self.assertAllEqual(a, v.numpy())

    def test_virtual_steps_equal_one_big_batch_at_sigma_zero(self):
        x, y = _batch(8)
        whole = self._weights_after([(x, y)])
        halves = self._weights_after([(x[:4], y[:4]), (x[4:], y[4:])])
        for a, b in zip(whole, halves):
            self.assertAllClose(a, b, rtol=1e-5, atol=1e-6)

    def test_private_step_with_huge_clip_and_no_noise_is_nonprivate_step(self):
        x, y = _batch(8)
        private = self._weights_after([(x, y)])
        plain = self._weights_after([(x, y)], private=False)
        for a, b in zip(private, plain):
            self.assertAllClose(a, b, rtol=1e-5, atol=1e-6)

    def test_every_method_gives_the_same_clipped_step_in_the_traced_step(self):
        # The step is traced without autograph: every method must run there,
        # over two virtual steps, and agree with naive (the slow test below
        # varies the batches' lengths).
        x, y = _batch(8)
        batches = [(x[:4], y[:4]), (x[4:], y[4:])]
        want = self._weights_after(batches, clip=0.1, method="naive")
        for method in ("vectorized", "ghost", "mixed", "bk"):
            got = self._weights_after(batches, clip=0.1, method=method)
            for a, b in zip(got, want):
                self.assertAllClose(a, b, rtol=1e-4, atol=1e-6, msg=method)

    @pytest.mark.slow
    def test_batches_of_many_lengths_trace_twice_and_clip_alike(self):
        # Poisson steps end in physical batches of varying length: from the
        # second length on, one trace of unknown batch size serves them all,
        # and every method still agrees with naive in it.
        x, y = _batch(8)
        batches = [(x[:3], y[:3]), (x[3:5], y[3:5]), (x[5:6], y[5:6]), (x[6:], y[6:])]
        naive_traces = []
        want = self._weights_after(batches, clip=0.1, method="naive", traces=naive_traces)
        # Naive loops over the examples in Python: one trace per length.
        self.assertEqual(naive_traces, [3])
        for method in ("vectorized", "ghost", "mixed", "bk"):
            traces = []
            got = self._weights_after(batches, clip=0.1, method=method, traces=traces)
            self.assertEqual(traces, [2], msg=method)
            for a, b in zip(got, want):
                self.assertAllClose(a, b, rtol=1e-4, atol=1e-6, msg=method)
            # Traced first for the pipeline's spec (unknown batch size), as
            # the trainer does: one trace for every length.
            traces = []
            got = self._weights_after(batches, clip=0.1, method=method, traces=traces,
                                      trace_for_any_length=True)
            self.assertEqual(traces, [1], msg=method)
            for a, b in zip(got, want):
                self.assertAllClose(a, b, rtol=1e-4, atol=1e-6, msg=method)

        # With σ huge the clipped sum is negligible: the update is lr·noise/B, and
        # its std must be lr·σ·C/B however many physical batches there are.
        x, y = _batch(8)
        before = [v.numpy() for v in _model().trainable_variables]
        sigma, clip, lr, b = 100.0, 1e-2, 0.1, 8.0
        for batches in ([(x, y)], [(x[:2], y[:2]), (x[2:4], y[2:4]), (x[4:], y[4:])]):
            after = self._weights_after(batches, sigma=sigma, clip=clip)
            delta = np.concatenate([(a - w).ravel() for a, w in zip(after, before)])
            self.assertTrue(_noise_std_test(delta, lr * sigma * clip / b))


class PlanAndErrorsTest(tf.test.TestCase):

    def test_plan_follows_the_layerwise_rule(self):
        model = models.resnet18(num_classes=10, input_shape=(32, 32, 3))
        p = dp.plan(model, (32, 32, 3), 32, method="mixed")
        text = str(p)
        self.assertIn("stem", text)
        for layer in p.layers:
            if layer.kind == "conv2d":
                expected = "ghost" if 2 * layer.t**2 < layer.p * layer.d else "instantiate"
                self.assertEqual(layer.mode, expected, layer.name)
                # Ghost norms of the stride-1 3×3 convs skip unfolding.
                three_by_three = tuple(model.get_layer(layer.name).kernel_size) == (3, 3)
                strided = model.get_layer(layer.name).strides != (1, 1)
                self.assertEqual(
                    layer.pixel_gram, expected == "ghost" and three_by_three and not strided,
                    layer.name,
                )
                self.assertIn(layer.rule, str(p))
            if layer.kind == "generic":
                self.assertEqual(layer.mode, "instantiate")
        modes = {l.mode for l in p.layers if l.kind == "conv2d"}
        self.assertEqual(modes, {"ghost", "instantiate"})  # Truly mixed at 32 px.
        self.assertGreater(p.memory_bytes, 0)

    def test_batchnorm_raises_and_points_to_converter(self):
        inp = keras.Input((8, 8, 3))
        h = keras.layers.Conv2D(4, 3)(inp)
        h = keras.layers.BatchNormalization(name="bn_here")(h)
        model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
        for method in ("auto", "bk", "naive", "vectorized"):
            with self.assertRaisesRegex(ValueError, "bn_here.*replace_batchnorm"):
                dp.clipped_grad_sum(model, dp_test_case.per_example_xent, tf.zeros([2, 8, 8, 3]),
                                    tf.constant([0, 1]), l2_norm_clip=1.0, method=method)

    def test_bad_arguments(self):
        model = _model()
        x, y = _batch(2)
        with self.assertRaisesRegex(ValueError, "l2_norm_clip"):
            dp.clipped_grad_sum(model, dp_test_case.per_example_xent, x, y, l2_norm_clip=0.0)
        with self.assertRaisesRegex(ValueError, "method"):
            dp.clipped_grad_sum(model, dp_test_case.per_example_xent, x, y, l2_norm_clip=1.0,
                                method="fast")
        with self.assertRaisesRegex(ValueError, "noise_multiplier"):
            dp.PrivateTrainStep(model, keras.optimizers.SGD(0.1), dp_test_case.per_example_xent,
                                l2_norm_clip=1.0, noise_multiplier=-1.0, expected_batch_size=2)


class VectorizedHasNoWhileLoopTest(tf.test.TestCase):

    def _captured_warnings(self, fn):
        records = []

        class Handler(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())

        handler = Handler(level=logging.WARNING)
        logger = logging.getLogger("tensorflow")
        logger.addHandler(handler)
        try:
            fn()
        finally:
            logger.removeHandler(handler)
        return [r for r in records if "while_loop" in r or "Fix that" in r]

    def test_capture_detects_the_plain_vectorized_map_pitfall(self):
        kernel = tf.Variable(tf.random.normal([3, 3, 2, 4]))

        def per_example(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.nn.conv2d(x[None], kernel, 1, "SAME"))
            return tape.gradient(loss, kernel)

        found = self._captured_warnings(
            lambda: tf.vectorized_map(per_example, tf.random.normal([3, 6, 6, 2]))
        )
        self.assertNotEmpty(found)  # Else the test below could not fail.

    def test_vectorized_method_uses_no_while_loop(self):
        model = models.resnet18(num_classes=10, input_shape=(16, 16, 3))
        x = tf.random.normal([3, 16, 16, 3])
        found = self._captured_warnings(
            lambda: dp.clipped_grad_sum(model, dp_test_case.per_example_xent, x,
                                        tf.constant([0, 1, 2]), l2_norm_clip=1.0,
                                        method="vectorized")
        )
        self.assertEmpty(found)


if __name__ == "__main__":
    tf.test.main()


class MixedPrecisionTest(tf.test.TestCase):

    def test_tapped_methods_work_in_float32_under_bfloat16(self):
        keras.utils.set_random_seed(0)
        x = tf.random.normal([4, 28, 28, 1])
        y = tf.constant([0, 1, 2, 3])
        reference = _model()
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        try:
            model = _model()
        finally:
            keras.mixed_precision.set_global_policy("float32")
        model.set_weights(reference.get_weights())
        _, ref_norms = dp.clipped_grad_sum(reference, dp_test_case.per_example_xent, x, y,
                                           l2_norm_clip=1.0, method="naive")
        for method in ("ghost", "mixed", "bk"):
            grads, norms = dp.clipped_grad_sum(model, dp_test_case.per_example_xent, x, y,
                                               l2_norm_clip=1.0, method=method)
            self.assertEqual({g.dtype for g in grads}, {tf.float32})
            self.assertEqual(norms.dtype, tf.float32)
            self.assertAllClose(norms, ref_norms, rtol=5e-2)


class AugmentationMultiplicityStepTest(tf.test.TestCase):

    def test_augmentations_differ_and_are_reproducible(self):
        from tfdp.dp import augmentation_multiplicity as am

        x = tf.random.normal([2, 8, 8, 1])
        a = am.flip_and_translate(tf.repeat(x, 4, 0), tf.constant([1, 2], tf.int64))
        b = am.flip_and_translate(tf.repeat(x, 4, 0), tf.constant([1, 2], tf.int64))
        self.assertAllEqual(a, b)
        self.assertEqual(a.shape, [8, 8, 8, 1])
        distinct = {a[i].numpy().tobytes() for i in range(4)}
        self.assertGreater(len(distinct), 1)

    def test_step_with_multiplicity_clips_the_mean_gradient(self):
        # σ = 0 and a tiny C: every example's mean gradient is clipped to C,
        # so the update norm is at most lr·C·(examples)/B.
        model = _model()
        before = [v.numpy() for v in model.trainable_variables]
        step = dp.PrivateTrainStep(
            model, keras.optimizers.SGD(1.0), dp_test_case.per_example_xent,
            l2_norm_clip=1e-3, noise_multiplier=0.0, expected_batch_size=4.0,
            augmentation_multiplicity=3,
        )
        x, y = _batch(4)
        step.accumulate(x, y, tf.ones([4]))
        step.apply()
        delta = np.sqrt(sum(np.sum((v.numpy() - b) ** 2)
                            for v, b in zip(model.trainable_variables, before)))
        self.assertLessEqual(delta, 1e-3 * 4 / 4.0 * (1 + 1e-4))
        self.assertGreater(delta, 0.0)
        self.assertEqual(step.pop_stats()["examples"], 4.0)
