"""Group normalization whose group moments are reduced channel by channel first."""

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tfdp")
class GroupNormalization(keras.layers.GroupNormalization):
    """`keras.layers.GroupNormalization`, with faster moments on CPU.

    Same arguments, variables, initialisers and config as Keras's layer, and
    the same outputs up to float rounding (the sums run in another order).
    Keras reduces each group of the grouped input [B, H, W, groups, C/groups]
    over three non-adjacent axes at once, which runs far below memory speed
    on CPU. Here each channel is first summed over all positions
    ([B, H·W, C] → [B, C]), then the channels of each group are added. The
    variance is the mean squared difference from the mean, as in
    `tf.nn.moments` (no E[x²] − E[x]² cancellation).

    Forward and backward together, on 2 CPU cores: the default run's first
    norm (batch 264, 14×14×16, 4 groups) 5.8–7.3 → 3.6–3.9 ms; a ResNet-18
    norm at 32 px (batch 32, 32×32×64, 32 groups) 19–20 → 9–10 ms.

    The DP engine's norm rule records the statistics `normalize` returns, so
    the per-example γ gradient does not recompute them. Only channels-last
    normalization (`axis=-1`) takes this route; other axes run Keras's code.

    Args:
        groups: int. Number of groups; must divide the channels.
        axis: int. The channel axis. Defaults to `-1`.
        epsilon: float. Added to the variance. Defaults to `1e-3`.
        **kwargs: Any other `keras.layers.GroupNormalization` argument.
    """

    @property
    def channels_last(self):
        """Whether `call` takes the faster route (the channel axis is the last one)."""
        ndim = getattr(self.input_spec, "ndim", None)
        return self.axis == -1 or (ndim is not None and self.axis == ndim - 1)

    def normalize(self, inputs):
        """The output, and each channel's group mean and 1/√(var + ε).

        Args:
            inputs: tensor [B, ..., C], channels last, at least rank 2.

        Returns:
            `(outputs, (mean, inv_std))`: the layer's output, like `call`'s,
            and the statistics as float32 (float64 for float64 inputs)
            tensors [B, 1, C], each channel holding its group's value.
        """
        dtype = tf.float64 if inputs.dtype == tf.float64 else tf.float32
        channels = int(inputs.shape[-1])
        per_group = channels // self.groups
        batch = tf.shape(inputs)[0]
        x = tf.reshape(tf.cast(inputs, dtype), [batch, -1, channels])
        count = tf.cast(tf.shape(x)[1] * per_group, dtype)

        def group_mean_per_channel(per_channel_sums):
            sums = tf.reduce_sum(
                tf.reshape(per_channel_sums, [batch, self.groups, per_group]), -1, keepdims=True
            )
            per_channel = tf.broadcast_to(sums / count, [batch, self.groups, per_group])
            return tf.reshape(per_channel, [batch, 1, channels])

        mean = group_mean_per_channel(tf.reduce_sum(x, 1))
        # As in `tf.nn.moments`: ∂/∂mean of the squared deviations is zero.
        deviations = tf.math.squared_difference(x, tf.stop_gradient(mean))
        inv_std = tf.math.rsqrt(group_mean_per_channel(tf.reduce_sum(deviations, 1)) + self.epsilon)
        scale = inv_std
        if self.scale:
            scale = scale * tf.cast(self.gamma, dtype)
        shift = -mean * scale
        if self.center:
            shift = shift + tf.cast(self.beta, dtype)
        outputs = tf.reshape(x * scale + shift, tf.shape(inputs))
        return tf.cast(outputs, self.compute_dtype), (mean, inv_std)

    def call(self, inputs):
        if not self.channels_last:
            return super().call(inputs)
        return self.normalize(inputs)[0]
