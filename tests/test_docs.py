"""Every Python block of docs/ runs as pasted, each file's blocks in order in one namespace.

Blocks that list signatures rather than code to run are fenced as `text`, and
each `fit` runs one epoch.
The blocks run in a fresh working and home directory (DATA.md's worked
example writes `~/digits_png`), offline.
"""

import glob
import os
import re

import pytest
import tensorflow as tf

DOCS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "*.md")))


def python_blocks(path):
    with open(path) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), re.M | re.S)


def small(block):
    """The block on small settings: one epoch of each `fit` (the docs train 3 to 60)."""
    return re.sub(r"\bepochs=\d+", "epochs=1", block)


class DocsTest(tf.test.TestCase):

    def test_docs_have_python_blocks(self):
        with_blocks = [os.path.basename(p) for p in DOCS if python_blocks(p)]
        self.assertContainsSubset({"DATA.md", "KERAS.md", "PRIVACY.md", "MIGRATING.md"},
                                  with_blocks)

    @pytest.mark.slow  # KERAS.md and MIGRATING.md train small models for an epoch each.
    def test_every_python_block_runs(self):
        home = self.create_tempdir().full_path
        cwd = self.create_tempdir().full_path
        saved_home, saved_cwd = os.environ.get("HOME"), os.getcwd()
        os.environ["HOME"] = home
        os.chdir(cwd)
        try:
            for path in DOCS:
                namespace = {"__name__": "docs_" + os.path.basename(path)}
                for i, block in enumerate(python_blocks(path)):
                    with self.subTest(doc=os.path.basename(path), block=i):
                        name = f"{os.path.basename(path)} python block {i}"
                        exec(compile(small(block), name, "exec"), namespace)
        finally:
            os.chdir(saved_cwd)
            if saved_home is None:
                os.environ.pop("HOME")
            else:
                os.environ["HOME"] = saved_home


def test_every_test_the_sharp_edges_table_names_exists():
    # docs/PRIVACY.md's "Sharp edges" names the test behind each row: each
    # file must exist and each `file::name` must be a test in that file.
    root = os.path.join(os.path.dirname(__file__), os.pardir)
    with open(os.path.join(root, "docs", "PRIVACY.md")) as f:
        text = f.read()
    section = text[text.index("## Sharp edges"):]
    section = section[:section.index("\n## ", 3)]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`tests/" in line]
    assert len(rows) >= 13
    for row in rows:
        names = re.findall(r"`(tests/[^`:]+\.py)(?:::(\w+))?`", row)
        assert names, row
        for path, test in names:
            with open(os.path.join(root, path)) as f:
                source = f.read()
            if test:
                assert re.search(rf"def {test}\(", source), f"{path}::{test}"
