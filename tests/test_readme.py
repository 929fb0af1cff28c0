"""The README as a newcomer follows it: its commands in order, its Python blocks as pasted.

Offline: the default data ships in a wheel, and the one command that names
data of the user's own (`folder:/data/xray`) is pointed at a small folder
written here.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest
import tensorflow as tf

from tests.data import image_files

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")

# Settings that make each command short without changing what it shows;
# they are appended, so the workdirs still differ exactly as the printed
# commands' bindings do.
SMALL = {
    "tfdp.train": ["--gin_param=OptimizationConfig.epochs = 0.1",
                   "--gin_param=RunConfig.eval_batch_size = 1000"],
    "tfdp.bench": ["--steps=1", "--warmup=1", "--methods=nonprivate,bk", "--jit_compile=off"],
    "tfdp.audit": ["--epochs=1", "--num_train=200", "--num_canaries=20", "--quiet"],
    "tfdp.tuning": ["--gin_param=OptimizationConfig.epochs = 0.1",
                    "--gin_param=RunConfig.eval_batch_size = 1000"],
}

# The environment steps of the two commands, run by `ReadmeInstallTest` as written.
ENVIRONMENT_STEPS = ("python3 -m venv", ". .venv/bin/activate")


def python_blocks(path):
    with open(path) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), re.M | re.S)


def commands(path):
    """The README's `python3 -m ...` commands in order: shell blocks and inline code."""
    with open(path) as f:
        text = f.read()
    found = []
    for match in re.finditer(r"^```bash\n(.*?)^```|`(python3 -m [^`]+)`", text, re.M | re.S):
        block = match[1] if match[1] is not None else match[2]
        for command in block.replace("\\\n", " ").split("&&"):
            command = " ".join(command.split())
            if (command and "pip install" not in command and "pytest" not in command
                    and not command.startswith(ENVIRONMENT_STEPS)):
                found.append(command)
    return found


def fenced_commands(path):
    """The README's fenced bash blocks, each as one shell line."""
    with open(path) as f:
        text = f.read()
    return [" ".join(block.replace("\\\n", " ").split())
            for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S)]


def readme_argv(command, folder):
    """The command as a subprocess' argv, with the small settings and offline data."""
    argv = shlex.split(command.replace("/data/xray", folder))
    assert argv[:2] == ["python3", "-m"], command
    module = argv[2]
    argv = [sys.executable, "-m", *argv[2:]]
    if "--help" in argv:
        return argv
    if "imagenet" in command:  # The README itself says: check it with --dry_run first.
        return argv + ["--dry_run"]
    return argv + SMALL.get(module, [])


class ReadmeTest(tf.test.TestCase):

    def test_commands_are_found(self):
        found = commands(README)
        self.assertEqual(found[0], "python3 -m tfdp.train")
        self.assertTrue(any("target_epsilon = 3.0" in c for c in found))
        self.assertTrue(any(c.startswith("python3 -m tfdp.privacy") for c in found))
        self.assertFalse(any("pip install" in c or "pytest" in c for c in found))

    @pytest.mark.slow  # Every command of the README, one after another (about 3 min on 2 cores).
    def test_every_command_runs_in_order_in_a_fresh_directory(self):
        cwd = self.create_tempdir().full_path
        folder = os.path.join(self.create_tempdir().full_path, "xray")
        image_files.write_folder(folder, {"a": 200, "b": 200})  # N = 288 >= B = 256.
        # The checkout's tfdp, whatever is installed.
        root = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                   PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        for command in commands(README):
            with self.subTest(command=command):
                result = subprocess.run(readme_argv(command, folder), cwd=cwd, env=env,
                                        capture_output=True, text=True, timeout=900)
                self.assertEqual(result.returncode, 0,
                                 f"{command}\n{result.stdout[-1500:]}\n{result.stderr[-1500:]}")
                self.assertNotIn("Traceback", result.stderr)
        # Each trainer command got a workdir of its own, named without '=' or ','.
        workdirs = os.listdir(os.path.join(cwd, "workdir"))
        trained = [c for c in commands(README)
                   if c.startswith("python3 -m tfdp.train") and "--help" not in c
                   and "imagenet" not in c]
        self.assertLen(workdirs, len(trained))
        self.assertFalse([w for w in workdirs if set("=, ") & set(w)])

    @pytest.mark.slow  # The Keras block trains three epochs (about 30 s).
    def test_every_python_block_runs(self):
        blocks = python_blocks(README)
        self.assertGreaterEqual(len(blocks), 2)
        for i, block in enumerate(blocks):
            with self.subTest(block=i):
                namespace = {"__name__": f"readme_block_{i}"}
                exec(compile(block, f"README.md python block {i}", "exec"), namespace)


class ReadmeInstallTest(tf.test.TestCase):
    """The first command as a newcomer types it: a fresh virtual environment, then the run."""

    def test_the_commands_make_and_use_a_virtual_environment(self):
        first, tests = fenced_commands(README)[:2]
        for command in (first, tests):
            self.assertTrue(command.startswith(
                "python3 -m venv .venv && . .venv/bin/activate && python3 -m pip install -e "),
                command)
        self.assertTrue(first.endswith("&& python3 -m tfdp.train"), first)
        self.assertTrue(tests.endswith("&& python3 -m pytest tests -q"), tests)

    @pytest.mark.slow  # A fresh virtual environment installs tfdp's dependencies (minutes).
    def test_the_first_command_runs_verbatim_in_a_fresh_copy(self):
        root = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
        copy = os.path.join(self.create_tempdir().full_path, "tfdp")
        files = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True,
                               check=True).stdout.decode().split("\0")
        for name in filter(None, files):
            target = os.path.join(copy, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.isfile(os.path.join(root, name)):
                with open(os.path.join(root, name), "rb") as src, open(target, "wb") as dst:
                    dst.write(src.read())
        first = fenced_commands(README)[0]
        # The run itself shortened as the other README tests shorten it.
        command = first + " " + " ".join(shlex.quote(a) for a in SMALL["tfdp.train"])
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        result = subprocess.run(["bash", "-c", command], cwd=copy, env=env,
                                capture_output=True, text=True, timeout=1500)
        self.assertEqual(result.returncode, 0, f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
        self.assertIn("final: test_accuracy=", result.stdout)
        self.assertTrue(os.path.exists(os.path.join(copy, ".venv", "bin", "python3")))
