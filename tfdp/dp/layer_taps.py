"""Taps on the layers that own trainable variables.

The fast clipping methods need, for every trainable layer, its input and the
gradient of the (summed, per-example) loss with respect to its pre-activation
output. Because examples never interact (the rules refuse BatchNorm in
training mode; `model_probe` refuses any other layer that mixes them), the gradient of the summed loss with respect
to example i's activations is example i's own gradient, so one batched
backward pass gives every per-example output gradient.

Each layer's `call` is patched once (instance attribute) by its per-layer rule
(`tfdp.dp.rules`) with a wrapper that is a pass-through unless a recorder is
active on the current thread. Thread-local
state keeps MirroredStrategy replicas, which trace in parallel threads, apart.
"""

import contextlib
import threading

import keras
import tensorflow as tf

_local = threading.local()


class TapRecord:
    """One call of a tapped layer: its input and its pre-activation output.

    `statistics` holds what a rule's tap saved from the forward pass for its
    per-example gradients (e.g. GroupNormalization's group means and inverse
    standard deviations), or None.
    """

    __slots__ = ("layer", "inputs", "outputs", "call_fn", "statistics")

    def __init__(self, layer, inputs, outputs, call_fn=None, statistics=None):
        self.layer = layer
        self.inputs = inputs
        self.outputs = outputs
        self.call_fn = call_fn
        self.statistics = statistics


class _Recorder:
    def __init__(self, mode, on_record=None):
        self.mode = mode
        self.records = []
        self.suspended = False
        self._on_record = on_record

    def record(self, record):
        """Stores one tapped call; returns the output the layer should pass on.

        With an `on_record` hook (see `recording`) the output is the hook's,
        e.g. the same value under a custom gradient.
        """
        self.records.append(record)
        if self._on_record is None:
            return record.outputs
        return self._on_record(record)


def active_recorder():
    """The recorder of this thread, or None when taps are off or suspended."""
    recorder = getattr(_local, "recorder", None)
    if recorder is None or recorder.suspended:
        return None
    return recorder


@contextlib.contextmanager
def recording(mode="record", on_record=None):
    """Activates taps on this thread; yields the recorder.

    Args:
        mode: str. "record" stores a `TapRecord` per tapped call;
            "vectorized" computes conv layers with a conv whose weight
            gradient `tf.vectorized_map` can vectorize. Defaults to "record".
        on_record: optional callable. `TapRecord -> output`, in "record" mode:
            what each tapped call returns in place of its recorded output
            (`TapRecord.outputs`). Defaults to None (the output unchanged).
    """
    previous = getattr(_local, "recorder", None)
    recorder = _Recorder(mode, on_record)
    _local.recorder = recorder
    try:
        yield recorder
    finally:
        _local.recorder = previous


@contextlib.contextmanager
def suspended():
    """Makes taps pass-through, e.g. while recomputing a layer per example."""
    recorder = getattr(_local, "recorder", None)
    if recorder is None:
        yield
        return
    was = recorder.suspended
    recorder.suspended = True
    try:
        yield
    finally:
        recorder.suspended = was


def own_trainable_variables(layer):
    """Trainable variables the layer owns directly, not those of sublayers."""
    if not layer.trainable:
        return []
    return [v for v in getattr(layer, "_trainable_variables", []) if v.trainable]


def own_variables(layer):
    """All variables the layer owns directly, trainable or not, not those of sublayers."""
    return (list(getattr(layer, "_trainable_variables", []))
            + list(getattr(layer, "_non_trainable_variables", [])))


_layer_checks = []


def add_layer_check(check):
    """Registers `check(layer)`, run by `tapped_layers` on every layer of a model.

    The rules registry (`tfdp.dp.rules`) registers the check that raises
    for a layer no method can clip (e.g. a BatchNormalization that can run
    on batch statistics), so that this module needs no layer types.
    """
    if check not in _layer_checks:
        _layer_checks.append(check)


def tapped_layers(model):
    """All layers (recursively) that directly own trainable variables.

    Raises:
        ValueError: from a registered check (`add_layer_check`), for a layer
            that no clipping method can handle, trainable or not.
    """
    found = []
    for layer in model._flatten_layers(include_self=True, recursive=True):
        for check in _layer_checks:
            check(layer)  # Even on layers without trainable variables.
        if own_trainable_variables(layer):
            found.append(layer)
    return found


def record_call(layer, original):
    """A `call` that records the layer's input, output and a way to recompute it.

    The default tap of a per-layer rule: the rule derives per-example
    gradients from the recorded call (`TapRecord.call_fn`).
    """

    def call(inputs, *args, **kwargs):
        recorder = active_recorder()
        outputs = original(inputs, *args, **kwargs)
        if recorder is not None and recorder.mode == "record":
            call_fn = lambda x: original(x, *args, **kwargs)  # noqa: E731
            outputs = recorder.record(TapRecord(layer, inputs, outputs, call_fn))
        return outputs

    return call
