"""Smoke test of `python -m tfdp.bench` (structure only, no timing asserts)."""

import json
import os
import subprocess
import sys

from absl.testing import absltest

from tfdp import bench

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_KEYS = ("method", "jit_compile", "step_time_s", "peak_rss_mb", "time_ratio", "memory_ratio")


class BenchCliTest(absltest.TestCase):

    def test_json_output_of_a_tiny_run(self):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
        proc = subprocess.run(
            [
                sys.executable, "-m", "tfdp.bench", "--model=small_convnet",
                "--image_size=28", "--channels=1", "--batch_size=4",
                "--steps=2", "--warmup=1", "--jit_compile=off",
                "--methods=nonprivate,bk", "--json",
            ],
            capture_output=True, text=True, cwd=_REPO, env=env, timeout=600,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        results = json.loads(proc.stdout)
        self.assertIsInstance(results, list)
        self.assertEqual([r["method"] for r in results], ["nonprivate", "bk"])
        for r in results:
            for key in _KEYS:
                self.assertIn(key, r)
            self.assertIs(r["jit_compile"], False)
            self.assertGreater(r["step_time_s"], 0.0)
            self.assertGreater(r["peak_rss_mb"], 0.0)
            self.assertGreaterEqual(r["rss_increase_mb"], 0.0)
            self.assertGreater(r["time_ratio"], 0.0)
            self.assertGreater(r["memory_ratio"], 0.0)
        self.assertEqual(results[0]["time_ratio"], 1.0)
        self.assertEqual(results[0]["memory_ratio"], 1.0)

    def test_ratios_and_table(self):
        results = [
            {"method": "nonprivate", "jit_compile": False, "step_time_s": 0.1,
             "peak_rss_mb": 1000.0, "rss_increase_mb": 100.0},
            {"method": "bk", "jit_compile": False, "step_time_s": 0.15,
             "peak_rss_mb": 1100.0, "rss_increase_mb": 200.0},
            {"method": "bk", "jit_compile": True, "error": "exit 1: boom"},
        ]
        bench.add_ratios(results)
        self.assertAlmostEqual(results[1]["time_ratio"], 1.5)
        self.assertAlmostEqual(results[1]["memory_ratio"], 1.1)
        self.assertAlmostEqual(results[1]["rss_increase_ratio"], 2.0)
        self.assertIsNone(results[2]["time_ratio"])
        table = bench.format_table(results)
        self.assertIn("bk", table)
        self.assertIn("ERROR", table)

    def test_rejects_unknown_method(self):
        with self.assertRaises(SystemExit):
            bench.main(["--methods=nonprivate,bogus"])


if __name__ == "__main__":
    absltest.main()
