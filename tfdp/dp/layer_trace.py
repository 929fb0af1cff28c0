"""One forward pass, recorded layer call by layer call, as the probe compares it.

`traced_forward` runs a model with every layer call under its own
`tf.GradientTape`, and keeps, for each call, the variables it read itself
and a digest (`Digester`) of each row of its inputs and outputs: all that a
comparison of two passes needs (`digests_same`), at about the memory of an
inference pass. `model_probe` compares such traces to find layers that mix
examples and variables read by a layer that does not own them.
"""

import threading

import numpy as np
import tensorflow as tf

# Values per signed sum in a layer call's digest: a row of d values is kept
# as d / DIGEST_CHUNK sums of DIGEST_CHUNK values with fixed random signs, so
# a change to one value moves one sum by that much (as the elementwise
# comparison would see it), while float noise between two passes, summed
# over DIGEST_CHUNK values, stays far below `TOLERANCE`.
DIGEST_CHUNK = 16
# Relative tolerance of a comparison: float noise between two passes is far
# below it; a layer that mixes examples moves its other rows far above it.
TOLERANCE = 1e-4


class Digester:
    """Digests of batch-first tensors: what a comparison of rows needs.

    A tensor of `rows` rows becomes `(scales, sums)`: each row's largest
    magnitude (`[rows]`), and each row as float32 sums of `DIGEST_CHUNK`
    consecutive values times fixed random signs (`[rows, ceil(d /
    DIGEST_CHUNK)]`). Other tensors (scalars, strings, other batch sizes)
    become None, and comparisons skip them. Graph ops: called while the
    passes are traced.

    Args:
        rows: int. The probe batch's rows.
    """

    def __init__(self, rows):
        self.rows = rows

    def __call__(self, nest):
        """The digests of `nest`'s tensors, flattened: `(scales, sums)` or None each."""
        digests = []
        for t in tf.nest.flatten(nest):
            if (not isinstance(t, (tf.Tensor, tf.Variable)) or t.shape.rank in (None, 0)
                    or t.shape[0] != self.rows or t.dtype in (tf.string, tf.bool)):
                digests.append(None)
                continue
            values = tf.reshape(tf.cast(t, tf.float32), [self.rows, -1])
            size = tf.shape(values)[1]
            # The same signs for a size in every pass (a stateless draw).
            seed = tf.stack([tf.cast(size, tf.int64), tf.constant(0, tf.int64)])
            bits = tf.random.stateless_uniform([size], seed=seed, minval=0, maxval=2,
                                               dtype=tf.int32)
            signs = tf.cast(2 * bits - 1, tf.float32)
            padded = tf.math.floormod(-size, DIGEST_CHUNK)
            signed = tf.pad(values * signs, [[0, 0], [0, padded]])
            sums = tf.reduce_sum(tf.reshape(signed, [self.rows, -1, DIGEST_CHUNK]), axis=2)
            # An empty row's maximum is -inf: its scale is 0.
            scales = tf.maximum(tf.reduce_max(tf.abs(values), axis=1), 0.0)
            digests.append((scales, sums))
        return digests


def digests_same(a, b, kept):
    """Whether two digests agree on the `kept` rows to `TOLERANCE` of `a`'s scale.

    Args:
        a: list. A `Digester` output: the reference (its scale sets the
            tolerance).
        b: list. A `Digester` output of the same nest in another pass.
        kept: bool array `[rows]`. The rows compared; tensors digested as
            None are skipped.

    Returns:
        bool.
    """
    if len(a) != len(b):
        return False
    for u, w in zip(a, b):
        if u is None or w is None:
            continue
        (scales, sums_u), (_, sums_w) = u, w
        sums_u, sums_w = np.asarray(sums_u)[kept], np.asarray(sums_w)[kept]
        if sums_u.shape != sums_w.shape:
            return False
        scale = float(np.max(np.asarray(scales)[kept], initial=0.0))
        tolerance = TOLERANCE * max(scale, 1e-6)
        if float(np.max(np.abs(sums_u - sums_w), initial=0.0)) > tolerance:
            return False
    return True


class LayerTrace:
    """What `traced_forward` recorded of one pass.

    Attributes:
        calls: list of `(layer, input digest, output digest)`, one per layer
            call in order of completion.
        reads: dict from `id(layer)` to the ids (`variable_id`) of the
            variables its calls read themselves.
        model_reads: set of the ids of the variables the pass read outside
            any layer call.
        outputs: the model's outputs.
    """

    def __init__(self):
        # (layer, digest of its inputs, digest of its outputs), in order of
        # completion (see `Digester`): symbolic in the tracing, values in
        # the copy `with_values` makes for each run.
        self.calls = []
        self.reads = {}  # id(layer) -> ids of variables the call read itself.
        self.model_reads = set()
        self.outputs = None

    def with_values(self, digests, outputs):
        """This trace's layers and reads with one run's digests and outputs."""
        run = LayerTrace()
        run.calls = [(layer, d_in, d_out)
                     for (layer, _, _), (d_in, d_out) in zip(self.calls, digests)]
        run.reads, run.model_reads, run.outputs = self.reads, self.model_reads, outputs
        return run


def variable_id(v):
    """An id shared by a Keras variable and the TensorFlow variable it wraps."""
    return id(getattr(v, "_value", v))


def traced_forward(model, x, training, digest):
    """Runs `model(x, training=training)`, recording each layer call.

    Every layer call runs under its own
    `tf.GradientTape(watch_accessed_variables=True)`, with the enclosing
    call's tape paused, so each call's tape holds the variables that call
    reads itself. Calls from other threads are not recorded.

    Args:
        model: keras.Model.
        x: tensor. The batch.
        training: bool. Passed to the model.
        digest: callable. Maps a layer call's inputs or outputs to what the
            trace keeps of them (a `Digester`).

    Returns:
        A `LayerTrace`.
    """
    trace = LayerTrace()
    thread = threading.get_ident()
    tapes = []
    patched = []

    def wrap(layer, original):
        def call(*args, **kwargs):
            if threading.get_ident() != thread or not tapes:
                return original(*args, **kwargs)
            with tapes[-1].stop_recording():
                with tf.GradientTape(watch_accessed_variables=True) as tape:
                    tapes.append(tape)
                    try:
                        outputs = original(*args, **kwargs)
                    finally:
                        tapes.pop()
            reads = trace.reads.setdefault(id(layer), set())
            reads.update(variable_id(v) for v in tape.watched_variables())
            inputs = args[0] if args else next(iter(kwargs.values()), None)
            trace.calls.append((layer, digest(inputs), digest(outputs)))
            return outputs

        return call

    for layer in model._flatten_layers(include_self=False, recursive=True):
        had = "call" in layer.__dict__
        previous = layer.__dict__.get("call")
        patched.append((layer, had, previous))
        layer.call = wrap(layer, layer.call)
    try:
        with tf.GradientTape(watch_accessed_variables=True) as outer:
            tapes.append(outer)
            trace.outputs = model(x, training=training)
            tapes.pop()
        trace.model_reads = {variable_id(v) for v in outer.watched_variables()}
    finally:
        for layer, had, previous in reversed(patched):
            if had:
                layer.call = previous
            else:
                object.__delattr__(layer, "call")
    return trace
