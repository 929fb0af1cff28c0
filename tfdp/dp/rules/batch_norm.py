"""BatchNormalization: refused where it can use batch statistics, accepted frozen.

A BatchNormalization layer that trains normalizes each example with the
batch's statistics, so examples mix and per-example gradients are undefined.
A frozen one (`trainable=False`) runs in inference mode, as Keras 3 does for
non-trainable BatchNormalization even when called with `training=True`: it
is then an affine map per example with its moving statistics, γ and β
fixed, and owns no trainable variable to clip.
"""

import keras

from tfdp.dp.rules import registry


@registry.register_rule(keras.layers.BatchNormalization)
class BatchNormRule(registry.Rule):
    """Refuses a trainable BatchNormalization; a frozen one is an affine map."""

    name = "frozen_batch_norm"

    def check(self, layer):
        if layer.trainable:
            raise ValueError(
                f"Layer '{layer.name}' is a trainable BatchNormalization layer. Batch "
                "statistics mix examples, so per-example gradients (and hence DP) "
                "are undefined. Convert the model with "
                "`tfdp.models.replace_batchnorm(model, groups=32)`, or freeze the "
                "layer (`layer.trainable = False`: inference mode, an affine map per "
                f"example). Received: layer={layer.name!r}"
            )

    def note(self, layer):
        return ("frozen BatchNormalization: inference mode, an affine map per example "
                "(moving statistics, gamma and beta fixed); nothing to clip")
