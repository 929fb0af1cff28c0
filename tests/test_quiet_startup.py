"""A user's script sees none of TensorFlow's start-up notices through tfdp."""

import os
import subprocess
import sys

import pytest
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

    @pytest.mark.slow  # A whole CLI process with TensorFlow and a dry run (about 30 s).
    def test_a_cli_run_prints_no_notice_and_each_warning_once(self):
        # A dry run builds the model and trains two steps on mock data; δ above
        # 1/N (N = 4,000) is checked twice in the run and said once.
        env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
        proc = subprocess.run(
            [sys.executable, "-m", "tfdp.train", "--dry_run",
             f"--workdir={self.create_tempdir().full_path}",
             "--gin_param=PrivacyConfig.delta = 1e-3"],
            capture_output=True, text=True, cwd=_REPO, env=env, timeout=600)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        output = proc.stderr + proc.stdout
        self.assertIn("dry run: 2 steps on mock data OK", output)
        for notice in _NOTICES:
            self.assertNotIn(notice, output)
        self.assertEqual(output.count("permits leaking whole examples"), 1, output[-3000:])


if __name__ == "__main__":
    absltest.main()
