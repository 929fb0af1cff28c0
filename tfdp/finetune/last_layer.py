"""The last layer alone: a frozen backbone and a head that trains whole.

With the backbone frozen, the per-example work is the head's: the per-layer
rules skip every frozen layer, and the backward pass stops at the head's
input. Where the backbone also has no state written from the data and runs
the same in training and inference mode, its features can be computed once
(`tfdp.finetune.cache_features`) and the head trained on them, which
releases the same thing faster (docs/FINETUNING.md).
"""

import dataclasses

from tfdp.finetune import heads as heads_lib


@dataclasses.dataclass
class LastLayerSummary:
    """What trains after `last_layer`.

    Attributes:
        trainable_params: int. Parameters that train.
        total_params: int. All the model's parameters (`model.count_params()`).
        trainable: list of str. The paths of the variables that train.
        head: list of str. The names of the head layers.
    """

    trainable_params: int
    total_params: int
    trainable: list
    head: list

    def __str__(self):
        share = self.trainable_params / max(self.total_params, 1)
        return (f"last layer: {self.trainable_params:,} of {self.total_params:,} parameters "
                f"train ({share:.2%}): the head {', '.join(repr(h) for h in self.head)}")


def last_layer(model, head=None):
    """Freezes every variable but the head's.

    Variable by variable (`variable.trainable = False`), as `bitfit` does,
    so that `model.trainable_variables` lists exactly the head's. Call it
    after building (or loading) the model and before compiling it or
    making it private.

    Args:
        model: keras.Model. A built model.
        head: optional layer, layer name, or list of either. The layers that
            train. Defaults to None (the last Dense layer).

    Returns:
        `LastLayerSummary`: what trains and how many parameters.

    Raises:
        ValueError: for an unbuilt model, a model without a Dense layer and
            no `head`, or a `head` that is not one of its layers or owns no
            variables.
    """
    if not model.built:
        raise ValueError(
            "last_layer needs a built model (its variables exist once it is built). "
            f"Received: model={model.name!r} (not built)")
    heads = heads_lib.heads_of(model, head, "last_layer")
    trainable = heads_lib.train_only(model, heads)
    return LastLayerSummary(
        trainable_params=heads_lib.parameter_count(trainable),
        total_params=int(model.count_params()),
        trainable=[v.path for v in trainable],
        head=[layer.name for layer in heads])
