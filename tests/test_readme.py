"""The README's Python blocks run as pasted (offline: the default data ships in a wheel)."""

import os
import re

import pytest
import tensorflow as tf

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def python_blocks(path):
    with open(path) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), re.M | re.S)


class ReadmeTest(tf.test.TestCase):

    @pytest.mark.slow  # The Keras block trains three epochs (about 30 s).
    def test_every_python_block_runs(self):
        blocks = python_blocks(README)
        self.assertGreaterEqual(len(blocks), 2)
        for i, block in enumerate(blocks):
            with self.subTest(block=i):
                namespace = {"__name__": f"readme_block_{i}"}
                exec(compile(block, f"README.md python block {i}", "exec"), namespace)
