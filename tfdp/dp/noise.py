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

Three words per pair instead of two cost about 1.35× a two-word draw. For
ResNet-18's 11.2 M normals the draw takes 1.1–1.6× the time of
`tf.random.stateless_normal`'s capped one (97–139 against 86–89 ms on
2 cores, docs/BENCHMARKS.md). The noise is drawn once per logical step, so
with several physical batches per step its cost is shared by all of them.

Hardened noise (`hardened_noise=True`) defends the release against
floating-point attacks (Mironov 2012; Jin et al. 2022): with float32 noise
added in float32, the float values x + noise can take depend on x (near a
cancellation the output lies on the grid of x's own last bit), so a single
output can tell neighbouring sums apart. The hardened release is:
- the noise N in float64, the sum of `HARDENED_DRAWS` independent
  Box–Muller draws of std stddev/√k, each from its own split of the draw's
  seed (Holohan & Braghin 2021), each from four Philox words: a 96-bit
  uniform u1 (no draw capped below 11.6 times its std) and an angle;
- x + N in float64, rounded to the nearest multiple of the public grid
  γ = 2^(⌊log₂ stddev⌋ − `HARDENED_GRID_BITS`);
- divided by the divisor and rounded once to the sums' dtype.
IEEE addition and the roundings are correctly rounded, so the output is a
fixed function of the exact real x + N whose level sets are intervals at
least γ wide: the release is post-processing of x + N, and it departs from
the exact Gaussian mechanism only where N's distribution departs from a
Gaussian's on intervals of width γ (about 2¹⁶ float64 values of N at
|N| = stddev), not on a grid of x's making. docs/PRIVACY.md,
"Floating-point noise", has the argument, its cost and what it leaves.
"""

import math

import tensorflow as tf

# u1 is a 64-bit uniform (hi·2³² + lo + ½)·2⁻⁶⁴: at least 2⁻⁶⁵.
_WORD = 2.0**-32
_LN_2_POW_32 = 32.0 * math.log(2.0)
MAX_ABS_NORMAL = math.sqrt(-2.0 * math.log(2.0**-65))
# Hardened noise: independent draws summed per coordinate, each of std
# stddev/√k, so that the sum's std is stddev. Two smooth the float64 law of
# one Box–Muller draw at the grid's scale, at twice one draw's cost.
HARDENED_DRAWS = 2
# γ = 2^(⌊log₂ stddev⌋ − 36): an interval of width γ holds at least 2¹¹
# float64 values of N wherever N can be (|N| < 16.5 stddev), so N's law on
# it sums over many of N's values; and γ adds at most 2⁻³⁷ stddev of
# rounding, far below float32's resolution away from zero.
HARDENED_GRID_BITS = 36
# A hardened draw's u1 is a 96-bit uniform, at least 2⁻⁹⁷: √(194 ln 2) ≈ 11.6.
MAX_ABS_HARDENED_DRAW = math.sqrt(-2.0 * math.log(2.0**-97))
# Rows of a draw's words are whole multiples of this many pairs (see
# `_normal_halves`): the layout fixes which Philox words each coordinate
# gets, so it is part of what makes a run's noise reproducible.
_PAIRS_PER_BLOCK_ROW = 32


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


def hardened_box_muller(hi, mid, lo, angle_word, stddev):
    """Two independent N(0, stddev²) float64 tensors from four tensors of uint32 words.

    u1 = (hi·2⁶⁴ + mid·2³² + lo + ½)·2⁻⁹⁶, in (0, 1], at least 2⁻⁹⁷, so the
    radius is at most `MAX_ABS_HARDENED_DRAW`; computed as
    ln(hi + (mid + (lo + ½)·2⁻³²)·2⁻³²) − 32 ln 2, which keeps full float64
    precision in the tail.
    """
    dtype = tf.float64
    low = (tf.cast(mid, dtype) + (tf.cast(lo, dtype) + 0.5) * _WORD) * _WORD
    x = tf.cast(hi, dtype) + low
    # ln u1 ≤ 0; rounding of x near 2³² must not make it positive.
    log_u1 = tf.minimum(tf.math.log(x) - _LN_2_POW_32, 0.0)
    stddev = tf.cast(stddev, dtype)
    radius = tf.sqrt(log_u1 * (-2.0 * stddev * stddev))
    angle = (tf.cast(angle_word, dtype) + 0.5) * (_WORD * 2.0 * math.pi)
    return radius * tf.sin(angle), radius * tf.cos(angle)


def hardened_grid(stddev):
    """γ: the public grid of a hardened release, 2^(⌊log₂ stddev⌋ − 36), float64.

    Read from stddev's exponent bits, so it is an exact power of two (0 for
    stddev 0).

    Args:
        stddev: float or scalar tensor. The noise standard deviation.
    """
    bits = tf.bitcast(tf.cast(stddev, tf.float64), tf.int64)
    exponent = tf.bitwise.bitwise_and(bits, tf.constant(0x7FF0000000000000, tf.int64))
    return tf.bitcast(exponent, tf.float64) * 2.0**-HARDENED_GRID_BITS


def _pairs(size):
    """Box–Muller pairs in a draw of `size` values (one at least)."""
    return max((size + 1) // 2, 1)


def _draw_seeds(seed, num_draws):
    """One stateless seed per draw, split from the step's seed."""
    return tf.unstack(
        tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), num_draws)
    ) if num_draws else []


def _normal_halves(size, seed, stddev, hardened_noise=False):
    """N(0, stddev²) values for `size` coordinates, as Box–Muller's halves.

    One Philox draw of [3, padded] words, `padded` being the ⌈size/2⌉ pairs
    rounded up to a multiple of 32, so each row starts on a Philox block of
    its own; float32. The draw's values, in order, are the sin half then
    the cos half; the caller takes the first `size`.

    With `hardened_noise`, float64: the sum of `HARDENED_DRAWS` draws of
    [4, padded] words (`hardened_box_muller`), each of std stddev/√k and
    from its own split of `seed`.
    """
    half = _pairs(size)
    padded = -(-half // _PAIRS_PER_BLOCK_ROW) * _PAIRS_PER_BLOCK_ROW
    if hardened_noise:
        scale = tf.cast(stddev, tf.float64) * (1.0 / math.sqrt(HARDENED_DRAWS))
        sin_half = cos_half = None
        for draw_seed in _draw_seeds(seed, HARDENED_DRAWS):
            words = tf.random.stateless_uniform(
                [4, padded], draw_seed, minval=None, maxval=None, dtype=tf.uint32)
            sin_part, cos_part = hardened_box_muller(*tf.unstack(words), scale)
            if sin_half is None:
                sin_half, cos_half = sin_part, cos_part
            else:
                sin_half, cos_half = sin_half + sin_part, cos_half + cos_part
    else:
        words = tf.random.stateless_uniform(
            [3, padded], seed, minval=None, maxval=None, dtype=tf.uint32
        )
        hi, lo, angle_word = tf.unstack(words)
        sin_half, cos_half = box_muller(hi, lo, angle_word, tf.cast(stddev, tf.float32))
    if padded == half:
        return sin_half, cos_half
    return sin_half[:half], cos_half[:half]


def gaussian_noise(grads, stddev, seed, hardened_noise=False):
    """Independent N(0, stddev²) noise shaped like each tensor in `grads`.

    Args:
        grads: list of floating tensors. Only their (static) shapes and
            dtypes are used.
        stddev: float or scalar tensor. The noise standard deviation.
        seed: tensor [2]. A stateless seed (see `step_seed`).
        hardened_noise: bool. Draw the hardened noise (module docstring),
            in float64, to be added by `release`. Defaults to `False`.

    Returns:
        A list of tensors like `grads` (float64 with `hardened_noise`).
    """
    return _noised(grads, stddev, seed, lambda g, n: n, hardened_noise)


def noisy_divided(sums, stddev, seed, divisor, hardened_noise=False):
    """`release(sums, gaussian_noise(sums, stddev, seed), ...)`, draw by draw.

    The noise is `gaussian_noise(sums, stddev, seed, hardened_noise)`'s,
    but each draw is consumed before the next one starts, so only one draw
    and its temporaries are alive at a time (at 224 px, drawing all of
    ResNet-18's noise before adding it made the private step's peak about
    180 MB above non-private training's).

    Args:
        sums: list of floating tensors. Summed clipped gradients.
        stddev: float or scalar tensor. The noise standard deviation.
        seed: tensor [2]. A stateless seed (see `step_seed`).
        divisor: float. The public expected batch size.
        hardened_noise: bool. Release as `release` does with it. Defaults
            to `False`.

    Returns:
        A list of tensors like `sums`.
    """
    grid = hardened_grid(stddev) if hardened_noise else None
    return _noised(sums, stddev, seed,
                   lambda g, n: _release_one(g, n, divisor, grid), hardened_noise)


def release(sums, noise, stddev, divisor, hardened_noise=False):
    """(sums + noise) / divisor, tensor by tensor, in the sums' dtypes.

    With `hardened_noise` the noise is float64 (`gaussian_noise`'s hardened
    draw, or a noise scheme's combination of them): each sum is added to it
    in float64, rounded to the nearest multiple of `hardened_grid(stddev)`,
    divided, and rounded once to its dtype (module docstring).

    Args:
        sums: list of floating tensors. Summed clipped gradients.
        noise: list of tensors like `sums`.
        stddev: float or scalar tensor. The std the noise was drawn with
            (its grid's scale).
        divisor: float. The public expected batch size.
        hardened_noise: bool. Defaults to `False`.

    Returns:
        A list of tensors like `sums`.
    """
    grid = hardened_grid(stddev) if hardened_noise else None
    return [_release_one(s, n, divisor, grid) for s, n in zip(sums, noise)]


def _release_one(total, noise, divisor, grid):
    """(total + noise) / divisor; on `grid` (float64, hardened) unless it is None."""
    if grid is None:
        return (total + tf.cast(noise, total.dtype)) / divisor
    noised = tf.cast(total, tf.float64) + tf.cast(noise, tf.float64)
    # Every output, near zero too, lies on the public grid: none on a grid
    # of the sum's own last bits. A zero grid (no noise) leaves the sum.
    safe = tf.where(grid > 0, grid, tf.ones_like(grid))
    on_grid = tf.where(grid > 0, tf.round(noised / safe) * safe, noised)
    return tf.cast(on_grid / divisor, total.dtype)


# Elements per Philox draw. Small tensors (biases, norms: most of a model's
# variables) share a draw: a draw per tensor costs about 15 ops, and for the
# default run's 12 variables one draw halves the update step's ops. Large
# tensors are drawn in pieces: a whole-tensor draw's temporaries (its words,
# their float casts, the radius and angle) are about 5x the tensor, and for
# ResNet-18 at 32 px they set the private step's peak memory (289 against
# 236 MiB for the non-private update).
_DRAW_ELEMENTS = 2**18


def _draw_pieces(grads):
    """The draws, in order: lists of `(tensor index, start, size)` pieces.

    A tensor of at least `_DRAW_ELEMENTS` elements has draws of its own, one
    per piece, and its pieces and their halves start at multiples of 2¹⁷
    elements: slices of it there are views, not copies. Smaller tensors share
    draws, each whole in one draw.
    """
    draws, room = [], 0
    for i, g in enumerate(grads):
        if not g.dtype.is_floating or not g.shape.is_fully_defined():
            raise ValueError(
                "Noise needs floating tensors of static shape. "
                f"Received: a tensor of dtype {g.dtype.name} and shape {g.shape}."
            )
        n = g.shape.num_elements()
        if n >= _DRAW_ELEMENTS:
            draws.extend(
                [(i, start, min(_DRAW_ELEMENTS, n - start))]
                for start in range(0, n, _DRAW_ELEMENTS)
            )
            room = 0
        elif n:
            if n > room:
                draws.append([])
                room = _DRAW_ELEMENTS
            draws[-1].append((i, 0, n))
            room -= n
    return draws


def _segments(draw, halves):
    """`(tensor index, start, noise)` segments of one draw's pieces.

    A piece that spans the sin and cos halves becomes two segments, so no
    draw is concatenated into one tensor first. That copy and the copies of
    unaligned slices of the gradients took about a sixth of the noise's op
    time (213 against 177 ms per call for 9.7 M normals on 2 cores).
    """
    sin_half, cos_half = halves
    half = int(sin_half.shape[0])
    segments, offset = [], 0
    for i, start, size in draw:
        end = offset + size
        if offset < half:
            segments.append((i, start, sin_half[offset:min(end, half)]))
        if end > half:
            first = max(offset, half)
            segments.append((i, start + first - offset, cos_half[first - half:end - half]))
        offset = end
    return segments


def _noised(grads, stddev, seed, combine, hardened_noise):
    grads = list(grads)
    if not grads:
        return []
    draws = _draw_pieces(grads)
    combined = [[] for _ in grads]  # Each tensor's combined segments, in order.
    seeds = _draw_seeds(seed, len(draws))
    previous = []
    for draw, draw_seed in zip(draws, seeds):
        # One draw at a time, each started once the last one is consumed:
        # side by side, their temporaries would add up to several copies of
        # the parameters at peak.
        with tf.control_dependencies(previous):
            draw_seed = tf.identity(draw_seed)
        halves = _normal_halves(sum(size for _, _, size in draw), draw_seed, stddev,
                                hardened_noise)
        previous = []
        for i, start, noise in _segments(draw, halves):
            g = grads[i]
            size = int(noise.shape[0])
            if size == g.shape.num_elements():
                g_part, noise = g, tf.reshape(noise, g.shape)
            else:
                g_part = tf.reshape(g, [-1])[start:start + size]
            part = combine(g_part, noise if hardened_noise else tf.cast(noise, g.dtype))
            combined[i].append(part)
            previous.append(part)
    results = []
    for g, parts in zip(grads, combined):
        if not parts:  # No elements.
            results.append(combine(g, tf.zeros(g.shape, tf.float64 if hardened_noise
                                               else g.dtype)))
        elif len(parts) == 1:
            results.append(parts[0])
        else:
            results.append(tf.reshape(tf.concat(parts, 0), g.shape))
    return results


def add_noise(grads, *, l2_norm_clip, noise_multiplier, seed, hardened_noise=False):
    """grads + N(0, (σ·C)²) per coordinate.

    Args:
        grads: list of tensors. Summed clipped gradients of one logical step.
        l2_norm_clip: float. The clipping bound C.
        noise_multiplier: float. σ; the noise std is σ·C.
        seed: tensor [2]. The step's stateless seed (see `step_seed`).
        hardened_noise: bool. The hardened release (module docstring).
            Defaults to `False`.
    """
    if isinstance(noise_multiplier, (int, float)) and noise_multiplier == 0:
        return list(grads)
    # The hardened draw is float64 throughout, its std too.
    dtype = tf.float64 if hardened_noise else tf.float32
    stddev = tf.cast(noise_multiplier, dtype) * tf.cast(l2_norm_clip, dtype)
    return noisy_divided(grads, stddev, seed, 1.0, hardened_noise)
