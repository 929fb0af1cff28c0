"""A user's script sees none of TensorFlow's start-up notices through tfdp."""

import os
import subprocess
import sys

from absl.testing import absltest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NOTICES = ("cuInit", "Could not find cuda drivers", "oneDNN custom operations",
            "absl::InitializeLog", "rebuild TensorFlow")


class QuietStartupTest(absltest.TestCase):

    def test_importing_tfdp_and_building_a_model_prints_no_notice(self):
        env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
        proc = subprocess.run(
            [sys.executable, "-c",
             "import tfdp; tfdp.models.small_convnet(); print('built')"],
            capture_output=True, text=True, cwd=_REPO, env=env, timeout=300)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertIn("built", proc.stdout)
        for notice in _NOTICES:
            self.assertNotIn(notice, proc.stderr + proc.stdout)


if __name__ == "__main__":
    absltest.main()
