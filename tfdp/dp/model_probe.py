"""Probes a model for what per-layer clipping cannot see, at the batch size used.

The tapped clipping methods ("ghost", "mixed", "bk") see a trainable variable
only through the calls of the layer that owns it, and every method assumes
that an example's outputs depend on that example alone. Forward passes
on a probe batch of distinct random examples check both, at the
physical batch size training uses (at least `MIN_PROBE_ROWS`: a layer may
mix examples only in batches of some size, e.g. from 4 rows on):

- Variable reads. Every layer call runs under its own
  `tf.GradientTape(watch_accessed_variables=True)`, with the enclosing call's
  tape paused, so each call's tape holds the variables that call reads
  itself. A trainable variable read by a layer that does not own it (tied
  embeddings, a kernel shared through a custom layer), or read by the model
  outside any layer, is a *foreign read*: the tapped methods would miss that
  use of it.
- Examples mixing, every row. A pass on the probe batch is compared with
  passes in which a set S of rows is replaced by other values: a layer
  whose outputs in the rows outside S change while its inputs there did
  not lets a row depend on another (e.g. subtracts the batch mean, or adds
  row j into row i). The sets come from `changed_row_sets`: for every
  ordered pair of rows (i, j), some set holds j and not i, so a dependence
  of any row on any other row is tested, with m + 1 passes per trial where
  C(m, m/2) >= rows (12 at 256 rows), and one more pass that repeats the
  first, to tell random draws from mixing.
- Inputs like the data's. A layer may mix only for some values (only when
  every input is >= 0, as [0, 1] images are; only when a value exceeds 200,
  as 0-255 pixels do). Each trial draws its batch from one of
  `probe_value_ranges`: for real-valued inputs the standard normal and the
  typical ranges of image data (`FLOAT_RANGES`), with one row at the
  range's low end and one at its high end, plus any public range the route
  knows (the trainer's preprocessing); for uint8 inputs 0..255; for other
  integer inputs valid ids of the model's embeddings. These are public
  facts about the dtype, never values measured on the private data.
- Randomness held fixed. Before each pass the model's random state is
  restored (`RandomState`: its non-trainable variables, which hold the
  Keras seed generators' states, every `tf.random.Generator` the model's
  layers hold, the global generators of TensorFlow and Keras, numpy's and
  Python's), so that
  dropout, augmentation and noise draw alike in every pass of a trial; a
  pass that draws other random values even so (TensorFlow's random ops
  without a generator) is traced anew with a fixed graph seed, another in
  each trial. A model that draws from generators in training is probed in
  `RANDOM_TRIALS` trials, each from its own random state, so that mixing
  that happens only on some draws (with probability 1/2, say) is seen in
  one of them; with TensorFlow's random ops, whose passes are each traced
  anew, in one trial per value range. Randomness the probe cannot hold
  fixed makes it compare inference passes.
- Each layer call's inputs and outputs are kept only as a digest of every
  row's values (its largest magnitude and signed sums of `DIGEST_CHUNK`
  values). The passes run as a graph (a `tf.function`), so the probe needs
  about the memory of an inference pass, well below a training step's.
- State written from data. A non-trainable variable (other than a Keras
  seed generator's) that a training pass changes, to a value that depends
  on the batch, would carry private data out of training without noise
  (a running mean, a BatchNorm subclass updating its statistics): it is
  reported by the layer and variable that hold it.

The probe batches come from `probe_batches`, the random state from
`random_state`, and each pass's record of layer calls from `layer_trace`.
Results are cached per model, input signature, rows, value ranges and set of
trainable variables.
"""

import dataclasses
import random
import threading
import weakref

import numpy as np
import tensorflow as tf

from tfdp.dp import layer_taps
from tfdp.dp.layer_trace import DIGEST_CHUNK  # noqa: F401  (public here too)
from tfdp.dp.layer_trace import TOLERANCE
from tfdp.dp.layer_trace import Digester
from tfdp.dp.layer_trace import digests_same
from tfdp.dp.layer_trace import traced_forward
from tfdp.dp.layer_trace import variable_id
from tfdp.dp.probe_batches import FLOAT_RANGES  # noqa: F401  (public here too)
from tfdp.dp.probe_batches import changed_row_sets
from tfdp.dp.probe_batches import probe_inputs
from tfdp.dp.probe_batches import probe_value_ranges
from tfdp.dp.random_state import RandomState
from tfdp.dp.random_state import generators  # noqa: F401  (public here too)

# The fewest rows a probe batch has, whatever the batch size: a layer that
# mixes examples only from some batch size on must be probed at that size.
MIN_PROBE_ROWS = 4
# Trials, each from its own random state, for a model that draws random values
# in training: mixing that happens on a fraction p of the draws is missed with
# probability (1 - p) ** RANDOM_TRIALS (1/4096 for p = 1/2).
RANDOM_TRIALS = 12
_lock = threading.RLock()
_cache = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class ForeignRead:
    """A trainable variable read by a layer call other than its owner's."""

    reader: str
    variable: str
    owner: str


@dataclasses.dataclass
class StateWrite:
    """A non-trainable variable that a training pass sets from the batch."""

    layer: str
    variable: str


@dataclasses.dataclass
class ProbeReport:
    """What `probe` found.

    Attributes:
        foreign_reads: list of `ForeignRead`.
        mixing_layer: str or None. The first layer (or the model) whose outputs
            for one example depend on other examples.
        state_writes: list of `StateWrite`. Non-trainable variables that a
            training pass changes to a value that depends on the batch.
    """

    foreign_reads: list
    mixing_layer: str = None
    state_writes: list = dataclasses.field(default_factory=list)

    def refuse_state_writes(self):
        """Raises when a training pass writes state computed from the batch."""
        if not self.state_writes:
            return
        write = self.state_writes[0]
        others = len(self.state_writes) - 1
        more = f" (and {others} more variable{'s' if others > 1 else ''})" if others else ""
        raise ValueError(
            f"Layer '{write.layer}' writes variable '{write.variable}'{more} from the "
            "batch during training (e.g. a running mean, or batch statistics). That "
            "value would leave training without noise, in the model and its "
            "checkpoints, and no epsilon covers it. Keep the state out of training "
            "(compute it before, from public data, or freeze the layer in inference "
            "mode) or make it a trainable weight. "
            f"Received: layer={write.layer!r}, variable={write.variable!r}"
        )

    def refuse_mixing(self):
        """Raises when a layer mixes examples: no method can bound it."""
        if self.mixing_layer is None:
            return
        raise ValueError(
            f"Layer '{self.mixing_layer}' mixes examples: its outputs for one example "
            "change when another example of the batch changes (e.g. batch "
            "statistics). Per-example gradients, and hence the clipping bound, "
            "are undefined. Make the layer per-example (e.g. GroupNormalization "
            "or LayerNormalization instead of batch statistics). "
            f"Received: layer={self.mixing_layer!r}"
        )

    def refuse_foreign_reads(self, method):
        """Raises when a tapped `method` would miss a use of a variable."""
        if not self.foreign_reads:
            return
        read = self.foreign_reads[0]
        raise ValueError(
            f"Layer '{read.reader}' reads variable '{read.variable}', owned by layer "
            f"'{read.owner}' (e.g. tied weights). method={method!r} clips per layer "
            "and sees only the owner's use of it, so per-example norms would be too "
            "small. Use method='vectorized' or 'naive' (method='auto' does), or give "
            f"'{read.reader}' its own variable. Received: method={method!r}"
        )


def probe(model, x=None, rows=None, ranges=None):
    """Probes `model` (cached); None when no input signature is known.

    Args:
        model: keras.Model. A built model.
        x: optional tensor. A batch (possibly symbolic): its per-example
            shape and dtype define the probe input, and its static batch
            size the rows. Defaults to the model's declared input.
        rows: int or None. The probe batch's rows: the physical batch size
            of training. Defaults to `x`'s static batch size; at least
            `MIN_PROBE_ROWS` either way.
        ranges: sequence of `(low, high)` or None. Public ranges of the
            input values that the route knows (e.g. the trainer's
            preprocessing), each bound a float or one per channel, probed
            besides `probe_value_ranges`' own. Defaults to None: a cached
            report serves whatever ranges it probed.

    Returns:
        A `ProbeReport`, or None.
    """
    signature = _signature(model, x)
    if signature is None:
        return None
    if rows is None and x is not None and x.shape.rank and x.shape[0] is not None:
        rows = int(x.shape[0])
    rows = max(MIN_PROBE_ROWS, int(rows or 0))
    key = (signature, rows, tuple(id(v) for v in model.trainable_variables))
    probed = probe_value_ranges(signature[1], ranges or ())
    with _lock:
        cached = _cache.get(model)
        # A report serves any request whose value ranges it probed.
        if cached is not None and cached[0] == key and (
                ranges is None or all(r in cached[1] for r in probed)):
            return cached[2]
        report = run_eagerly(_probe, model, *signature, rows, probed)
        _cache[model] = (key, probed, report)
        return report


def run_eagerly(fn, *args):
    """`fn(*args)`, eagerly, also while a function is being traced.

    While tracing, in a fresh thread: `tf.init_scope` would also pause
    gradient tapes on this thread, and the probes need their own tapes.
    """
    if tf.executing_eagerly():
        return fn(*args)
    return _eagerly(fn, *args)


def _eagerly(fn, *args):
    """Runs `fn` eagerly while a function is being traced on this thread.

    In a fresh thread: `tf.init_scope` would also pause gradient tapes on
    this thread, and the probe needs its own tapes to record variable reads.
    """
    result = {}

    def run():
        try:
            result["value"] = fn(*args)
        except Exception as e:  # Re-raised on the calling thread.
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _signature(model, x):
    if x is not None:
        shape, dtype = x.shape[1:], x.dtype
    else:
        try:
            inputs = model.inputs
        except (AttributeError, ValueError):
            return None
        if not inputs or len(inputs) != 1:
            return None
        shape, dtype = inputs[0].shape[1:], inputs[0].dtype
    shape = tuple(8 if d is None else int(d) for d in shape)
    return shape, tf.as_dtype(dtype).name


# Eager Python throughout: AutoGraph, which converts what a traced train step
# calls, would turn its float() and comparisons into graph ops.
@tf.autograph.experimental.do_not_convert
def _probe(model, shape, dtype, rows, value_ranges):
    batches = [probe_inputs(model, shape, dtype, rows, value_range=value_range)
               for value_range in value_ranges]
    randomness = RandomState(model)
    digest = Digester(rows)
    traced = {}  # training -> the `LayerTrace` of its latest tracing (layers, reads).
    graph_seed = None  # With a fixed seed: the trial's graph seed.

    def forward(inputs, training):
        if graph_seed is not None:
            # The graph's own seed (not the global one): ops without a seed
            # get the same seeds in every tracing, so each pass draws alike.
            tf.random.set_seed(graph_seed)
        trace = traced_forward(model, inputs, training, digest)
        traced[training] = trace
        return [(d_in, d_out) for _, d_in, d_out in trace.calls], trace.outputs

    # The passes run as a graph, not as eager ops: an eager pass of a Keras
    # model holds every layer's output until its end (ResNet-50-GN, 224 px,
    # 40 rows: +4.8 GB eagerly, +0.36 GB as a graph). The variable reads are
    # those of the tracing; the digests are the graph's outputs.
    graph = tf.function(forward, autograph=False)

    def run(inputs, training, start):
        """One pass from the random state `start`; its trace and written values."""
        randomness.restore(start)
        # With a fixed seed each pass is traced anew: a traced random op
        # draws new values at every call.
        fn = tf.function(forward, autograph=False) if graph_seed is not None else graph
        digests, outputs = fn(inputs, training)
        after = {id(v): v.numpy() for v in written}
        return traced[training].with_values(digests, outputs), after

    written = []
    start = randomness.initial
    x, other = batches[0]
    first, _ = run(x, True, start)
    # Variables the training pass changed (seed generators' states among
    # them), and their values after it.
    values = start[0]
    written = [v for v in randomness.variables
               if v.shape == values[id(v)].shape and not np.array_equal(v.numpy(), values[id(v)])]
    first_state = {id(v): v.numpy() for v in written}
    training = True
    for attempt in range(2):
        if _same(first, run(x, training, start)[0], np.ones([rows], bool)):
            break
        if attempt == 0:
            graph_seed = 0  # Random draws outside the state `RandomState` restores.
        else:
            training = False  # Random even so: compare inference passes.
        first, first_state = run(x, training, start)
    # A pass that moves a generator's state draws random values: other draws
    # may mix where these did not. (With a fixed graph seed each pass is
    # traced anew, which costs more than the pass: one trial per range.)
    draws = training and graph_seed is None and any(
        id(v) in randomness.random_ids for v in written)
    trials = max(len(batches), RANDOM_TRIALS if draws else 1)
    mixing, moved = None, set()
    for trial in range(trials):
        x, other = batches[trial % len(batches)]
        if trial:
            graph_seed = trial if graph_seed is not None else None
            first, first_state = run(x, training, start)
        # The next trial starts from the random state this pass left.
        following = ({**start[0], **first_state}, np.random.get_state(), random.getstate())
        for changed in changed_row_sets(rows):
            mask = tf.constant(changed.reshape((rows,) + (1,) * len(shape)))
            result, result_state = run(tf.where(mask, other, x), training, start)
            if mixing is None:
                mixing = _mixing_layer(model, first, result, ~changed)
                if mixing is not None and trial and not _same(
                        first, run(x, training, start)[0], np.ones([rows], bool)):
                    mixing = None  # This trial's draws are not held fixed: no evidence.
            moved.update(i for i, value in result_state.items()
                         if not np.array_equal(value, first_state[i]))
        if mixing is not None:
            break
        start = following
    randomness.restore()
    writes = [StateWrite(_owner_name(model, v), v.path) for v in written
              if id(v) in moved and id(v) not in randomness.random_ids]
    return ProbeReport(_foreign_reads(model, first), mixing, writes)


def _owner_name(model, variable):
    """The name of the innermost layer holding `variable` (or the model's)."""
    found = model.name
    # Parents come before their sublayers: the last layer holding it is the
    # innermost.
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if any(v is variable for v in layer.weights):
            found = layer.name
    return found


def _foreign_reads(model, trace):
    trainable = {variable_id(v) for v in model.trainable_variables}
    owner = {}
    for layer in layer_taps.tapped_layers(model):
        for v in layer_taps.own_trainable_variables(layer):
            owner[variable_id(v)] = (layer, v)
    found = []
    readers = [(layer, trace.reads.get(id(layer), set())) for layer, _, _ in trace.calls]
    readers.append((model, trace.model_reads))
    seen = set()
    for reader, reads in readers:
        for vid in reads:
            if vid not in trainable or (id(reader), vid) in seen:
                continue
            seen.add((id(reader), vid))
            own_layer, variable = owner.get(vid, (None, None))
            if own_layer is reader:
                continue
            found.append(ForeignRead(
                reader.name,
                variable.path if variable is not None else str(vid),
                own_layer.name if own_layer is not None else "no layer",
            ))
    return found


def _kept_rows(t, kept):
    """The `kept` rows of a batch-first tensor as float64, or None."""
    rows = len(kept)
    if not isinstance(t, (tf.Tensor, tf.Variable)) or t.shape.rank in (None, 0):
        return None
    if t.shape[0] != rows or t.dtype in (tf.string, tf.bool):
        return None
    return tf.cast(t, tf.float64).numpy()[kept]


def _same(a_trace, b_trace, kept):
    return nest_rows_same(a_trace.outputs, b_trace.outputs, kept)


def nest_rows_same(a, b, kept, tolerance=TOLERANCE):
    """Whether two nests of batch-first tensors agree on the `kept` rows.

    Args:
        a: nest of tensors. The reference (its scale sets the tolerance).
        b: nest of tensors. The same structure.
        kept: bool array `[rows]`. The rows compared; tensors of another
            batch size, scalars and strings are skipped.
        tolerance: float. Relative to `a`'s largest magnitude on those rows.
            Defaults to `TOLERANCE`.

    Returns:
        bool.
    """
    flat_a, flat_b = tf.nest.flatten(a), tf.nest.flatten(b)
    if len(flat_a) != len(flat_b):
        return False
    for u, w in zip(flat_a, flat_b):
        ru, rw = _kept_rows(u, kept), _kept_rows(w, kept)
        if ru is None or rw is None:
            continue
        scale = max(float(np.max(np.abs(ru), initial=0.0)), 1e-6)
        if ru.shape != rw.shape or float(np.max(np.abs(ru - rw), initial=0.0)) > tolerance * scale:
            return False
    return True


def _mixing_layer(model, first, other, kept):
    """The first layer whose outputs in the `kept` rows changed with same inputs."""
    if len(first.calls) == len(other.calls):
        for (layer, x_a, y_a), (_, x_b, y_b) in zip(first.calls, other.calls):
            if digests_same(x_a, x_b, kept) and not digests_same(y_a, y_b, kept):
                return layer.name
    if not _same(first, other, kept):
        return model.name
    return None
