"""Gaussian noise for the summed clipped gradients, from a secret key.

The seed of logical step s is `stateless_fold_in(noise_key, s)`, where
`noise_key` is the run's secret sub-key (`tfdp.secret_key.SecretKey`): a
resumed run draws the same noise, every replica that asks draws the same
tensor (so noise added after the cross-replica sum is drawn exactly once),
and nobody without the key can predict it.

The sampler is Box–Muller on Philox words, with a radius fine enough in the
tail that no draw is capped below 9σ:
- u1 = (hi + (lo + ½)·2⁻³²)·2⁻³², from two 32-bit words: a 64-bit uniform in
  (0, 1], never 0, so r = √(−2 ln u1) ≤ √(130 ln 2) ≈ 9.49. It is computed in
  float32 as ln(hi + (lo + ½)·2⁻³²) − 32 ln 2, which keeps full relative
  precision in the tail, where hi is small.
- θ = 2π·(w + ½)·2⁻³² from a third word.
- The normals are r·sin θ and r·cos θ.

TensorFlow's own `stateless_normal` floors a float32 u1 at 1e-7, which caps
every draw at 5.68σ. Then a coordinate beyond the cap reveals that an example
was present: for the default run that event alone costs more than δ
(docs/PRIVACY.md, "Floating-point noise"). Here the tail mass beyond the cap,
P(R > 9.49) = 2⁻⁶⁵ per pair of normals, is the whole truncation cost.

Three words per pair instead of two cost about 1.35× the earlier two-word
vectorized draw; the draw is still faster than `tf.random.stateless_normal`
(61 ms against 88 ms for ResNet-18's 11.2 M normals; docs/BENCHMARKS.md).
"""

import math

import tensorflow as tf

# u1 is a 64-bit uniform (hi·2³² + lo + ½)·2⁻⁶⁴: at least 2⁻⁶⁵.
_WORD = 2.0**-32
_LN_2_POW_32 = 32.0 * math.log(2.0)
MAX_ABS_NORMAL = math.sqrt(-2.0 * math.log(2.0**-65))


def step_seed(noise_key, step):
    """The stateless seed [2] (int64) of one logical step.

    Args:
        noise_key: int64 [2]. The run's noise sub-key
            (`SecretKey.derive("noise")`).
        step: int or scalar tensor. The logical step.
    """
    return tf.random.experimental.stateless_fold_in(
        tf.cast(noise_key, tf.int64), tf.cast(step, tf.int64)
    )


def box_muller(hi, lo, angle_word, stddev):
    """Two independent N(0, stddev²) tensors from three tensors of uint32 words."""
    dtype = tf.float32
    x = tf.cast(hi, dtype) + (tf.cast(lo, dtype) + 0.5) * _WORD
    # ln u1 ≤ 0; float32 rounding of x near 2³² must not make it positive.
    log_u1 = tf.minimum(tf.math.log(x) - _LN_2_POW_32, 0.0)
    radius = tf.sqrt(log_u1 * (-2.0 * stddev * stddev))
    angle = (tf.cast(angle_word, dtype) + 0.5) * (_WORD * 2.0 * math.pi)
    return radius * tf.sin(angle), radius * tf.cos(angle)


def _normal(size, seed, stddev):
    """`size` float32 N(0, stddev²) values: one Philox draw of [3, ⌈size/2⌉] words."""
    half = max((size + 1) // 2, 1)
    words = tf.random.stateless_uniform(
        [3, half], seed, minval=None, maxval=None, dtype=tf.uint32
    )
    hi, lo, angle_word = tf.unstack(words)
    z = tf.concat(box_muller(hi, lo, angle_word, tf.cast(stddev, tf.float32)), 0)
    return z[:size] if 2 * half != size else z


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
    return _noised(grads, stddev, seed, lambda g, n: n)


def noisy_divided(sums, stddev, seed, divisor):
    """(sums + N(0, stddev²)) / divisor, tensor by tensor.

    The noise is `gaussian_noise(sums, stddev, seed)`'s, but each draw is
    consumed before the next one starts, so only one draw and its
    temporaries are alive at a time (at 224 px, drawing all of ResNet-18's
    noise before adding it made the private step's peak about 180 MB above
    non-private training's).

    Args:
        sums: list of floating tensors. Summed clipped gradients.
        stddev: float or scalar tensor. The noise standard deviation.
        seed: tensor [2]. A stateless seed (see `step_seed`).
        divisor: float. The public expected batch size.

    Returns:
        A list of tensors like `sums`.
    """
    return _noised(sums, stddev, seed, lambda g, n: (g + n) / divisor)


# Elements per Philox draw. Small tensors (biases, norms: most of a model's
# variables) share a draw: a draw per tensor costs about 15 ops, and for the
# default run's 12 variables one draw halves the update step's ops. Large
# tensors are drawn in pieces: a whole-tensor draw's temporaries (its words,
# their float casts, the radius and angle) are about 5x the tensor, and for
# ResNet-18 at 32 px they set the private step's peak memory (289 against
# 236 MiB for the non-private update).
_DRAW_ELEMENTS = 2**18


def _draw_pieces(grads):
    """The draws, in order: lists of `(tensor index, start, size)` pieces."""
    draws, room = [], 0
    for i, g in enumerate(grads):
        if not g.dtype.is_floating or not g.shape.is_fully_defined():
            raise ValueError(
                "Noise needs floating tensors of static shape. "
                f"Received: a tensor of dtype {g.dtype.name} and shape {g.shape}."
            )
        start, n = 0, g.shape.num_elements()
        while start < n:
            if room == 0:
                draws.append([])
                room = _DRAW_ELEMENTS
            size = min(n - start, room)
            draws[-1].append((i, start, size))
            start += size
            room -= size
    return draws


def _noised(grads, stddev, seed, combine):
    grads = list(grads)
    if not grads:
        return []
    draws = _draw_pieces(grads)
    seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), len(draws))
    done = [[] for _ in grads]  # Combined pieces of each tensor.
    previous = []
    for draw, draw_seed in zip(draws, tf.unstack(seeds)):
        # One draw at a time: side by side, their temporaries would add up
        # to several copies of the parameters at peak.
        with tf.control_dependencies(previous):
            draw_seed = tf.identity(draw_seed)
        sizes = [size for _, _, size in draw]
        noise = _normal(sum(sizes), draw_seed, stddev)
        previous = [noise]
        parts = tf.split(noise, sizes) if len(draw) > 1 else [noise]
        for (i, start, size), part in zip(draw, parts):
            g = grads[i]
            whole = size == g.shape.num_elements()
            g_part = g if whole else tf.reshape(g, [-1])[start:start + size]
            part = tf.cast(tf.reshape(part, g.shape) if whole else part, g.dtype)
            done[i].append(combine(g_part, part))
    return [
        pieces[0] if len(pieces) == 1 else tf.reshape(tf.concat(pieces, 0), g.shape)
        for g, pieces in zip(grads, done)
    ]


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
