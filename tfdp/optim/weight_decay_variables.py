"""Selecting the variables that weight decay applies to.

The list is the clipping rules' (`tfdp.dp.rules.weight_decay_variables`):
each rule says which of its layer's variables are decayed, so the engine's
in-loss decay and an optimizer's decoupled decay pick the same variables.
"""

import gin

from tfdp.dp import rules


@gin.configurable(module="tfdp.optim")
def weight_decay_variables(model, trainable_only=True):
    """Returns the conv and dense kernels of `model`, the weight-decay targets.

    The paper decays only convolution and dense kernels: biases and
    GroupNorm/LayerNorm `gamma`/`beta` are left alone. Subclasses count (e.g.
    `WSConv2D`, whose raw kernel is what gets decayed). Each layer's clipping
    rule decides (`tfdp.dp.rules.Rule.decays`), so a layer type added with
    its own rule says here too which of its variables are decayed.

    Args:
        model: keras.Model. The model; nested models are searched.
        trainable_only: bool. Leave out kernels of frozen layers: with the
            decay inside the loss they get no gradient anyway, and with
            decoupled decay a frozen layer must not move. Defaults to `True`.

    Returns:
        list of `keras.Variable`, in layer order, without duplicates (shared
        layers are listed once).
    """
    return rules.weight_decay_variables(model, trainable_only=trainable_only)
