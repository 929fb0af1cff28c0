"""BiTFiT: private fine-tuning of the bias terms and the head alone.

Bu et al. (2022, "Differentially private bias-term fine-tuning of foundation
models") train only the biases of a pretrained model (and a new head): a
small fraction of the parameters, so less noise in total, and per-example
gradients that need no weight-gradient work, since a bias's per-example
gradient is the layer's output gradient summed over its positions. The
per-layer rules (`tfdp.dp.rules`) skip a frozen kernel's norm and sum.
"""

import dataclasses

from tfdp.dp import rules
from tfdp.finetune import heads as heads_lib


@dataclasses.dataclass
class BitFitSummary:
    """What trains after `bitfit`.

    Attributes:
        trainable_params: int. Parameters that train.
        total_params: int. All the model's parameters (`model.count_params()`).
        trainable: list of str. The paths of the variables that train.
        head: list of str. The names of the head layers, which train whole.
    """

    trainable_params: int
    total_params: int
    trainable: list
    head: list

    def __str__(self):
        share = self.trainable_params / max(self.total_params, 1)
        return (f"BiTFiT: {self.trainable_params:,} of {self.total_params:,} parameters "
                f"train ({share:.2%}): {len(self.trainable)} variables, the head "
                f"{', '.join(repr(h) for h in self.head)} whole, and the biases")


def bitfit(model, head=None):
    """Freezes all but the biases, the normalisation offsets and the head.

    What trains afterwards:
    - every bias and every normalisation β (GroupNormalization,
      LayerNormalization) of a trainable layer; each layer's clipping rule
      says which of its variables are offsets (`tfdp.dp.rules.offset_variables`).
      BatchNormalization stays frozen, β included: trained, it would
      normalise with batch statistics, which mixes examples;
    - the head, whole: by default the last Dense layer.
    Everything else is frozen variable by variable (`variable.trainable =
    False`), so the layers stay trainable and `model.trainable_variables`
    lists exactly what trains. A layer frozen before the call stays frozen:
    `bitfit` narrows what trains, except for the head, which it unfreezes.

    Call it after building (or loading) the model and before compiling it
    or making it private.

    Args:
        model: keras.Model. A built model.
        head: optional layer, layer name, or list of either. The layers that
            train whole. Defaults to None (the last Dense layer).

    Returns:
        `BitFitSummary`: what trains and how many parameters.

    Raises:
        ValueError: for an unbuilt model, a model without a Dense layer and
            no `head`, a `head` that is not one of its layers or owns no
            variables, or a model of which nothing would train.
    """
    if not model.built:
        raise ValueError(
            "bitfit needs a built model (its variables exist once it is built). "
            f"Received: model={model.name!r} (not built)"
        )
    heads = heads_lib.heads_of(model, head, "bitfit")
    trainable = heads_lib.train_only(model, heads,
                                     keep=[v for _, v in rules.offset_variables(model)])
    if not trainable:
        raise ValueError(
            "bitfit left nothing to train: the model has no trainable bias or "
            f"normalisation offset and its head trains nothing. Received: model={model.name!r}"
        )
    return BitFitSummary(
        trainable_params=heads_lib.parameter_count(trainable),
        total_params=int(model.count_params()),
        trainable=[v.path for v in trainable],
        head=[layer.name for layer in heads],
    )
