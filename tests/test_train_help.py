"""`python -m tfdp.train --help`: exit code 0, flags and the gin bindings."""

import subprocess
import sys

from tfdp import train


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
