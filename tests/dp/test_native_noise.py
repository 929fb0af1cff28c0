"""The native noise op draws the noise that TensorFlow's ops define.

`tfdp/dp/native_noise.cc` must compute, for any seed, the Box–Muller pairs of
TensorFlow's own Philox words (tested against a float64 evaluation of those
words), and `noisy_divided` must add them where the TF path adds its own.
Where it cannot run (turned off, inside XLA, no compiler) the TF path must
take over, loudly when asked to.
"""

import contextlib
import os
from unittest import mock

import numpy as np
from scipy import stats
import tensorflow as tf

from tfdp import dp
from tfdp.dp import native_noise
from tfdp.dp import noise as noise_lib


@contextlib.contextmanager
def _native_mode(value):
    old = os.environ.get("TFDP_NATIVE_NOISE")
    os.environ["TFDP_NATIVE_NOISE"] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ["TFDP_NATIVE_NOISE"]
        else:
            os.environ["TFDP_NATIVE_NOISE"] = old


@contextlib.contextmanager
def _fresh_loader():
    """Forgets the loaded op for the duration (restored after)."""
    saved = dict(native_noise._state)
    native_noise._state.update(module=None, error=None, tried=False, isa=None)
    try:
        yield
    finally:
        native_noise._state.clear()
        native_noise._state.update(saved)


def _reference_halves(size, seed, stddev):
    """float64 Box–Muller of TF's Philox words, laid out as `_normal_halves`."""
    half = max((size + 1) // 2, 1)
    padded = -(-half // 32) * 32
    words = tf.random.stateless_uniform([3, padded], seed, minval=None, maxval=None,
                                        dtype=tf.uint32).numpy().astype(np.float64)
    hi, lo, angle = words[:, :half]
    u1 = (hi * 2.0**32 + lo + 0.5) * 2.0**-64
    radius = stddev * np.sqrt(-2.0 * np.log(u1))
    theta = 2.0 * np.pi * (angle + 0.5) * 2.0**-32
    return radius * np.sin(theta), radius * np.cos(theta), hi


def _tf_path_halves(size, seed, stddev):
    with _native_mode("off"):
        return [h.numpy() for h in noise_lib._normal_halves(size, seed, stddev)]


class NativeNoiseTest(tf.test.TestCase):

    def setUp(self):
        super().setUp()
        if native_noise.load() is None:
            self.skipTest(f"native noise op unavailable: {native_noise._state['error']}")

    def test_draws_are_box_muller_of_tensorflows_philox_words(self):
        seed = dp.step_seed([11, 12], 3)
        for size in (1, 2, 15, 64, 65, 1001, 2**18 + 3):
            with self.subTest(size=size):
                self.assertTrue(native_noise.usable_here())
                sin_half, cos_half = (h.numpy() for h in noise_lib._normal_halves(size, seed, 1.5))
                ref_sin, ref_cos, hi = _reference_halves(size, seed, 1.5)
                self.assertEqual(sin_half.shape, ref_sin.shape)
                # Within 3e-5 σ of the exact values, tail included (1.8e-5 σ
                # at worst over 16.8 M normals). A wrong word, pair order,
                # octant or sign is off by about σ.
                self.assertAllClose(sin_half, ref_sin, rtol=0, atol=3e-5 * 1.5)
                self.assertAllClose(cos_half, ref_cos, rtol=0, atol=3e-5 * 1.5)
                # And the TF path computes the same draw, less precisely: near
                # u1 = 1 its ln x − 32 ln 2 cancels (1.2e-3 σ at worst over
                # 16.8 M normals).
                tf_sin, tf_cos = _tf_path_halves(size, seed, 1.5)
                self.assertAllClose(tf_sin, ref_sin, rtol=0, atol=3e-3 * 1.5)
                self.assertAllClose(tf_cos, ref_cos, rtol=0, atol=3e-3 * 1.5)
        # The big draw reached the tail, where the low word sets u1: about 1
        # pair in 256 has a high word below 2²⁴.
        self.assertGreater(int(np.sum(hi < 2**24)), 200)
        self.assertGreater(float(np.max(np.abs(np.concatenate([sin_half, cos_half])))), 4.5 * 1.5)

    def test_fused_noisy_divided_adds_the_same_draws(self):
        n = noise_lib._DRAW_ELEMENTS
        # Shared draws, a tensor across a draw's sin and cos halves, a split
        # tensor with a short last piece, an empty tensor.
        shapes = [[5], [2 * n + 7], [3], [n - 2], [4], [0], [2], [3, 3, 64, 64], [1001]]
        rng = np.random.default_rng(0)
        sums = [tf.constant(rng.normal(size=s).astype(np.float32)) for s in shapes]
        seed = dp.step_seed([3, 4], 7)
        fused = noise_lib.noisy_divided(sums, 1.7, seed, 3.0)
        unfused = noise_lib._noised(sums, 1.7, seed, lambda g, z: (g + z) / 3.0)
        with _native_mode("off"):
            tf_path = noise_lib.noisy_divided(sums, 1.7, seed, 3.0)
        for f, u, t, g in zip(fused, unfused, tf_path, sums):
            self.assertEqual(f.shape, g.shape)
            self.assertAllEqual(f, u)  # The fused op adds the op's own draw.
            self.assertAllClose(f, t, rtol=0, atol=3e-3 * 1.7 / 3.0)
        # It adds noise: the noisy values are not the sums.
        self.assertGreater(float(np.std(fused[1].numpy() - sums[1].numpy() / 3.0)), 0.5)
        # With zero std it is the division alone, element by element.
        ramp = tf.reshape(tf.range(3 * n, dtype=tf.float32), [3, n])
        self.assertAllEqual(noise_lib.noisy_divided([ramp], 0.0, seed, 2.0)[0], ramp / 2.0)

    def test_native_noise_is_standard_normal(self):
        self.assertTrue(native_noise.usable_here(600_000))
        z = noise_lib.gaussian_noise([tf.zeros([600_000])], 2.0, dp.step_seed([4, 1], 9))[0]
        z = z.numpy() / 2.0
        self.assertGreater(stats.kstest(z, "norm").pvalue, 1e-4)
        self.assertLess(stats.kstest(z * 1.02, "norm").pvalue, 1e-4)
        # The std is σ·C: a two-sided chi-square test accepts it and rejects
        # a std 1 % off either way.
        def std_p_value(samples):
            p_low = stats.chi2.cdf(float(np.sum(np.square(samples))), samples.size)
            return 2 * min(p_low, 1 - p_low)

        self.assertGreater(std_p_value(z), 1e-6)
        self.assertLess(std_p_value(z / 1.01), 1e-6)
        self.assertLess(std_p_value(z * 1.01), 1e-6)
        self.assertAllClose(np.mean(np.abs(z) > 3.0), 0.0027, atol=0.0006)

    def test_xla_and_off_use_tensorflow_ops(self):
        g = [tf.zeros([native_noise.MIN_NORMALS])]
        seed = dp.step_seed([1, 2], 3)
        native = noise_lib.noisy_divided(g, 1.0, seed, 1.0)[0]
        with _native_mode("off"):
            tf_ops = noise_lib.noisy_divided(g, 1.0, seed, 1.0)[0]
        self.assertAllClose(native, tf_ops, rtol=0, atol=3e-3)
        self.assertNotAllEqual(native, tf_ops)  # The op drew it, to its own rounding.

        @tf.function(jit_compile=True)
        def under_xla():
            self.assertFalse(native_noise.usable_here())
            return noise_lib.noisy_divided(g, 1.0, seed, 1.0)[0]

        # XLA lays out TF's Philox stream its own way, so this is another
        # draw: the same law, not the same values.
        with_xla = under_xla().numpy()
        self.assertNotAllClose(with_xla, native)
        self.assertAllClose(np.std(with_xla), 1.0, atol=0.05)
        with _native_mode("off"):
            self.assertFalse(native_noise.usable_here())
            self.assertIsNone(native_noise.load())
        with _native_mode("sometimes"):
            with self.assertRaisesRegex(ValueError, "Received: TFDP_NATIVE_NOISE='sometimes'"):
                native_noise.usable_here()

    def test_unbuildable_op_falls_back_or_fails_when_required(self):
        with _fresh_loader(), mock.patch.object(native_noise, "_compiler", return_value=None):
            with self.assertLogs("tfdp.dp.native_noise", "WARNING") as logs:
                self.assertIsNone(native_noise.load())
            self.assertIn("no C++ compiler", "\n".join(logs.output))
            self.assertFalse(native_noise.usable_here())
            # The TF path still draws the noise.
            self.assertEqual(noise_lib.gaussian_noise([tf.zeros([7])], 1.0, [0, 0])[0].shape, (7,))
            with _native_mode("require"):
                with self.assertRaisesRegex(RuntimeError, "TFDP_NATIVE_NOISE=require.*no C\\+\\+ compiler"):
                    native_noise.load()

    def test_small_steps_keep_tensorflow_ops_and_never_build(self):
        small = [tf.zeros([1000]), tf.zeros([native_noise.MIN_NORMALS - 1001])]
        seed = dp.step_seed([2, 2], 2)
        with _fresh_loader(), mock.patch.object(native_noise, "_build") as build:
            self.assertFalse(native_noise.usable_here(native_noise.MIN_NORMALS - 1))
            drawn = noise_lib.noisy_divided(small, 1.0, seed, 1.0)
            noise_lib.gaussian_noise(small, 1.0, seed)
        build.assert_not_called()
        with _native_mode("off"):
            self.assertAllEqual(drawn[1], noise_lib.noisy_divided(small, 1.0, seed, 1.0)[1])

    def test_generic_build_is_not_used(self):
        # Without AVX2 or AVX-512 the op is slower than TF's: keep TF's ops.
        def generic_cdll(path):
            del path
            return mock.Mock(TfdpNativeNoiseIsa=mock.Mock(return_value=b"generic"))

        with _fresh_loader(), mock.patch.object(native_noise.ctypes, "CDLL", generic_cdll):
            self.assertIsNone(native_noise.load())
            self.assertEqual(native_noise.instruction_set(), "generic")
            self.assertFalse(native_noise.usable_here())
        self.assertIn(native_noise.instruction_set(), ("avx2", "avx512"))

    def test_build_is_cached_per_source_and_machine(self):
        library = native_noise._build(native_noise._compiler())
        self.assertTrue(library.exists())
        # A second build finds the cached library instead of compiling.
        with mock.patch.object(native_noise.subprocess, "run") as run:
            self.assertEqual(native_noise._build(native_noise._compiler()), library)
        run.assert_not_called()
        with mock.patch.object(native_noise, "_cpu_features", return_value="flags : other"):
            self.assertNotEqual(native_noise._library_path(native_noise._compiler()), library)


if __name__ == "__main__":
    tf.test.main()
