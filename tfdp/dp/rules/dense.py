"""Rule for `keras.layers.Dense` with its own `call` (any input rank)."""

import keras
import tensorflow as tf

from tfdp.dp import layer_taps
from tfdp.dp.rules import linear
from tfdp.dp.rules import registry


@registry.register_rule(keras.layers.Dense)
class DenseRule(linear.LinearRule):
    """Ghost or instantiated norms of U_iᵀ G_i, U_i the [T, D] inputs of example i."""

    name = "dense"

    def applies(self, layer):
        return type(layer).call is keras.layers.Dense.call and registry.is_plain(layer)

    def tapped_call(self, layer, original):
        def call(inputs, *args, **kwargs):
            recorder = layer_taps.active_recorder()
            if recorder is None or recorder.mode != "record":
                return original(inputs, *args, **kwargs)
            # The pre-activation output is recorded: its gradient is G.
            pre = tf.matmul(inputs, layer.kernel) if inputs.shape.rank == 2 else (
                tf.tensordot(inputs, layer.kernel, axes=1)
            )
            if layer.bias is not None:
                pre = pre + layer.bias
            pre = recorder.record(layer_taps.TapRecord(layer, inputs, pre))
            return layer.activation(pre) if layer.activation is not None else pre

        return call
