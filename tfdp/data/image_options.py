"""The model input of your own images: size, channels and preprocessing, from the options and the data."""

import tensorflow as tf

from tfdp.data import array_source
from tfdp.data import decode_guard
from tfdp.data import preprocessing as preprocessing_lib

PREPROCESSINGS = ("resize", "crop")


def first_image_shape(source):
    """`(height, width, channels)` of the first decodable image of a source.

    For sources that `image_check` does not scan (decoded arrays).
    """
    if not source.encoded:
        return tuple(source.images.shape[1:])

    def decode(image, seed):
        del seed
        return preprocessing_lib.decode(image, 0)

    # Reuses the pipelines' search for a decodable stand-in image.
    image = decode_guard.find_substitute(source.as_dataset(), decode)
    return tuple(int(d) for d in decode(image, None).shape)


def image_options(shape, encoded, image_size, channels):
    """`(size or None, channels)` of the model input, from the options and the data."""
    if channels is None:
        # Alpha channels are dropped: RGBA -> RGB, gray+alpha -> gray.
        channels = {1: 1, 2: 1, 3: 3, 4: 3}.get(shape[-1], 3)
    if channels not in (1, 3):
        raise ValueError(f"`channels` must be 1 or 3. Received: channels={channels}")
    if image_size is None and encoded:
        image_size = (shape[0], shape[1])  # Mixed sizes are resized to the first's.
    if image_size is not None and isinstance(image_size, int):
        image_size = (image_size, image_size)
    if not encoded and image_size is None and channels != shape[-1]:
        raise ValueError(
            "Arrays keep their channels unless resized; set load_dataset.image_size to "
            f"convert. Received: channels={channels}, image channels={shape[-1]}"
        )
    return (tuple(image_size) if image_size is not None else None), channels


def check_preprocessing(mode):
    """Refuses a `preprocessing` mode other than `PREPROCESSINGS`."""
    if mode not in PREPROCESSINGS:
        raise ValueError(
            f"`preprocessing` must be one of {PREPROCESSINGS}. Received: preprocessing={mode!r}"
        )


def own_preprocessing(mode, size, channels):
    """`(train_preprocess, eval_preprocess)` of your own images, or `(None, None)` for arrays kept as they are."""
    check_preprocessing(mode)
    if size is None:
        return None, None
    if mode == "resize":
        fn = preprocessing_lib.resize_preprocess(size, channels)
        return fn, fn
    if channels != 3 or size[0] != size[1]:
        raise ValueError(
            "preprocessing='crop' (random-resized crop and flip; center crop for evaluation) "
            "needs square RGB output. Received: "
            f"image_size={size}, channels={channels}"
        )
    return (
        preprocessing_lib.imagenet_train_preprocess(size[0], mean=None, std=None),
        preprocessing_lib.imagenet_eval_preprocess(size[0], mean=None, std=None),
    )


def decoded_once(source, info, mode, size):
    """`source` with its `info`; in-memory encoded images decoded and resized once.

    Only for deterministic preprocessing (`"resize"`): the pipelines then skip
    the per-step decode. Undecodable images were dropped before
    (`tfdp.data.undecodable`); should one fail here all the same, the source
    stays encoded, and the pipelines skip and count it.
    """
    source.info = info
    if not (mode == "resize" and size is not None and type(source) is array_source.ArraySource
            and source.encoded):
        return source
    resize = preprocessing_lib.resize_preprocess(size, info.image_shape[-1])

    def decode(image):
        return tf.cast(tf.round(resize(image) * 255.0), tf.uint8)

    decoded = array_source.decode_in_memory(source.images, info, decode)
    if decoded is source.images:
        return source
    return array_source.ArraySource(decoded, source.labels, info, user_ids=source.user_ids)
