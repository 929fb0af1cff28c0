"""Rule for `keras.layers.Conv2D` (channels-last, ungrouped, valid/same padding)."""

import keras

from tfdp.dp import layer_grads
from tfdp.dp import layer_taps
from tfdp.dp.rules import linear
from tfdp.dp.rules import registry

_BASE_CALL = keras.layers.Conv2D.call
_BASE_OP = keras.layers.Conv2D.convolution_op


@registry.register_rule(keras.layers.Conv2D)
class Conv2DRule(linear.LinearRule):
    """U_i: the unfolded input patches; ghost norms may use the pixel Gram."""

    name = "conv2d"

    def applies(self, layer):
        return (
            type(layer).call is _BASE_CALL
            and type(layer).convolution_op is _BASE_OP
            and layer.data_format == "channels_last"
            and layer.groups == 1
            and layer.padding in ("valid", "same")
            and registry.is_plain(layer)
        )

    def tapped_call(self, layer, original):
        def call(inputs, *args, **kwargs):
            recorder = layer_taps.active_recorder()
            if recorder is None:
                return original(inputs, *args, **kwargs)
            if recorder.mode == "vectorized":
                pre = layer_taps.vectorizable_conv(layer, inputs, layer.kernel)
            else:
                pre = layer.convolution_op(inputs, layer.kernel)
            if layer.use_bias:
                pre = pre + layer.bias
            if recorder.mode == "record":
                pre = recorder.record(layer_taps.TapRecord(layer, inputs, pre))
            return layer.activation(pre) if layer.activation is not None else pre

        return call

    def ghost_geometry(self, layer, records):
        return layer_grads.pixel_gram_geometry(
            layer, [r.inputs.shape for r in records], [r.outputs.shape for r in records]
        )
