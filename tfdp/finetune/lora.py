"""LoRA: private fine-tuning of low-rank updates through Keras's `enable_lora`.

Hu et al. (2021, "LoRA: low-rank adaptation of large language models")
freeze a pretrained kernel W and train an update s·A·B of rank r; Yu et al.
(2022, "Differentially private fine-tuning of language models") train it
privately. Keras has the layers' side: `layer.enable_lora(rank)` freezes a
Dense, EinsumDense or convolution kernel and adds the factors A and B, with
s = lora_alpha / rank. `lora` enables it on a model's layers and freezes the
rest; the `lora` clipping rule (`tfdp.dp.rules.lora`) computes the factors'
per-example norms from the layer's rows, so that a LoRA layer costs the
clipping a few thousand floats per example rather than its kernel's size.
"""

import dataclasses

import keras
import numpy as np

from tfdp.dp import rules
from tfdp.finetune import heads as heads_lib

# Layers Keras can enable LoRA on and the `lora` rule has a route for.
LORA_LAYERS = (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Conv1D,
               keras.layers.Conv2D, keras.layers.Conv3D)


@dataclasses.dataclass
class LoraSummary:
    """What trains after `lora`.

    Attributes:
        rank: int. The rank r of the layers `lora` enabled.
        lora_alpha: float. Their α (scale s = α / r).
        trainable_params: int. Parameters that train.
        total_params: int. All the model's parameters (`model.count_params()`).
        trainable: list of str. The paths of the variables that train.
        adapted: list of str. The names of the layers with LoRA factors.
        head: list of str. The names of the head layers, which train whole.
    """

    rank: int
    lora_alpha: float
    trainable_params: int
    total_params: int
    trainable: list
    adapted: list
    head: list

    def __str__(self):
        share = self.trainable_params / max(self.total_params, 1)
        return (f"LoRA r={self.rank}: {self.trainable_params:,} of {self.total_params:,} "
                f"parameters train ({share:.2%}): factors on {len(self.adapted)} layers, the "
                f"head {', '.join(repr(h) for h in self.head)} whole")


def _check_rank(rank, lora_alpha):
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ValueError(f"lora needs a positive integer rank. Received: rank={rank!r}")
    if lora_alpha is not None and (
            isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float, np.number))
            or not lora_alpha > 0):
        raise ValueError(
            f"lora needs a positive lora_alpha (or None: the rank). "
            f"Received: lora_alpha={lora_alpha!r}")


def _restart_zero_factors(layer):
    """Re-initialises A where Keras left both factors zero (a loaded LoRA layer).

    Keras saves a LoRA layer's merged kernel and, on loading, zeroes A and B:
    with both zero, neither gets a gradient. A is drawn again as
    `enable_lora` draws it (he_uniform); with B zero the output is unchanged.
    """
    a, b = layer.lora_kernel_a, layer.lora_kernel_b
    if np.any(a.numpy()) or np.any(b.numpy()):
        return
    a.assign(keras.initializers.HeUniform()(a.shape, dtype=a.dtype))


def lora(model, rank, head=None, lora_alpha=None, train_offsets=False):
    """Enables LoRA on the model's Dense, EinsumDense and conv layers; freezes the rest.

    What trains afterwards:
    - the factors A and B of every Dense, EinsumDense (MultiHeadAttention's
      projections included) and Conv1D/2D/3D layer but the head, on which
      `lora` calls Keras's `layer.enable_lora(rank, lora_alpha)`. Keras
      freezes the layer's kernel; `lora` also freezes its bias;
    - the head, whole: by default the last Dense layer, or the layers named
      in `head` (no factors on them);
    - with `train_offsets=True`, also every bias and normalisation β, as
      `tfdp.finetune.bitfit` trains them.
    Everything else is frozen variable by variable (`variable.trainable =
    False`), so the layers stay trainable and `model.trainable_variables`
    lists exactly what trains. A layer frozen before the call (or all of
    whose variables are) gets no factors and stays frozen. A layer with
    LoRA already enabled keeps its factors, rank and α; where both factors
    are zero, as Keras leaves them after loading a saved LoRA model, A is
    drawn again so that training can move them.

    Call it after building (or loading) the model and before compiling it
    or making it private. Each LoRA layer's update is s·A·B with
    s = lora_alpha / rank; B starts at zero, so the model's outputs are
    unchanged by the call.

    Args:
        model: keras.Model. A built model.
        rank: int. The rank r of the factors, at least 1.
        head: optional layer, layer name, or list of either. The layers that
            train whole. Defaults to None (the last Dense layer).
        lora_alpha: float or None. α: the update is scaled by α / rank.
            Defaults to None (Keras's default, the rank: scale 1).
        train_offsets: bool. Also train the biases and normalisation βs.
            Defaults to False (LoRA's usual choice: the factors and the head).

    Returns:
        `LoraSummary`: what trains and how many parameters.

    Raises:
        ValueError: for a rank that is not a positive integer, a lora_alpha
            that is not positive, an unbuilt model, a model without a Dense
            layer and no `head`, a `head` that is not one of its layers or
            owns no variables, a head with LoRA already enabled, a layer with
            a kernel constraint (Keras refuses LoRA on it), or a model with no
            layer to adapt.
    """
    _check_rank(rank, lora_alpha)
    if not model.built:
        raise ValueError(
            "lora needs a built model (its variables exist once it is built). "
            f"Received: model={model.name!r} (not built)"
        )
    heads = heads_lib.heads_of(model, head, "lora")
    for layer in heads:
        if getattr(layer, "lora_enabled", False):
            raise ValueError(
                f"lora: the head layer {layer.name!r} has LoRA enabled, but the head "
                f"trains whole. Received: head={head!r}"
            )
    head_ids = {id(layer) for layer in heads}
    adapted = []
    for layer in heads_lib.all_layers(model):
        if id(layer) in head_ids or not isinstance(layer, LORA_LAYERS) or not layer.weights:
            continue
        if getattr(layer, "lora_enabled", False):
            if layer.trainable:
                _restart_zero_factors(layer)
                adapted.append(layer)
            continue
        if not layer.trainable or not any(v.trainable for v in layer.weights):
            continue  # Frozen before the call: stays so.
        if getattr(layer, "kernel_constraint", None) is not None:
            raise ValueError(
                f"lora: Keras cannot enable LoRA on layer {layer.name!r}, which has a kernel "
                "constraint. Pass it in `head`, freeze it, or remove the constraint. "
                f"Received: kernel_constraint={layer.kernel_constraint!r}"
            )
        layer.enable_lora(int(rank), lora_alpha=lora_alpha)
        adapted.append(layer)
    if not adapted:
        raise ValueError(
            "lora found no trainable Dense, EinsumDense or Conv layer besides the head. "
            f"Received: model={model.name!r}, head={[h.name for h in heads]!r}"
        )
    keep = [v for layer in adapted for v in (layer.lora_kernel_a, layer.lora_kernel_b)]
    if train_offsets:
        keep += [v for _, v in rules.offset_variables(model)]
    trainable = heads_lib.train_only(model, heads, keep)
    return LoraSummary(
        rank=int(rank),
        lora_alpha=float(rank if lora_alpha is None else lora_alpha),
        trainable_params=heads_lib.parameter_count(trainable),
        total_params=int(model.count_params()),
        trainable=[v.path for v in trainable],
        adapted=[layer.name for layer in adapted],
        head=[layer.name for layer in heads],
    )


def lora_layers(model):
    """The model's layers with LoRA enabled, in layer order."""
    return [layer for layer in heads_lib.all_layers(model)
            if getattr(layer, "lora_enabled", False)]


def merge_lora(model):
    """Folds each LoRA layer's update s·A·B into its frozen kernel, in place.

    The kernel becomes W + s·A·B and B zero; A is kept. The model's outputs
    are unchanged, and the factors are back at LoRA's starting point (B = 0),
    ready for another round of fine-tuning on the merged kernel. Keras
    itself merges on saving (`model.save`, `save_weights`), but keeps the
    factors in memory and zeroes both on loading; this is the in-memory
    merge, e.g. before evaluating or exporting without the extra matmuls'
    cost mattering, or to start a new round. Quantized layers are refused.

    Args:
        model: keras.Model. A built model.

    Returns:
        list of str: the names of the merged layers.

    Raises:
        ValueError: for a quantized LoRA layer, whose kernel cannot simply
            be assigned the merged value.
    """
    merged = []
    for layer in lora_layers(model):
        if getattr(layer, "quantization_mode", None) is not None:
            raise ValueError(
                f"merge_lora merges float kernels only; layer {layer.name!r} is quantized. "
                f"Received: quantization_mode={layer.quantization_mode!r}"
            )
        # Keras's kernel property is the merged W + s·A·B, in compute dtype.
        merged_kernel = keras.ops.convert_to_numpy(layer.kernel)
        base = _base_kernel(layer)
        base.assign(merged_kernel.astype(base.dtype))
        b = layer.lora_kernel_b
        b.assign(np.zeros(b.shape, b.dtype))
        merged.append(layer.name)
    return merged


def _base_kernel(layer):
    """The LoRA layer's frozen kernel variable (Keras's `layer.kernel` is merged)."""
    factors = (layer.lora_kernel_a, layer.lora_kernel_b)
    shape = tuple(layer.lora_kernel_a.shape[:-1]) + (layer.lora_kernel_b.shape[-1],)
    for variable in layer.weights:
        if (variable.path.endswith("kernel") and tuple(variable.shape) == shape
                and not any(variable is f for f in factors)):
            return variable
    raise ValueError(
        f"merge_lora found no kernel variable of shape {shape} in layer {layer.name!r}. "
        f"Received: weights={[v.path for v in layer.weights]!r}"
    )
