"""Gaussian noise for the summed clipped gradients, from stateless seeds.

The seed of logical step s is (run_seed, s): reproducible from the run's seed,
different every step, and identical on every replica that asks for it, so that
noise added after the cross-replica sum is drawn exactly once.

The sampler is TensorFlow's own: Philox uniforms from the step's stateless
key, turned into normals by the Box–Muller transform exactly as
`tf.random.stateless_normal`'s kernel does (`BoxMullerFloat`: u1 floored at
1e-7, r = sqrt(-2 ln u1), θ = 2π·u2, normals r·sin θ and r·cos θ). Only the layout
differs: each tensor's uniforms are drawn as two rows (u1, u2), and the
transform runs as vectorized element-wise ops, which on 2 CPU cores is about
1.4× faster than the kernel's scalar loop (11.2M normals: 47 ms against
67 ms). A test checks that, paired as the kernel pairs its uniforms,
this transform reproduces `tf.random.stateless_normal` to float rounding.
"""

import math

import tensorflow as tf

# `BoxMullerFloat`'s floor on u1 (TF core/lib/random/random_distributions.h):
# it keeps ln(u1) finite, since a float32 uniform is 0 with probability 2^-23.
_U1_FLOOR = 1.0e-7


def step_seed(run_seed, step):
    """The stateless seed [2] (int64) of one logical step."""
    return tf.stack([tf.cast(run_seed, tf.int64), tf.cast(step, tf.int64)])


def box_muller(u1, u2, stddev):
    """Two independent N(0, stddev²) tensors from two independent U[0, 1) tensors."""
    stddev = tf.cast(stddev, u1.dtype)
    radius = tf.sqrt(tf.math.log(tf.maximum(u1, _U1_FLOOR)) * (-2.0 * stddev * stddev))
    angle = u2 * (2.0 * math.pi)
    return radius * tf.sin(angle), radius * tf.cos(angle)


def _normal(shape, seed, stddev, dtype):
    """N(0, stddev²) of a static `shape`: one Philox draw of [2, ⌈n/2⌉] uniforms."""
    size = 1
    for d in shape:
        size *= int(d)
    half = max((size + 1) // 2, 1)
    # Half-precision uniforms are too coarse for the tails: draw in float32.
    draw_dtype = tf.float64 if dtype == tf.float64 else tf.float32
    u1, u2 = tf.unstack(tf.random.stateless_uniform([2, half], seed, dtype=draw_dtype))
    z = tf.concat(box_muller(u1, u2, stddev), 0)
    if 2 * half != size:
        z = z[:size]
    return tf.cast(tf.reshape(z, shape), dtype)


def gaussian_noise(grads, stddev, seed):
    """Independent N(0, stddev²) noise shaped like each tensor in `grads`.

    Args:
        grads: list of floating tensors. Only their (static) shapes and
            dtypes are used.
        stddev: float or scalar tensor. The noise standard deviation.
        seed: tensor [2]. A stateless seed (see `step_seed`).

    Returns:
        A list of tensors like `grads`.
    """
    grads = list(grads)
    if not grads:
        return []
    seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), len(grads))
    noise = []
    for i, g in enumerate(grads):
        if not g.dtype.is_floating or not g.shape.is_fully_defined():
            raise ValueError(
                "Noise needs floating tensors of static shape. "
                f"Received: a tensor of dtype {g.dtype.name} and shape {g.shape}."
            )
        # One tensor at a time: run side by side, the draws' temporaries
        # would add up to several copies of the parameters at peak.
        with tf.control_dependencies(noise[-1:]):
            seed_i = tf.identity(seeds[i])
        noise.append(_normal(g.shape, seed_i, stddev, g.dtype))
    return noise


def add_noise(grads, *, l2_norm_clip, noise_multiplier, seed):
    """grads + N(0, (σ·C)²) per coordinate.

    Args:
        grads: list of tensors. Summed clipped gradients of one logical step.
        l2_norm_clip: float. The clipping bound C.
        noise_multiplier: float. σ; the noise std is σ·C.
        seed: tensor [2]. The step's stateless seed (see `step_seed`).
    """
    if isinstance(noise_multiplier, (int, float)) and noise_multiplier == 0:
        return list(grads)
    stddev = tf.cast(noise_multiplier, tf.float32) * tf.cast(l2_norm_clip, tf.float32)
    noise = gaussian_noise(grads, stddev, seed)
    return [g + n for g, n in zip(grads, noise)]
