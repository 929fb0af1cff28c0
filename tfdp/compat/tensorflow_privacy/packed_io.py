"""TF-Privacy models of several inputs or outputs, as one input and one output tensor.

tfdp's private route takes one input tensor and one output (its sampler,
duplicate hash, training probe and clipping engine all read rows of one
tensor). TF-Privacy's `DPModel` also trains Functional models with a dict
(or list) of inputs and of outputs, each output with its own loss and loss
weight. `PackedIO` packs such a model: the inputs are flattened per example
and concatenated into one float32 row, split back inside the model, and the
outputs are concatenated the same way. The loss of one example is TF-Privacy's
(and Keras') Σ_k w_k · loss_k(y_k, ŷ_k), so each example's whole weighted
loss is clipped as one, exactly as an unpacked model's would be.
"""

import math

import keras
import numpy as np
import tensorflow as tf


def _entries(structure):
    """`[(key, value)]` of a dict (Keras' sorted key order) or a list; None for one tensor."""
    if isinstance(structure, dict):
        return sorted(structure.items())
    if isinstance(structure, (list, tuple)):
        return list(enumerate(structure))
    return None


def _widths(entries):
    return [(key, tuple(tensor.shape[1:]), math.prod(tensor.shape[1:])) for key, tensor in entries]


class PackedIO:
    """The packing of a Functional model with several named inputs or outputs.

    Args:
        model: `keras.Model`. A Functional model whose `input` or `output` is
            a dict or a list of tensors of static per-example shapes.
    """

    def __init__(self, model):
        inputs, outputs = _entries(model.input), _entries(model.output)
        self.input_structure = type(model.input) if inputs is not None else None
        self.output_structure = type(model.output) if outputs is not None else None
        self.inputs = _widths(inputs or [(None, model.input)])
        self.outputs = _widths(outputs or [(None, model.output)])
        for key, shape, _ in self.inputs + self.outputs:
            if any(d is None for d in shape):
                raise ValueError(
                    "A private model of several inputs or outputs needs a static shape per "
                    f"example for each. Received: {key!r} of shape {shape}")
        self.model = model

    @staticmethod
    def needed(model):
        """Whether `model` has a dict or list of inputs or of outputs."""
        try:
            inputs, outputs = model.input, model.output
        except (AttributeError, ValueError):  # An unbuilt Sequential: one input, one output.
            return False
        return _entries(inputs) is not None or _entries(outputs) is not None

    def packed_model(self):
        """The model on one packed float32 row per example, giving one packed output row."""
        packed = keras.Input((sum(w for _, _, w in self.inputs),), name="packed_inputs")
        pieces = self._split(packed, self.inputs)
        structured = (pieces[0][1] if self.input_structure is None else
                      dict(pieces) if self.input_structure is dict else [p for _, p in pieces])
        outputs = self.model(structured)
        flat = [keras.ops.reshape(tensor, (-1, width)) for (_, _, width), (_, tensor) in
                zip(self.outputs, _entries(outputs) or [(None, outputs)])]
        output = flat[0] if len(flat) == 1 else keras.ops.concatenate(flat, axis=-1)
        return keras.Model(packed, output, name=f"{self.model.name}_packed")

    @staticmethod
    def _split(packed, entries):
        pieces, start = [], 0
        for key, shape, width in entries:
            pieces.append((key, keras.ops.reshape(packed[:, start:start + width], (-1, *shape))))
            start += width
        return pieces

    def _pack(self, values, entries, what):
        if values is None:
            return None
        structured = _entries(values)
        if (structured is None) != (entries[0][0] is None):
            raise ValueError(
                f"The model's {what} are {'one tensor' if entries[0][0] is None else 'several'}. "
                f"Received: {what} of type {type(values).__name__}")
        given = dict(structured) if structured is not None else {None: values}
        if set(given) != {key for key, _, _ in entries}:
            raise ValueError(
                f"The model's {what} are {[key for key, _, _ in entries]}. "
                f"Received: {sorted(given, key=str)}")
        rows = []
        for key, _, width in entries:
            value = np.asarray(given[key])
            if not np.issubdtype(value.dtype, np.number):
                raise ValueError(f"Packed {what} must be numbers. Received: {key!r} of "
                                 f"dtype {value.dtype}")
            rows.append(value.astype(np.float32).reshape(-1, width))
        return rows[0] if len(rows) == 1 else np.concatenate(rows, axis=-1)

    def pack_inputs(self, x):
        """The packed rows of the model's inputs (a dict or list, as the model's)."""
        return self._pack(x, self.inputs, "inputs")

    def pack_targets(self, y):
        """The packed rows of the targets (a dict or list, as the model's outputs)."""
        return self._pack(y, self.outputs, "outputs")

    def unpack_outputs(self, packed):
        """The packed predictions as the model's own dict or list of outputs."""
        pieces = self._split(packed, self.outputs)
        values = [np.asarray(p) for _, p in pieces]
        if self.output_structure is None:
            return values[0]
        if self.output_structure is dict:
            return {key: value for (key, _), value in zip(pieces, values)}
        return values

    def loss(self, loss, loss_weights=None):
        """The per-example loss on packed rows: Σ_k w_k · loss_k(y_k, ŷ_k)."""
        keys = [key for key, _, _ in self.outputs]
        losses = _by_output(loss, keys, "loss")
        weights = _by_output(loss_weights, keys, "loss_weights") if loss_weights else {}
        return PackedLoss([(key, keras.losses.get(losses[key]), float(weights.get(key, 1.0)))
                           for key in keys if losses.get(key) is not None], self.outputs)


def _by_output(values, keys, what):
    if isinstance(values, dict):
        return values
    if isinstance(values, (list, tuple)):
        if len(values) != len(keys):
            raise ValueError(f"One {what} per output. Received: {len(values)} for {len(keys)}")
        return dict(zip(keys, values))
    return {key: values for key in keys}


@keras.saving.register_keras_serializable(package="tfdp.compat")
class PackedLoss(keras.losses.Loss):
    """Σ_k w_k · loss_k(y_k, ŷ_k) per example, on packed targets and predictions.

    Args:
        terms: list of `(key, keras.losses.Loss, weight)`.
        outputs: the packing's `(key, shape, width)` of each output.
    """

    def __init__(self, terms, outputs, name="packed_loss"):
        super().__init__(name=name)
        self.terms = terms
        self.outputs = outputs

    def get_config(self):
        return {
            "name": self.name,
            "terms": [[key, keras.saving.serialize_keras_object(loss), weight]
                      for key, loss, weight in self.terms],
            "outputs": [[key, list(shape), width] for key, shape, width in self.outputs],
        }

    @classmethod
    def from_config(cls, config):
        terms = [(key, keras.saving.deserialize_keras_object(loss), weight)
                 for key, loss, weight in config["terms"]]
        outputs = [(key, tuple(shape), width) for key, shape, width in config["outputs"]]
        return cls(terms, outputs, name=config.get("name", "packed_loss"))

    def call(self, y_true, y_pred):
        true = dict(PackedIO._split(y_true, self.outputs))
        pred = dict(PackedIO._split(y_pred, self.outputs))
        total = 0.0
        for key, loss, weight in self.terms:
            values = tf.cast(loss.call(true[key], pred[key]), tf.float32)
            if values.shape.rank and values.shape.rank > 1:
                values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
            total += weight * values
        return total
