"""2-D convolution with weight standardisation."""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfdp")
class WSConv2D(keras.layers.Conv2D):
    """`Conv2D` whose kernel is standardised before every convolution.

    Each output filter of the kernel is shifted to zero mean and scaled to
    unit variance over its `(kernel_h, kernel_w, in_channels)` entries, as in
    Qiao et al. 2019 and BiT (Kolesnikov et al. 2020). The stored variable is
    the raw kernel; the standardisation is part of the forward pass, so
    gradients flow through it. The layer owns exactly the variables of a plain
    `Conv2D` and uses them only inside its own `call`, so a DP engine that
    treats it as a generic layer sees its true per-example gradients.

    Args:
        filters: int. Number of output channels.
        kernel_size: int or tuple. Spatial size of the kernel.
        ws_epsilon: float. Added to the per-filter variance before the
            square root, for filters that are (close to) constant.
            Defaults to `1e-5`.
        **kwargs: Any other `keras.layers.Conv2D` argument.
    """

    def __init__(self, filters, kernel_size, ws_epsilon=1e-5, **kwargs):
        super().__init__(filters, kernel_size, **kwargs)
        if ws_epsilon <= 0:
            raise ValueError(
                "`ws_epsilon` must be positive. "
                f"Received: ws_epsilon={ws_epsilon}"
            )
        self.ws_epsilon = ws_epsilon

    def standardized_kernel(self, kernel=None):
        """Returns the standardised version of `kernel` (default: own kernel)."""
        kernel = self.kernel if kernel is None else kernel
        mean = ops.mean(kernel, axis=(0, 1, 2), keepdims=True)
        var = ops.var(kernel, axis=(0, 1, 2), keepdims=True)
        return (kernel - mean) * ops.rsqrt(var + self.ws_epsilon)

    def convolution_op(self, inputs, kernel):
        return super().convolution_op(inputs, self.standardized_kernel(kernel))

    def get_config(self):
        config = super().get_config()
        config["ws_epsilon"] = self.ws_epsilon
        return config
