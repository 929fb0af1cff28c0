"""The trainer's `ModelConfig.finetune`: what trains after `init_checkpoint`, and a run."""

import os

import gin
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import train as train_lib
from tfdp import training
from tfdp.data import DatasetInfo
from tfdp.training import model_setup

INFO = DatasetInfo(name="digits", num_classes=10, image_shape=(8, 8, 1))


def _small(num_classes, input_shape):
    return tfdp.models.small_convnet(num_classes, input_shape, filters=(4, 8), dense_units=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    keras.utils.set_random_seed(7)
    path = os.path.join(tmp_path_factory.mktemp("pretrained"), "public.keras")
    _small(10, (8, 8, 1)).save(path)
    return path


def _build(checkpoint, **changes):
    config = training.ModelConfig(model_fn=_small, init_checkpoint=checkpoint, **changes)
    return model_setup.build_model(tf.distribute.get_strategy(), INFO, config,
                                   mixed_precision=False, dry_run=False)


@pytest.mark.parametrize("mode, trains", [
    ("full", None),
    ("last_layer", ["head_dense/kernel", "head_dense/bias"]),
    ("bitfit", ["conv1/bias", "conv1_norm/beta", "conv2/bias", "conv2_norm/beta",
                "dense/bias", "head_dense/kernel", "head_dense/bias"]),
    ("lora", ["conv1/lora_kernel_a", "conv1/lora_kernel_b", "conv2/lora_kernel_a",
              "conv2/lora_kernel_b", "dense/lora_kernel_a", "dense/lora_kernel_b",
              "head_dense/kernel", "head_dense/bias"]),
])
def test_each_mode_trains_its_share_and_logs_it(checkpoint, mode, trains, capsys):
    model = _build(checkpoint, finetune=mode)
    names = [v.path for v in model.trainable_variables]
    if trains is None:
        assert len(names) == len(model.weights)
        assert "fine-tuning" not in capsys.readouterr().out
        return
    assert sorted(names) == sorted(trains)
    logged = capsys.readouterr().out
    count = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert f"fine-tuning: " in logged and f"{count:,} of {model.count_params():,}" in logged


def test_lora_rank_is_the_factors(checkpoint):
    model = _build(checkpoint, finetune="lora", lora_rank=3)
    assert model.get_layer("dense").lora_kernel_a.shape[-1] == 3
    default = _build(checkpoint, finetune="lora")
    assert default.get_layer("dense").lora_kernel_a.shape[-1] == (
        training.model_config.DEFAULT_LORA_RANK)


@pytest.mark.slow  # A whole trainer run: about 13 s.
def test_a_bitfit_run_keeps_the_frozen_kernels_bit_identical(checkpoint, tmp_path):
    gin.clear_config()
    train_lib.train(
        str(tmp_path), data_config=training.DataConfig(dataset="digits"),
        model_config=training.ModelConfig(model_fn=_small, init_checkpoint=checkpoint,
                                          finetune="bitfit"),
        privacy_config=training.PrivacyConfig(noise_multiplier=1.0),
        optimization_config=training.OptimizationConfig(epochs=1, logical_batch_size=128),
        run_config=training.RunConfig(export_model=True, write_html_report=False))
    trained = keras.models.load_model(os.path.join(tmp_path, "model.keras"), compile=False)
    source = keras.models.load_model(checkpoint, compile=False)
    for layer in ("conv1", "conv2", "dense"):
        np.testing.assert_array_equal(trained.get_layer(layer).kernel.numpy(),
                                      source.get_layer(layer).kernel.numpy())
        assert not np.array_equal(trained.get_layer(layer).bias.numpy(),
                                  source.get_layer(layer).bias.numpy())
