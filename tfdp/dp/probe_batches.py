"""The probe's batches: distinct random inputs, their value ranges, the rows changed.

`model_probe.probe` and the training probes (`sensitivity.probe_training`,
the Keras `train_step` probe) draw their batches here:
- `probe_value_ranges`: the value distributions a batch of a dtype is drawn
  from: for real-valued inputs the standard normal and the typical ranges
  of image data (`FLOAT_RANGES`), plus any public range the route knows; for
  integer inputs the dtype's own values. Public facts about the dtype, never
  values measured on the private data.
- `probe_inputs`: a batch of distinct random inputs from one of those
  distributions, and other values for each row.
- `changed_row_sets`: the sets of rows a probe replaces, such that a
  dependence of any row on any other row is tested.
"""

import itertools
import math

import keras
import numpy as np
import tensorflow as tf

# Ranges of real-valued inputs that the probe draws batches from, besides the
# standard normal (standardized data): [0, 1] and [-1, 1] images, 0-255
# pixels as floats. Public facts about image data, not measured on it.
FLOAT_RANGES = ((0.0, 1.0), (-1.0, 1.0), (0.0, 255.0))


def _as_range(value_range):
    """`(low, high)` as two tuples of floats (one value when all channels agree)."""
    low, high = (np.asarray(bound, np.float64).reshape(-1) for bound in value_range)
    if low.size and np.all(low == low[0]) and np.all(high == high[0]):
        low, high = low[:1], high[:1]
    return tuple(float(v) for v in low), tuple(float(v) for v in high)


def probe_value_ranges(dtype, ranges=()):
    """The value distributions that probe batches of `dtype` are drawn from.

    Args:
        dtype: the input dtype.
        ranges: sequence of `(low, high)`. Public ranges of the inputs that
            the route knows (each bound a float or one per channel), added
            to the typical ones. Defaults to `()`.

    Returns:
        list, one entry per distribution, for `probe_inputs`'
        `value_range`: None (the standard normal; for integer inputs, the
        dtype's own values, see `probe_inputs`) first, then for real-valued
        inputs each of `FLOAT_RANGES` and `ranges` once.
    """
    dtype = tf.as_dtype(dtype)
    if dtype.is_integer or dtype == tf.bool:
        return [None]
    found = [None] + [_as_range(r) for r in FLOAT_RANGES]
    for value_range in ranges:
        value_range = _as_range(value_range)
        if value_range not in found:
            found.append(value_range)
    return found


def probe_inputs(model, shape, dtype, rows, seed=0, value_range=None):
    """A batch of `rows` distinct random inputs, and other values for each row.

    Real-valued inputs are standard normal, or with `value_range` uniform in
    it, with row 0 at the low end and row 1 at the high end (the edges: an
    all-black and an all-white image). Integer inputs are valid ids for all
    of the model's embedding tables; uint8 inputs without an embedding take
    0..255 (other integers 0 and 1); row 0 holds the least and row 1 the
    greatest.

    Args:
        model: keras.Model. Integer inputs are valid ids for all of its
            embedding tables.
        shape: tuple of int. One example's shape.
        dtype: the input dtype.
        rows: int. Rows of the batch.
        seed: int. Defaults to 0.
        value_range: `(low, high)` or None. An entry of
            `probe_value_ranges`. Defaults to None.

    Returns:
        `(x, other)`: two tensors `[rows, *shape]`; every row of `other`
        differs from the same row of `x`.
    """
    rng = np.random.default_rng(seed)
    size = (rows,) + tuple(shape)
    dtype = tf.as_dtype(dtype)
    edges = rows >= 2
    if dtype.is_integer:
        # Valid ids for every embedding table of the model.
        dims = [layer.input_dim for layer in model._flatten_layers()
                if isinstance(layer, keras.layers.Embedding)]
        bound = min(dims) if dims else (256 if dtype == tf.uint8 else 2)
        if dtype == tf.uint8:
            bound = min(bound, 256)
        x = rng.integers(0, bound, size=size)
        if edges:
            x[0], x[1] = 0, bound - 1
        other = (x + 1) % bound
    elif value_range is None:
        x = rng.normal(size=size)
        other = 3.0 * rng.normal(size=size)
    else:
        low, high = (np.broadcast_to(np.asarray(b, np.float64), tuple(shape))
                     for b in value_range)
        x = rng.uniform(low, high, size=size)
        if edges:
            x[0], x[1] = low, high
        other = rng.uniform(low, high, size=size)
    return tf.constant(x, dtype), tf.constant(other, dtype)


def changed_row_sets(rows):
    """Sets of rows to change such that every row is tested against every other.

    Row r gets the r-th m-bit code with m // 2 ones; set t holds the rows
    whose code has bit t. No such code is contained in another (they all
    have m // 2 ones), so for every ordered pair of distinct rows (i, j)
    some set holds j and not i: the pass that changes that set shows a
    dependence of row i on row j. m is the least with C(m, m // 2) >= rows,
    close to the fewest sets possible (Sperner): 4 sets for 4 rows, 7 for
    32, 11 for 256.

    Args:
        rows: int. Rows of the batch (at least 2).

    Returns:
        bool array `[m, rows]`, one set a row, without sets that hold every
        row or none.
    """
    m = 2
    while math.comb(m, m // 2) < rows:
        m += 1
    sets = np.zeros([m, rows], bool)
    for r, code in enumerate(itertools.islice(itertools.combinations(range(m), m // 2), rows)):
        sets[list(code), r] = True
    return sets[sets.any(axis=1) & ~sets.all(axis=1)]
