"""`load_dataset` options: honoured by the data they apply to, refused elsewhere."""

import pytest

from tfdp import data


def test_offline_data_is_resized_once_in_memory():
    splits = data.load_dataset("digits", image_size=16)
    assert tuple(splits.info.image_shape) == (16, 16, 1)
    assert splits.train.images.shape[1:] == (16, 16, 1)
    assert splits.test.images.shape[1:] == (16, 16, 1)
    assert 0.0 <= float(splits.train.images.min()) and float(splits.train.images.max()) <= 1.0
    assert "resized to 16x16" in splits.notes


@pytest.mark.parametrize("options, named", [
    ({"channels": 3}, "load_dataset.channels=3"),
    ({"preprocessing": "crop"}, "load_dataset.preprocessing='crop'"),
    ({"user_key": "user"}, "load_dataset.user_key='user'"),
    ({"test_fraction": 0.5}, "load_dataset.test_fraction=0.5"),
])
def test_an_option_the_offline_data_ignores_is_refused(options, named):
    with pytest.raises(ValueError, match="does not use") as raised:
        data.load_dataset("digits", **options)
    assert named in str(raised.value)


def test_image_size_on_a_tfds_dataset_is_refused():
    with pytest.raises(ValueError, match=r"load_dataset.image_size=64"):
        data.load_dataset("cifar10", image_size=64)
