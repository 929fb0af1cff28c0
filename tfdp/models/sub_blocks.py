"""Named sub-blocks of the tfdp ResNets, for freezing and inspection."""

SUB_BLOCKS = (
    "stem",
    "block_group1",
    "block_group2",
    "block_group3",
    "block_group4",
    "head",
)


def sub_block_layers(model, sub_block):
    """Returns the layers of `model` that belong to `sub_block`, in order.

    tfdp models prefix every layer name with its sub-block followed by an
    underscore (`stem_conv`, `block_group2_block1_conv1`, `head_dense`), so
    membership is decided by name alone; the input layer belongs to none.

    Args:
        model: keras.Model. A model built by a tfdp builder (or any model
            following the same naming scheme).
        sub_block: str. One of `SUB_BLOCKS` (`block_group5` and beyond are
            accepted too, for deeper custom models).

    Returns:
        list of `keras.layers.Layer`, possibly empty (e.g. `block_group4` of a
        three-group Wide ResNet).
    """
    if not isinstance(sub_block, str) or not sub_block:
        raise ValueError(
            f"`sub_block` must be a non-empty string. Received: sub_block={sub_block!r}"
        )
    prefix = sub_block + "_"
    return [layer for layer in model.layers if layer.name.startswith(prefix)]
