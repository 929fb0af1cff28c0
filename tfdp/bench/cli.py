"""The bench's command line: `python -m tfdp.bench` (flags, `main`).

Every (method, jit_compile) pair runs in its own child process
(`children.spawn`), the same command line with internal `--child_*` flags,
which `main` hands to the runner or the memory search in the child.

Imports no TensorFlow: the parent only spawns children and prints tables.
"""

import argparse
import json
import os
import sys

from tfdp.bench import children, runners, search, tables
from tfdp.bench.models import MODELS

ALL_METHODS = ("nonprivate", "naive", "vectorized", "ghost", "mixed", "bk", "auto")
# The quick default: non-private training against tfdp's default clipping
# method (one child each, about a minute on 2 cores).
DEFAULT_METHODS = ("nonprivate", "auto")
# `--methods=all`: every method that bounds each example's gradient its own
# way (naive is the slow reference, auto one of these; both can be named).
FULL_METHODS = ("nonprivate", "vectorized", "ghost", "mixed", "bk")


def parse_args(argv):
    """The flags of `argv`, with `method_list` the parsed `--methods`."""
    parser = argparse.ArgumentParser(
        prog="python -m tfdp.bench",
        description="Median step time and peak memory of DP-SGD methods, each "
        "in its own subprocess, with ratios against non-private training.",
        # Every option's line shows its default.
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="resnet18", choices=MODELS,
                        help="The model (a tfdp.models builder of that name).")
    parser.add_argument("--image_size", type=int, default=32, help="Square input size, px.")
    parser.add_argument("--channels", type=int, default=3, help="Input channels.")
    parser.add_argument("--num_classes", type=int, default=10, help="Classes of the head.")
    parser.add_argument("--batch_size", type=int, default=32, help="The physical batch.")
    parser.add_argument(
        "--methods", default=",".join(DEFAULT_METHODS),
        help=f"Comma-separated subset of {','.join(ALL_METHODS)}, or 'all' for "
        f"{','.join(FULL_METHODS)}. The default compares non-private training with the "
        "default clipping method ('auto').",
    )
    parser.add_argument("--steps", type=int, default=10, help="Timed steps.")
    parser.add_argument("--warmup", type=int, default=3, help="Untimed steps.")
    parser.add_argument("--jit_compile", default="off", choices=("both", "on", "off"),
                        help="XLA off, on, or both (each method measured twice).")
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="Runs every method this many times, interleaved, and keeps the "
        "run with the smallest median step time (for noisy shared machines).",
    )
    parser.add_argument(
        "--virtual_steps", type=int, default=1,
        help="Physical batches per logical (noisy) step; times are per physical batch. "
        "The noise, drawn once per logical step, is amortised over them.",
    )
    parser.add_argument(
        "--hardened_noise", action="store_true",
        help="Private steps draw the noise hardened against floating-point attacks "
        "(DPSGDConfig(hardened_noise=True)). The noise line times both samplers either way.",
    )
    parser.add_argument("--l2_norm_clip", type=float, default=1.0, help="C.")
    parser.add_argument("--noise_multiplier", type=float, default=1.0, help="σ.")
    parser.add_argument("--weight_decay", type=float, default=0.0,
                        help="In-loss L2 weight decay.")
    parser.add_argument(
        "--timeout", type=float, default=1800.0,
        help="Seconds allowed to each subprocess.",
    )
    parser.add_argument(
        "--memory_budget_mb", type=float, default=None,
        help="Search each method's largest physical batch whose peak memory (accelerator "
        "peak, else peak RSS) fits in this many MiB, instead of timing --batch_size.",
    )
    parser.add_argument(
        "--search_memory", choices=("auto", "rss", "tensors"), default="auto",
        help="What the --memory_budget_mb search measures: 'tensors', the peak of "
        "TensorFlow's allocator (what decides the batch on an accelerator; on a CPU it "
        "leaves out the runtime and malloc's fragmentation); 'rss', the child's peak "
        "resident set size (CPU only); 'auto', the accelerator's allocator peak where "
        "there is one, else peak RSS.",
    )
    parser.add_argument(
        "--max_batch_size", type=int, default=4096,
        help="Largest batch the --memory_budget_mb search tries.",
    )
    parser.add_argument(
        "--search_refine", type=int, default=2,
        help="Bisection steps (one child each) after the doubling phase of the search; "
        "0 reports the largest fitting power-of-two multiple of --batch_size.",
    )
    parser.add_argument(
        "--paired", action=argparse.BooleanOptionalAction, default=None,
        help="Time each private method against non-private training in one more "
        "process, alternating their steps (column 'x time'): a time ratio that the "
        "machine's drift between processes does not move. --no-paired skips it, and "
        "'x time' is then the separate processes' ratio ('x sep'). Defaults to on for "
        "several private methods or --jit_compile=both (the full table), off for one "
        "(the quick default).",
    )
    parser.add_argument("--json", action="store_true", help="Print a JSON list.")
    # Internal: run one measurement in this process.
    parser.add_argument("--child_method", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child_jit", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child_batches", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child_paired", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if methods == ["all"]:
        methods = list(FULL_METHODS)
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; expected a subset of {ALL_METHODS}")
    args.method_list = methods
    if args.paired is None:
        private = [m for m in methods if m != "nonprivate"]
        args.paired = len(private) > 1 or args.jit_compile == "both"
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.virtual_steps < 1:
        parser.error("--steps, --repeats and --virtual_steps must be >= 1 and --warmup >= 0")
    if args.batch_size < 1 or args.max_batch_size < args.batch_size or args.search_refine < 0:
        parser.error("need 1 <= --batch_size <= --max_batch_size and --search_refine >= 0")
    if args.memory_budget_mb is not None and args.memory_budget_mb <= 0:
        parser.error("--memory_budget_mb must be > 0")
    return args


def _run_child(args):
    """Runs the measurement a `--child_*` command line asks for, in this process."""
    if args.child_batches:
        return search.run_search_child(args)
    if args.child_paired:
        return runners.run_paired_child(args)
    return runners.run_timing_child(args)


def main(argv=None):
    """Runs the bench (or, with `--child_*` flags, one child's measurement); the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child_method is not None:
        return _run_child(args)
    jits = {"both": (False, True), "on": (True,), "off": (False,)}[args.jit_compile]
    methods = list(args.method_list)
    if "nonprivate" not in methods:
        methods.insert(0, "nonprivate")  # The ratios need it.

    def log(message):
        print(message, file=sys.stderr, flush=True)

    if args.memory_budget_mb is not None:
        results = [search.search_method(args, m, jit, log) for jit in jits for m in methods]
        if args.json:
            print(json.dumps(results, indent=1))
        else:
            print(f"model={args.model} image_size={args.image_size} cpus={os.cpu_count()}")
            print(tables.format_search_table(results, args.memory_budget_mb, args.search_memory))
        return 0 if all(r.get("max_batch_size") for r in results) else 1

    results = []
    total, done = len(jits) * args.repeats * len(methods), 0
    for jit in jits:
        best = {}
        for _ in range(args.repeats):
            for method in methods:
                done += 1
                r = children.measure(args, method, jit, log, progress=f"{done}/{total}")
                log(tables.format_row_line(r, best.get("nonprivate")))
                old = best.get(method)
                if old is None or ("error" in old and "error" not in r) or (
                    "error" not in r and r["step_time_s"] < old["step_time_s"]
                ):
                    best[method] = r
        results.extend(best[m] for m in methods)
    if args.paired:
        for r in results:
            if r["method"] != "nonprivate" and "error" not in r:
                paired, failure = children.spawn(args, r["method"], r["jit_compile"], log,
                                                 paired=True)
                if paired and "error" not in paired[0]:
                    r.update({k: v for k, v in paired[0].items() if k.startswith("paired_")})
                else:
                    log(f"[tfdp.bench] paired timing: {failure}")
    tables.add_ratios(results)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(
            f"model={args.model} image_size={args.image_size} "
            f"batch_size={args.batch_size} steps={args.steps} warmup={args.warmup} "
            f"repeats={args.repeats} "
            f"cpus={os.cpu_count()}"
        )
        print(tables.format_table(results))
        if any(r.get("batch_overhead_ratio") is not None for r in results):
            print()
            print(tables.format_phase_table(results))
        noise_draw = tables.format_noise_draw(results)
        if noise_draw is not None:
            print(noise_draw)
    return 0 if all("error" not in r for r in results) else 1
