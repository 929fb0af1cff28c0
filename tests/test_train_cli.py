"""The trainer's command line: `--help` and the default workdir."""

import signal
import subprocess
import sys

import pytest

from tfdp import train
from tfdp import validation


def test_bindings_help_has_one_line_per_binding():
    lines = train.bindings_help().splitlines()
    names = [line.split()[0] for line in lines]
    assert "train.dataset" in names and "train.l2_norm_clip" in names
    assert "train.workdir" not in names  # A flag, not a binding.
    assert len(names) == len(set(names))
    assert all(len(line) <= 100 for line in lines)


def test_help_exits_0_and_lists_bindings_and_own_data_prefixes():
    result = subprocess.run([sys.executable, "-m", "tfdp.train", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--gin_file" in result.stdout
    assert "train.dataset (str)" in result.stdout
    assert "'folder:<dir>'" in result.stdout and "'npz:<file>'" in result.stdout


def test_default_workdir_differs_by_binding():
    assert train.default_workdir(["gin/mnist_default.gin"], []) == "workdir/mnist_default"
    tighter = train.default_workdir(["mnist_default.gin"], ["train.target_epsilon = 3.0"])
    assert tighter == "workdir/mnist_default-target_epsilon=3.0"
    own = train.default_workdir(["mnist_default.gin"], ["train.dataset = 'folder:/a b'"])
    assert own == "workdir/mnist_default-dataset=folder_a_b"
    long_a = train.default_workdir(["x.gin"], ["train.a = " + "1" * 100])
    long_b = train.default_workdir(["x.gin"], ["train.a = " + "1" * 99 + "2"])
    assert long_a != long_b and len(long_a) < 90


def test_configuration_error_leaves_no_workdir(tmp_path):
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "tfdp.train", "--gin_param=train.l2_norm_clip = -1",
         f"--workdir={workdir}"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: l2_norm_clip must be > 0")
    assert not workdir.exists()


def test_configuration_errors_come_before_tensorflow_is_imported(tmp_path):
    # `-X importtime` lists every module imported; tensorflow must not be one.
    for args, expected in (
            (["--gin_param=train.epoch = 3"],
             "error: Bad gin configuration in --gin_param: Configurable 'train' doesn't have a "
             "parameter named 'epoch'. Did you mean 'train.epochs'?"),
            (["--gin_param=train.l2_norm_clip = -1"], "error: l2_norm_clip must be > 0"),
            (["--gin_param=train.epochs = (3"], "error: Bad gin configuration in --gin_param"),
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
    good.write_text("train.epochs = 2\nresnet18.width = 3  # not imported yet: skipped\n")
    bad = tmp_path / "bad.gin"
    bad.write_text(f"include '{good}'\ntrain.datset = 'digits'\n")
    config.precheck([str(good)], ["train.dataset = 'digits'"])
    with pytest.raises(ValueError, match=r"bad\.gin: .*'datset'\. Did you mean 'train\.dataset'"):
        config.precheck([str(bad)], [])
    with pytest.raises(ValueError, match="Gin file not found.*'missing_include.gin'"):
        config.precheck([], ["include 'missing_include.gin'"])
    bad.write_text("include 'missing_include.gin'\n")
    with pytest.raises(ValueError, match="Gin include not found in .*bad.gin"):
        config.precheck([str(bad)], [])
    with pytest.raises(ValueError, match="delta must be"):
        config.precheck([str(good)], ["train.delta = 2.0"],
                        validators={"train.delta": validation.validate_delta})
    config.precheck([str(good)], [], validators={"train.delta": validation.validate_delta})


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

