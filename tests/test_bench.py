"""Smoke test of `python -m tfdp.bench` (structure only, no timing asserts)."""

import json
import os
import subprocess
import sys

import pytest
from absl.testing import absltest

from tfdp.bench import children, cli, runners, search, tables
from tfdp.bench import models as bench_models

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_KEYS = ("method", "jit_compile", "step_time_s", "peak_rss_mb", "time_ratio", "memory_ratio")


class BenchCliTest(absltest.TestCase):

    @pytest.mark.slow
    def test_json_output_of_a_tiny_run(self):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
        proc = subprocess.run(
            [
                sys.executable, "-m", "tfdp.bench", "--model=small_convnet",
                "--image_size=28", "--channels=1", "--batch_size=4",
                "--steps=2", "--warmup=1", "--jit_compile=off",
                "--methods=nonprivate,bk", "--paired", "--json",
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
        # bk was also timed against non-private in one process, steps alternated.
        self.assertEqual(results[0]["paired_time_ratio"], 1.0)
        bk = results[1]
        self.assertGreater(bk["paired_step_time_s"], 0.0)
        self.assertGreater(bk["paired_nonprivate_step_time_s"], 0.0)
        # The median of the rounds' ratios, inside their quartiles; it is the
        # table's time ratio.
        self.assertEqual(bk["paired_rounds"], runners.paired_rounds(2))
        low, high = bk["paired_time_ratio_quartiles"]
        self.assertLessEqual(low, bk["paired_time_ratio"])
        self.assertLessEqual(bk["paired_time_ratio"], high)
        self.assertEqual(bk["time_ratio"], bk["paired_time_ratio"])
        self.assertAlmostEqual(
            bk["separate_time_ratio"], bk["step_time_s"] / results[0]["step_time_s"])
        # The overhead per physical batch and per logical step, from the
        # paired child's phases, and amortised over the paper's accumulation.
        for key in ("paired_batch_time_s", "paired_update_time_s",
                    "paired_nonprivate_batch_time_s", "paired_nonprivate_update_time_s"):
            self.assertGreater(bk[key], 0.0)
        for r in results:
            self.assertGreater(r["batch_time_s"], 0.0)
            self.assertGreater(r["update_time_s"], 0.0)
        self.assertAlmostEqual(bk["batch_overhead_ratio"], bk["paired_batch_time_s"]
                               / bk["paired_nonprivate_batch_time_s"])
        self.assertEqual(sorted(bk["amortised_time_ratios"], key=int),
                         [str(k) for k in tables.BATCHES_PER_STEP])
        self.assertIn("noise_draw_s", bk)
        self.assertGreater(bk["hardened_noise_release_s"], 0.0)
        self.assertGreater(bk["noise_release_s"], 0.0)

    @pytest.mark.slow
    def test_budget_search_on_the_allocator_peak(self):
        # On a CPU, --search_memory=tensors measures TensorFlow's allocator peak,
        # reset per batch, so one child's ascending batches each report their own.
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
        proc = subprocess.run(
            [
                sys.executable, "-m", "tfdp.bench", "--model=small_convnet",
                "--image_size=28", "--channels=1", "--batch_size=32", "--max_batch_size=128",
                "--jit_compile=off", "--methods=nonprivate", "--memory_budget_mb=1e5",
                "--search_memory=tensors", "--search_refine=0",
                "--child_method=nonprivate", "--child_jit=off", "--child_batches=32,64,128",
            ],
            capture_output=True, text=True, cwd=_REPO, env=env, timeout=600,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        lines = children.child_results(proc.stdout)
        self.assertEqual([r["batch_size"] for r in lines], [32, 64, 128])
        for r in lines:
            self.assertEqual(r["memory"], "TensorFlow allocator peak on CPU:0")
            self.assertTrue(r["fits"])
        peaks = [r["peak_mb"] for r in lines]
        # The allocator's tensors alone: a peak RSS would also hold the
        # runtime's hundreds of MiB.
        self.assertLess(peaks[0], peaks[2])
        self.assertLess(peaks[2], 200.0)

    def test_ratios_and_table(self):
        results = [
            {"method": "nonprivate", "jit_compile": False, "step_time_s": 0.1,
             "peak_rss_mb": 1000.0, "rss_increase_mb": 100.0},
            {"method": "bk", "jit_compile": False, "step_time_s": 0.15,
             "peak_rss_mb": 1100.0, "rss_increase_mb": 200.0},
            {"method": "bk", "jit_compile": True, "error": "exit 1: boom"},
        ]
        tables.add_ratios(results)
        # Without the paired timing (--no-paired) the time ratio is the
        # separate processes' one.
        self.assertAlmostEqual(results[1]["time_ratio"], 1.5)
        self.assertAlmostEqual(results[1]["separate_time_ratio"], 1.5)
        self.assertAlmostEqual(results[1]["memory_ratio"], 1.1)
        self.assertAlmostEqual(results[1]["rss_increase_ratio"], 2.0)
        self.assertIsNone(results[2]["time_ratio"])
        table = tables.format_table(results)
        self.assertIn("bk", table)
        self.assertIn("ERROR", table)
        self.assertIsNone(results[1]["paired_time_ratio"])
        self.assertEqual(results[0]["paired_time_ratio"], 1.0)
        header, bk_row = table.splitlines()[0], table.splitlines()[3]
        self.assertEqual(header.split()[2:6], ["x", "time", "step", "ms"])
        self.assertEqual(bk_row.split()[2:5], ["1.50x", "150.0", "1.50x"])
        self.assertIn("--no-paired", table)
        # With it, the paired ratio leads and the separate one stays beside it.
        results[1].update(paired_time_ratio=1.27, paired_rounds=20)
        tables.add_ratios(results)
        self.assertEqual(results[1]["time_ratio"], 1.27)
        table = tables.format_table(results)
        self.assertEqual(table.splitlines()[3].split()[2:5], ["1.27x", "150.0", "1.50x"])
        self.assertIn("median of 20 rounds", table)
        self.assertNotIn("No paired timing", table)
        # A method whose paired child failed keeps the separate ratio, and says so.
        results.insert(2, {"method": "mixed", "jit_compile": False, "step_time_s": 0.2,
                           "peak_rss_mb": 1000.0, "rss_increase_mb": 100.0})
        tables.add_ratios(results)
        self.assertAlmostEqual(results[2]["time_ratio"], 2.0)
        self.assertIn("No paired timing for mixed", tables.format_table(results))
        # Non-private alone has no ratio to explain.
        self.assertNotIn("x time:", tables.format_table(results[:1]))

    def test_overhead_per_batch_and_per_logical_step(self):
        results = [
            {"method": "nonprivate", "jit_compile": False, "step_time_s": 0.12,
             "peak_rss_mb": 1000.0, "rss_increase_mb": 100.0,
             "batch_time_s": 0.100, "update_time_s": 0.020},
            {"method": "bk", "jit_compile": False, "step_time_s": 0.2,
             "peak_rss_mb": 1000.0, "rss_increase_mb": 100.0,
             "batch_time_s": 0.120, "update_time_s": 0.080},
            {"method": "ghost", "jit_compile": False, "step_time_s": 0.2,
             "peak_rss_mb": 1000.0, "rss_increase_mb": 100.0,
             "batch_time_s": 0.500, "update_time_s": 0.500,
             "paired_batch_time_s": 0.150, "paired_update_time_s": 0.060,
             "paired_nonprivate_batch_time_s": 0.100,
             "paired_nonprivate_update_time_s": 0.020},
        ]
        tables.add_ratios(results)
        bk, ghost = results[1], results[2]
        # Separate processes: clipping 1.2x per batch, the update 60 ms more.
        self.assertAlmostEqual(bk["batch_overhead_ratio"], 1.2)
        self.assertAlmostEqual(bk["update_overhead_s"], 0.060)
        # One batch per step carries the whole update; 256 batches share it.
        self.assertAlmostEqual(bk["amortised_time_ratios"][1], 0.2 / 0.12)
        self.assertAlmostEqual(bk["amortised_time_ratios"][256],
                               (0.12 + 0.08 / 256) / (0.1 + 0.02 / 256))
        self.assertGreater(bk["amortised_time_ratios"][1], bk["amortised_time_ratios"][64])
        self.assertGreater(bk["amortised_time_ratios"][64], bk["amortised_time_ratios"][256])
        # The paired child's phases win over the separate processes'.
        self.assertAlmostEqual(ghost["batch_overhead_ratio"], 1.5)
        self.assertAlmostEqual(ghost["update_overhead_s"], 0.040)
        self.assertAlmostEqual(results[0]["batch_overhead_ratio"], 1.0)
        table = tables.format_phase_table(results)
        rows = {line.split()[0]: line.split() for line in table.splitlines()[2:5]}
        self.assertEqual(rows["bk"][2:6], ["120.0", "1.20x", "80.0", "+60.0"])
        self.assertEqual(rows["ghost"][2:4], ["150.0", "1.50x"])
        self.assertIn("x at 256", table.splitlines()[0])
        # Without phases there is nothing to report.
        del results[1]["batch_time_s"]
        tables.add_ratios(results)
        self.assertIsNone(results[1]["batch_overhead_ratio"])
        self.assertNotIn("bk ", tables.format_phase_table(results))

    def test_budget_search_finds_the_largest_fitting_batch(self):
        # A stubbed child: peak = 100 + 3 MiB per example, out of memory from
        # 400 on; it stops at the first batch that does not fit, as the real
        # child does.
        calls, budget = [], [500.0]

        def probe(batches):
            calls.append(list(batches))
            results = []
            for b in batches:
                if b >= 400:
                    results.append({"batch_size": b, "error": "out_of_memory"})
                    break
                results.append({"batch_size": b, "peak_mb": 100.0 + 3 * b})
                if 100.0 + 3 * b > budget[0]:
                    break
            return results, None

        found = search.search_largest_batch(probe, start=8, max_batch=4096, budget_mb=500,
                                            refine=10)
        self.assertEqual(found["max_batch_size"], 133)  # 100 + 3 * 133 = 499
        self.assertEqual(found["first_failure"], 134)
        self.assertFalse(found["capped"])
        self.assertEqual(calls[0][:6], [8, 16, 32, 64, 128, 256])
        # Out of memory before the budget is reached.
        budget[0] = 1e6
        found = search.search_largest_batch(probe, start=8, max_batch=4096, budget_mb=1e6,
                                            refine=0)
        self.assertEqual(found["max_batch_size"], 256)
        self.assertEqual((found["first_failure"], found["reason"]), (512, "out of memory"))
        # A child killed mid-search: the batch after the last reported fails.
        killed = search.search_largest_batch(
            lambda batches: ([{"batch_size": 8, "peak_mb": 10.0}], "killed"),
            start=8, max_batch=64, budget_mb=1e6, refine=0)
        self.assertEqual((killed["max_batch_size"], killed["first_failure"]), (8, 16))
        self.assertEqual(killed["reason"], "killed")
        table = tables.format_search_table(
            [dict(found, method="nonprivate", jit_compile=False),
             dict(found, method="bk", jit_compile=False, max_batch_size=128)], 1e6)
        self.assertIn("0.50x", table)
        self.assertIn("of peak memory (the accelerator's", table.splitlines()[0])
        table = tables.format_search_table(
            [dict(found, method="nonprivate", jit_compile=False)], 1e6, "tensors")
        self.assertIn("of TensorFlow's allocator peak", table.splitlines()[0])

    def test_failures_name_a_smaller_batch_or_another_method(self):
        killed = children.failure_message("vectorized", 64, returncode=-9)
        self.assertIn("OOM killer", killed)
        self.assertIn("--batch_size=32", killed)
        self.assertIn("--methods=bk", killed)
        oom = children.failure_message("ghost", 16, out_of_memory=True)
        self.assertIn("accelerator memory", oom)
        self.assertIn("--methods=mixed", oom)
        self.assertIn("--timeout", children.failure_message("bk", 8, timeout=10.0))

    def test_the_default_is_quick_and_all_is_the_full_table(self):
        quick = cli.parse_args([])
        self.assertEqual(quick.method_list, ["nonprivate", "auto"])
        self.assertEqual(quick.jit_compile, "off")
        self.assertFalse(quick.paired)  # One child per method: two in all.
        full = cli.parse_args(["--methods=all", "--jit_compile=both"])
        self.assertEqual(full.method_list,
                         ["nonprivate", "vectorized", "ghost", "mixed", "bk"])
        self.assertTrue(full.paired)
        self.assertFalse(cli.parse_args(["--methods=all", "--no-paired"]).paired)
        self.assertTrue(cli.parse_args(["--paired"]).paired)

    def test_each_row_is_printed_as_it_is_measured(self):
        # A stubbed child: the parent logs a progress line before each child
        # and the row right after it, before the final table.
        order = []

        def fake_measure(args, method, jit, log_, progress=None):
            log_(f"progress {progress} {method}")
            order.append(method)
            return {"method": method, "jit_compile": jit, "peak_rss_mb": 900.0,
                    "rss_increase_mb": 10.0,
                    "step_time_s": 0.1 if method == "nonprivate" else 0.15}

        import contextlib
        import io
        from unittest import mock

        out, err = io.StringIO(), io.StringIO()
        with mock.patch.object(children, "measure", fake_measure), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            self.assertEqual(cli.main([]), 0)
        lines = err.getvalue().splitlines()
        self.assertEqual(lines, [
            "progress 1/2 nonprivate",
            "[tfdp.bench] nonprivate (XLA off): 100.0 ms/step, peak RSS 900 MB",
            "progress 2/2 auto",
            "[tfdp.bench] auto (XLA off): 150.0 ms/step (1.50x non-private), peak RSS 900 MB",
        ])
        self.assertEqual(order, ["nonprivate", "auto"])
        self.assertIn("auto", out.getvalue().splitlines()[-2])
        self.assertIn("1.50x", out.getvalue())
        error = tables.format_row_line({"method": "bk", "jit_compile": True, "error": "boom"})
        self.assertEqual(error, "[tfdp.bench] bk (XLA on): ERROR boom")

    def test_hardened_noise_reaches_the_child_and_its_step(self):
        import subprocess as subprocess_lib
        from unittest import mock

        def child_argv(argv):
            with mock.patch.object(children.subprocess, "run") as run:
                run.return_value = subprocess_lib.CompletedProcess([], 1, "", "")
                children.spawn(cli.parse_args(argv), "bk", False, lambda message: None)
            return run.call_args.args[0]

        self.assertIn("--hardened_noise", child_argv(["--hardened_noise"]))
        self.assertNotIn("--hardened_noise", child_argv([]))
        args = cli.parse_args(["--hardened_noise", "--model=small_convnet", "--image_size=8",
                               "--channels=1"])
        args.child_method, args.child_jit = "bk", "off"
        _, step = bench_models.build_step(args)
        self.assertTrue(step.aggregator.hardened_noise)

    def test_the_noise_line_sets_the_hardened_release_against_a_physical_batch(self):
        result = {"num_params": 1000, "noise_draw_s": 0.1, "tf_normal_draw_s": 0.08,
                  "noise_release_s": 0.1, "hardened_noise_release_s": 0.4,
                  "batch_time_s": 0.15}
        lines = tables.format_noise_draw([result]).splitlines()
        self.assertIn("1.25x", lines[0])
        self.assertEqual(lines[1], (
            "noise release per logical step (draw, add, divide): 100 ms, hardened 400 ms "
            "(4.0x): +300 ms per logical step, 2.00x one physical batch (150 ms), 3.1% of a "
            "logical step of 64"))

    def test_rejects_unknown_method(self):
        with self.assertRaises(SystemExit):
            cli.main(["--methods=nonprivate,bogus"])



class BenchModelsTest(absltest.TestCase):
    """The bench's model factory builds each vision transformer and keras.applications CNN."""

    def assert_builds(self, names):
        import keras
        import numpy as np

        from tfdp import models

        for name in names:
            with self.subTest(name):
                model = bench_models.build_model(name, image_size=32, channels=3, num_classes=7)
                self.assertEqual(model.input_shape, (None, 32, 32, 3))
                self.assertEqual(model.output_shape, (None, 7))
                self.assertEqual(models.find_batchnorm(model), [])
                logits = model(np.zeros((1, 32, 32, 3), "float32"), training=False)
                self.assertTrue(np.all(np.isfinite(keras.ops.convert_to_numpy(logits))))
                keras.backend.clear_session()

    def test_builds_a_transformer_and_an_application_at_a_small_size(self):
        self.assert_builds(("vit_ti16", "mobilenet_v2"))

    @pytest.mark.slow
    def test_builds_every_other_model_at_a_small_size(self):
        # About a minute on 2 cores: ViT-B alone has 86 M parameters.
        self.assert_builds(("vit_s16", "vit_b16", "efficientnet_b0", "convnext_tiny",
                            "densenet121"))

    def test_rejects_an_unknown_model(self):
        with self.assertRaisesRegex(ValueError, "Unknown bench model"):
            bench_models.build_model("vit_h14", image_size=32, channels=3, num_classes=7)


class BenchHelpTest(absltest.TestCase):

    def test_every_option_has_a_line_with_its_default(self):
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out), self.assertRaises(SystemExit) as exit_:
            cli.parse_args(["--help"])
        self.assertEqual(exit_.exception.code, 0)
        text = out.getvalue()
        for option, default in (("--image_size", "32"), ("--batch_size", "32"),
                                ("--model", "resnet18"), ("--l2_norm_clip", "1.0"),
                                ("--steps", "10"), ("--jit_compile", "off")):
            block = text.split(f"  {option}", 1)[1].split("\n  --", 1)[0]
            self.assertIn(f"(default: {default})", " ".join(block.split()), option)


if __name__ == "__main__":
    absltest.main()
