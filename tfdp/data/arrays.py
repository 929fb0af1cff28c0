"""NumPy `.npz` files of images and labels, held in memory.

Keys (the Keras convention, as in `mnist.npz`): `x_train`, `y_train` and
optionally `x_test`, `y_test`; `images`, `labels` or `x`, `y` (what
`np.savez(f, x=..., y=...)` writes) are accepted for a file that holds the
training data only. Images are `[N, H, W]` (grayscale) or
`[N, H, W, C]`, uint8 in [0, 255] or float in [0, 1]. An optional `user_ids`
array (`[N]` integers) names the user who contributed each training
example: for user-level privacy (`PrivacyConfig.privacy_unit = 'user'`), and so
that held-out splits of the training data are made by user.
"""

import os

import numpy as np

from tfdp.data import array_source

_TRAIN_KEYS = (("x_train", "y_train"), ("images", "labels"), ("x", "y"))
_TEST_KEYS = ("x_test", "y_test")
_USER_KEY = "user_ids"


def _arrays(npz, image_key, label_key, path, user_key=None):
    images, labels = npz[image_key], npz[label_key]
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4:
        raise ValueError(
            f"`{image_key}` of an .npz must be [N, H, W] or [N, H, W, C] images. "
            f"Received: {image_key}.shape={images.shape} in {path}"
        )
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"`{label_key}` of an .npz must be a [N] integer array. Received: "
            f"{label_key}.shape={labels.shape}, dtype={labels.dtype} in {path}"
        )
    if np.issubdtype(images.dtype, np.floating):
        images = images.astype(np.float32, copy=False)
    user_ids = None
    if user_key is not None:
        user_ids = npz[user_key]
        if user_ids.shape != labels.shape or not np.issubdtype(user_ids.dtype, np.integer):
            raise ValueError(
                f"`{user_key}` of an .npz must be a [N] integer array, one user per example "
                f"of `{label_key}`. Received: {user_key}.shape={user_ids.shape}, "
                f"dtype={user_ids.dtype}, {label_key}.shape={labels.shape} in {path}"
            )
    return array_source.ArraySource(images, labels, user_ids=user_ids)


def load_npz(path):
    """Reads the training (and test) arrays of an `.npz` file.

    Args:
        path: str. The `.npz` file.

    Returns:
        `(train, test, notes)`: `ArraySource`s (`test` is `None` when the
        file has no `x_test`) and a description.
    """
    if not os.path.isfile(path):
        raise ValueError(f"The .npz file does not exist. Received: path={path!r}")
    with np.load(path, allow_pickle=False) as npz:
        keys = set(npz.files)
        train_keys = next((k for k in _TRAIN_KEYS if set(k) <= keys), None)
        if train_keys is None:
            raise ValueError(
                "An .npz needs the arrays x_train and y_train (or images and labels, or x "
                "and y). "
                f"Received: keys {sorted(keys)} in {path}"
            )
        train = _arrays(npz, *train_keys, path,
                        user_key=_USER_KEY if _USER_KEY in keys else None)
        test = _arrays(npz, *_TEST_KEYS, path) if set(_TEST_KEYS) <= keys else None
    notes = f"{path}: arrays {'/'.join(train_keys)}" + (" and x_test/y_test" if test else "")
    if train.user_ids is not None:
        notes += f"; {len(np.unique(train.user_ids))} users ({_USER_KEY})"
    return train, test, notes
