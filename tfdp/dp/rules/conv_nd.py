"""Rule for Keras's other convolutions: Conv1D (causal too), Conv3D, grouped Conv2D.

Keyed on Keras's base conv class, so it takes every `BaseConv` layer that the
`conv2d` rule (ungrouped, channels-last Conv2D, with ghost norms) does not.
Each example's kernel gradient is instantiated by one conv backprop per
example (its k rows summed), in a `tf.map_fn`, with no unfolded input: the
same arithmetic as U_iᵀ G_i for every rank, groups, strides, dilations and
padding. No ghost route is implemented for these layers, so the plan shows
them as instantiated whatever 2T² < p·D says; their per-example gradients
are the kernel's size per example.
"""

import keras
from keras.src.layers.convolutional import base_conv
import tensorflow as tf

from tfdp.dp import layer_taps
from tfdp.dp.rules import generic
from tfdp.dp.rules import registry

_CALLS = (base_conv.BaseConv.call, keras.layers.Conv1D.call)


def conv_padding(layer):
    """The padding of the layer's conv op: causal padding is applied to the input first."""
    return "valid" if layer.padding == "causal" else layer.padding


def conv(layer, inputs, kernel):
    """The layer's conv op, on inputs already causally padded."""
    return keras.ops.conv(
        inputs, kernel, strides=list(layer.strides), padding=conv_padding(layer),
        dilation_rate=layer.dilation_rate, data_format="channels_last",
    )


@registry.register_rule(base_conv.BaseConv)
class ConvRule(generic.InstantiatingRule):
    """Per-example kernel and bias gradients of any channels-last Keras conv."""

    name = "conv"
    why = "no ghost route: per example"

    def applies(self, layer):
        return (
            type(layer).call in _CALLS
            and type(layer).convolution_op is base_conv.BaseConv.convolution_op
            and layer.data_format == "channels_last"
            and registry.is_plain(layer)
        )

    def decays(self, layer, variable):
        return variable is layer.kernel

    def tapped_call(self, layer, original):
        def call(inputs, *args, **kwargs):
            recorder = layer_taps.active_recorder()
            if recorder is None or recorder.mode != "record":
                return original(inputs, *args, **kwargs)
            x = inputs
            if layer.padding == "causal":
                x = keras.ops.pad(inputs, layer._compute_causal_padding())
            pre = conv(layer, x, layer.kernel)
            if layer.use_bias:
                pre = pre + layer.bias
            # The recorded input is the conv op's: causally padded.
            pre = recorder.record(layer_taps.TapRecord(layer, x, pre))
            return layer.activation(pre) if layer.activation is not None else pre

        return call

    def per_example_grads(self, layer, records, output_grads, variables):
        kernel_shape = layer.kernel.shape
        total_kernel, total_bias = None, None
        for record, grad in zip(records, output_grads):
            x, g = tf.cast(record.inputs, tf.float32), tf.cast(grad, tf.float32)
            zeros = tf.zeros(kernel_shape, tf.float32)

            def one_row(pair, zeros=zeros):
                x_i, g_i = pair
                with tf.GradientTape() as tape:
                    tape.watch(zeros)
                    y = conv(layer, x_i[None], zeros)
                return tape.gradient(y, zeros, output_gradients=g_i[None])

            # parallel_iterations bounds how many rows' work is in flight at once.
            kernel = tf.map_fn(one_row, (x, g), fn_output_signature=tf.float32,
                               parallel_iterations=4)
            bias = tf.reduce_sum(tf.reshape(g, [tf.shape(g)[0], -1, g.shape[-1]]), 1)
            total_kernel = kernel if total_kernel is None else total_kernel + kernel
            total_bias = bias if total_bias is None else total_bias + bias
        return [total_kernel if v is layer.kernel else total_bias for v in variables]
