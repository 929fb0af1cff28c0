"""Per-example image preprocessing.

Training functions have the signature `fn(image, seed) -> image`, where
`seed` is an int64 `[2]` stateless seed (a pure function of the run seed,
the step and the position, so augmentations replay exactly on resume).
Evaluation functions have the signature `fn(image) -> image`.

`image` is either a decoded `[H, W, C]` tensor (uint8 in [0, 255] or float
in [0, 1]) or a scalar `tf.string` holding an encoded JPEG/PNG. Every
function returns float32 with a static shape, so examples of different
sizes (imagenet2012) can be batched.
"""

import gin
import tensorflow as tf

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# tfdp's own helpers are traced as written: tf.data converts every function
# it traces with autograph, at 20-50 ms each, and these need none of it.
@tf.autograph.experimental.do_not_convert
def to_float(image):
    """Scales uint8 images to float32 in [0, 1]; float images pass through."""
    if image.dtype == tf.uint8:
        return tf.cast(image, tf.float32) / 255.0
    return tf.cast(image, tf.float32)


@tf.autograph.experimental.do_not_convert
def decode(image, channels=3):
    """Decodes an encoded image; decoded images pass through."""
    if image.dtype != tf.string:
        return image
    return tf.io.decode_image(image, channels=channels, expand_animations=False)


def _normalize(image, mean, std):
    if mean is None:
        return image
    return (image - tf.constant(mean, tf.float32)) / tf.constant(std, tf.float32)


def _image_shape(image):
    """`[H, W, C]` of a decoded tensor or of the header of an encoded image."""
    if image.dtype == tf.string:
        # Only JPEG exposes its shape without a full decode.
        return tf.cond(
            tf.io.is_jpeg(image),
            lambda: tf.io.extract_jpeg_shape(image),
            lambda: tf.shape(tf.io.decode_image(image, channels=3, expand_animations=False)),
        )
    return tf.shape(image)


def _crop(image, offset_y, offset_x, height, width, channels):
    if image.dtype == tf.string:
        window = tf.stack([offset_y, offset_x, height, width])
        # decode_and_crop_jpeg decodes only the crop window; the fallback
        # covers the rare PNG in a dataset.
        return tf.cond(
            tf.io.is_jpeg(image),
            lambda: tf.io.decode_and_crop_jpeg(image, window, channels=channels),
            lambda: tf.image.crop_to_bounding_box(
                tf.io.decode_image(image, channels=channels, expand_animations=False),
                offset_y,
                offset_x,
                height,
                width,
            ),
        )
    return tf.image.crop_to_bounding_box(image, offset_y, offset_x, height, width)


def _center_crop_window(shape, size, crop_padding):
    height, width = shape[0], shape[1]
    side = tf.cast(
        size / (size + crop_padding) * tf.cast(tf.minimum(height, width), tf.float32), tf.int32
    )
    side = tf.maximum(side, 1)
    return (height - side + 1) // 2, (width - side + 1) // 2, side, side


def random_resized_crop(
    image, seed, size=224, area_range=(0.08, 1.0), aspect_ratio_range=(3 / 4, 4 / 3), channels=3
):
    """Inception random-resized crop, stateless.

    Samples a crop covering `area_range` of the image with aspect ratio in
    `aspect_ratio_range`; when no such crop is found in 10 attempts, falls
    back to a center crop (the ResNet reference behaviour).

    Args:
        image: tensor. Decoded `[H, W, C]` or encoded scalar string.
        seed: tensor. int64 `[2]` stateless seed.
        size: int. Output side length. Defaults to `224`.
        area_range: tuple. Range of the crop area fraction. Defaults to
            `(0.08, 1.0)`.
        aspect_ratio_range: tuple. Range of the crop aspect ratio. Defaults
            to `(3/4, 4/3)`.
        channels: int. Channels of the output. Defaults to `3`.

    Returns:
        float32 `[size, size, channels]` in [0, 1].
    """
    shape = _image_shape(image)
    begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape,
        bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], tf.float32, [1, 1, 4]),
        seed=seed,
        min_object_covered=0.0,
        aspect_ratio_range=aspect_ratio_range,
        area_range=area_range,
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    offset_y, offset_x = begin[0], begin[1]
    height, width = crop_size[0], crop_size[1]
    # After 10 failed attempts the sampler returns the whole image.
    failed = tf.logical_and(tf.equal(height, shape[0]), tf.equal(width, shape[1]))
    center = _center_crop_window(shape, size, 32)
    offset_y, offset_x, height, width = [
        tf.where(failed, c, r) for c, r in zip(center, (offset_y, offset_x, height, width))
    ]
    crop = _crop(image, offset_y, offset_x, height, width, channels)
    crop = tf.image.resize(to_float(crop), [size, size], method="bilinear", antialias=False)
    crop.set_shape([size, size, channels])
    return tf.clip_by_value(crop, 0.0, 1.0)


@gin.configurable(module="tfdp.data")
def imagenet_train_preprocess(size=224, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """Returns the ImageNet training preprocessing `fn(image, seed)`.

    Random-resized crop (area 0.08-1, aspect 3/4-4/3), random horizontal
    flip, resize to `size`, normalisation.

    Args:
        size: int. Output side length. Defaults to `224`.
        mean: tuple. Per-channel mean subtracted from [0, 1] pixels, or
            `None` to keep [0, 1]. Defaults to the ImageNet mean.
        std: tuple. Per-channel std. Defaults to the ImageNet std.
    """

    def preprocess(image, seed):
        crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
        image = random_resized_crop(image, crop_seed, size=size)
        image = tf.image.stateless_random_flip_left_right(image, flip_seed)
        return _normalize(image, mean, std)

    return preprocess


@gin.configurable(module="tfdp.data")
def imagenet_eval_preprocess(size=224, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """Returns the ImageNet evaluation preprocessing `fn(image)`.

    Resizes the shorter side to `256 * size / 224`, center-crops `size`,
    normalises.

    Args:
        size: int. Output side length. Defaults to `224`.
        mean: tuple. Per-channel mean, or `None` to keep [0, 1]. Defaults to
            the ImageNet mean.
        std: tuple. Per-channel std. Defaults to the ImageNet std.
    """
    resize_to = int(round(256 * size / 224))

    def preprocess(image):
        image = to_float(decode(image, 3))
        shape = tf.shape(image)
        height, width = tf.cast(shape[0], tf.float32), tf.cast(shape[1], tf.float32)
        scale = resize_to / tf.minimum(height, width)
        new_h = tf.maximum(tf.cast(tf.round(height * scale), tf.int32), size)
        new_w = tf.maximum(tf.cast(tf.round(width * scale), tf.int32), size)
        image = tf.image.resize(image, [new_h, new_w], method="bilinear", antialias=True)
        image = tf.image.crop_to_bounding_box(
            image, (new_h - size) // 2, (new_w - size) // 2, size, size
        )
        image.set_shape([size, size, 3])
        return _normalize(tf.clip_by_value(image, 0.0, 1.0), mean, std)

    return preprocess


@gin.configurable(module="tfdp.data")
def cifar_train_preprocess(padding=4, mean=None, std=None):
    """Returns the CIFAR training preprocessing `fn(image, seed)`.

    Zero-pads by `padding`, random-crops back to the original size, random
    horizontal flip.

    Args:
        padding: int. Pixels of zero padding per side. Defaults to `4`.
        mean: tuple, optional. Per-channel mean to subtract. Defaults to
            `None` (keep [0, 1]).
        std: tuple, optional. Per-channel std. Defaults to `None`.
    """

    def preprocess(image, seed):
        image = to_float(decode(image, 3))
        crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
        shape = tf.shape(image)
        padded = tf.pad(image, [[padding, padding], [padding, padding], [0, 0]])
        image = tf.image.stateless_random_crop(padded, shape, seed=crop_seed)
        image = tf.image.stateless_random_flip_left_right(image, flip_seed)
        return _normalize(image, mean, std)

    return preprocess


@gin.configurable(module="tfdp.data")
def cifar_eval_preprocess(mean=None, std=None):
    """Returns the CIFAR evaluation preprocessing `fn(image)`.

    Args:
        mean: tuple, optional. Per-channel mean to subtract. Defaults to
            `None` (keep [0, 1]).
        std: tuple, optional. Per-channel std. Defaults to `None`.
    """

    def preprocess(image):
        return _normalize(to_float(decode(image, 3)), mean, std)

    return preprocess


def default_train_preprocess(image, seed):
    """No augmentation: decode if needed and scale to float32 in [0, 1]."""
    del seed
    return to_float(decode(image, 3))


def default_eval_preprocess(image):
    """Decode if needed and scale to float32 in [0, 1]."""
    return to_float(decode(image, 3))


@gin.configurable(module="tfdp.data")
def resize_preprocess(size, channels=3):
    """Returns `fn(image)`: decode, scale to [0, 1] and resize to `size`.

    For images of mixed sizes and formats (JPEG, PNG, grayscale, RGBA):
    decoding converts to `channels` (RGBA loses its alpha, grayscale is
    repeated to RGB, RGB is converted to gray for `channels=1`), then a
    bilinear, antialiased resize gives one static shape. No augmentation,
    so the same function serves training and evaluation.

    Args:
        size: int or tuple. Output side, or `(height, width)`.
        channels: int. 1 or 3. Defaults to `3`.
    """
    height, width = (size, size) if isinstance(size, int) else tuple(size)

    def preprocess(image):
        image = to_float(decode(image, channels))
        image = tf.image.resize(image, [height, width], method="bilinear", antialias=True)
        image.set_shape([height, width, channels])
        return tf.clip_by_value(image, 0.0, 1.0)

    return preprocess
