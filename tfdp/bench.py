"""Step time and peak memory of DP-SGD methods against non-private training.

Run, e.g.::

    python -m tfdp.bench --model=resnet18 --image_size=32 --batch_size=32

Every (method, jit_compile) pair runs in its own subprocess, so that the peak
resident set size (`getrusage(RUSAGE_SELF).ru_maxrss`) is that method's own.
TensorFlow's import dominates RSS, so the increase of the peak over the RSS
measured right after the model and train step were built is reported too.

A step is a full train step: forward, (clipped) gradient sum, noise and the
optimizer update, i.e. `PrivateTrainStep.accumulate` + `apply` with one
physical batch per logical step (`NonPrivateTrainStep` for "nonprivate").
"""

import argparse
import json
import os
import subprocess
import sys
import time

MODELS = ("resnet18", "resnet34", "resnet50", "small_convnet", "vgg_cifar")
ALL_METHODS = ("nonprivate", "naive", "vectorized", "ghost", "mixed", "bk", "auto")
DEFAULT_METHODS = ("nonprivate", "vectorized", "ghost", "mixed", "bk")
_MARKER = "TFDP_BENCH_RESULT "


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m tfdp.bench",
        description="Median step time and peak memory of DP-SGD methods, each "
        "in its own subprocess, with ratios against non-private training.",
    )
    parser.add_argument("--model", default="resnet18", choices=MODELS)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--num_classes", type=int, default=10)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument(
        "--methods", default=",".join(DEFAULT_METHODS),
        help=f"Comma-separated subset of {','.join(ALL_METHODS)}.",
    )
    parser.add_argument("--steps", type=int, default=10, help="Timed steps.")
    parser.add_argument("--warmup", type=int, default=3, help="Untimed steps.")
    parser.add_argument("--jit_compile", default="both", choices=("both", "on", "off"))
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
    parser.add_argument("--l2_norm_clip", type=float, default=1.0)
    parser.add_argument("--noise_multiplier", type=float, default=1.0)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument(
        "--timeout", type=float, default=1800.0,
        help="Seconds allowed to each subprocess.",
    )
    parser.add_argument("--json", action="store_true", help="Print a JSON list.")
    # Internal: run one measurement in this process.
    parser.add_argument("--child_method", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child_jit", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; expected a subset of {ALL_METHODS}")
    args.method_list = methods
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.virtual_steps < 1:
        parser.error("--steps, --repeats and --virtual_steps must be >= 1 and --warmup >= 0")
    return args


def _current_rss_mb():
    """Current resident set size in MiB (Linux /proc; falls back to peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return _peak_rss_mb()


def _peak_rss_mb():
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0


def build_model(name, image_size, channels, num_classes):
    """Builds one of `MODELS` for square `image_size` inputs."""
    from tfdp import models

    shape = (image_size, image_size, channels)
    if name.startswith("resnet"):
        return getattr(models, name)(num_classes=num_classes, input_shape=shape)
    return getattr(models, name)(num_classes=num_classes, input_shape=shape)


def _run_child(args):
    """Measures one method in this process; prints one marked JSON line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdp import dp
    from tfdp.mechanism import DPSGD

    method = args.child_method
    jit = args.child_jit == "on"
    keras.utils.set_random_seed(0)
    model = build_model(args.model, args.image_size, args.channels, args.num_classes)
    optimizer = keras.optimizers.SGD(learning_rate=0.01, momentum=0.9, nesterov=True)

    def loss_fn(y_true, logits):
        return keras.losses.sparse_categorical_crossentropy(y_true, logits, from_logits=True)

    if method == "nonprivate":
        step = dp.NonPrivateTrainStep(
            model, optimizer, loss_fn, expected_batch_size=args.batch_size * args.virtual_steps,
            weight_decay=args.weight_decay, jit_compile=jit,
        )
    else:
        mechanism = DPSGD(args.l2_norm_clip, args.noise_multiplier,
                          expected_batch_size=args.batch_size * args.virtual_steps)
        step = dp.PrivateTrainStep(
            model, optimizer, loss_fn, mechanism=mechanism, method=method,
            weight_decay=args.weight_decay, jit_compile=jit,
        )
    rng = np.random.default_rng(0)
    shape = (args.batch_size, args.image_size, args.image_size, args.channels)
    x = tf.constant(rng.normal(size=shape).astype(np.float32))
    y = tf.constant(rng.integers(0, args.num_classes, size=(args.batch_size,)), tf.int32)
    w = tf.ones([args.batch_size], tf.float32)
    probe = step.variables[0]
    baseline_rss = _current_rss_mb()
    baseline_peak = _peak_rss_mb()

    # One logical step: `virtual_steps` physical batches, the last one marked.
    logical_step = [(x, y, w, i == args.virtual_steps - 1) for i in range(args.virtual_steps)]

    def one_step():
        for _ in dp.run_logical_steps(step, logical_step):
            pass
        probe.numpy()  # Waits for the step to finish.

    t0 = time.perf_counter()
    one_step()  # Traces (and compiles with XLA).
    first_step_s = time.perf_counter() - t0
    for _ in range(max(args.warmup - 1, 0)):
        one_step()
    times, cpu_times = [], []
    for _ in range(args.steps):
        c0 = time.process_time()
        t0 = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    peak = _peak_rss_mb()
    result = {
        "method": method,
        "resolved_method": getattr(step, "method", method) if method != "nonprivate" else method,
        "jit_compile": jit,
        "step_time_s": float(np.median(times)) / args.virtual_steps,
        "step_time_min_s": float(np.min(times)) / args.virtual_steps,
        "cpu_time_s": float(np.median(cpu_times)) / args.virtual_steps,
        "first_step_s": first_step_s,
        "peak_rss_mb": peak,
        "baseline_rss_mb": baseline_rss,
        "rss_increase_mb": max(peak - baseline_rss, 0.0),
        "peak_before_steps_mb": baseline_peak,
        "num_params": int(sum(int(np.prod(v.shape)) for v in model.trainable_variables)),
    }
    if method != "nonprivate":
        result.update(_noise_draw_times(model.trainable_variables, args.noise_multiplier))
    sys.stdout.write(_MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


def _noise_draw_times(variables, stddev, repeats=5):
    """Median seconds of one logical step's noise: tfdp's sampler against TF's.

    TF's `stateless_normal` caps every draw at 5.68σ, which tfdp's sampler
    does not (docs/PRIVACY.md, "Floating-point noise"); this is what that
    costs.
    """
    import numpy as np
    import tensorflow as tf

    from tfdp.dp import noise as noise_lib

    shapes = [v.shape for v in variables]
    seed = tf.constant([1, 2], tf.int64)

    @tf.function
    def tfdp_draw(seed):
        zeros = [tf.zeros(s) for s in shapes]
        return [tf.reduce_sum(n) for n in noise_lib.gaussian_noise(zeros, stddev, seed)]

    @tf.function
    def tf_draw(seed):
        seeds = tf.random.experimental.stateless_split(seed, len(shapes))
        return [tf.reduce_sum(tf.random.stateless_normal(s, seeds[i], stddev=stddev))
                for i, s in enumerate(shapes)]

    out = {}
    for name, fn in (("noise_draw_s", tfdp_draw), ("tf_normal_draw_s", tf_draw)):
        fn(seed)
        times = []
        for i in range(repeats):
            t0 = time.perf_counter()
            [t.numpy() for t in fn(seed + i)]
            times.append(time.perf_counter() - t0)
        out[name] = float(np.median(times))
    return out


def _child_command(args, method, jit):
    return [
        sys.executable, "-m", "tfdp.bench",
        f"--model={args.model}", f"--image_size={args.image_size}",
        f"--channels={args.channels}", f"--num_classes={args.num_classes}",
        f"--batch_size={args.batch_size}", f"--steps={args.steps}",
        f"--warmup={args.warmup}", f"--l2_norm_clip={args.l2_norm_clip}",
        f"--noise_multiplier={args.noise_multiplier}",
        f"--weight_decay={args.weight_decay}", f"--virtual_steps={args.virtual_steps}",
        f"--child_method={method}", f"--child_jit={'on' if jit else 'off'}",
    ]


def _measure(args, method, jit, log):
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    log(f"[tfdp.bench] {method} jit_compile={jit} ...")
    try:
        proc = subprocess.run(
            _child_command(args, method, jit), capture_output=True, text=True,
            env=env, timeout=args.timeout,
        )
    except subprocess.TimeoutExpired:
        return {"method": method, "jit_compile": jit, "error": f"timeout after {args.timeout}s"}
    for line in proc.stdout.splitlines():
        if line.startswith(_MARKER):
            return json.loads(line[len(_MARKER):])
    tail = (proc.stderr or proc.stdout)[-2000:]
    return {"method": method, "jit_compile": jit, "error": f"exit {proc.returncode}: {tail}"}


def add_ratios(results):
    """Adds time/memory ratios against "nonprivate" with the same jit_compile."""
    base = {
        r["jit_compile"]: r for r in results
        if r["method"] == "nonprivate" and "error" not in r
    }
    for r in results:
        b = base.get(r["jit_compile"])
        ok = b is not None and "error" not in r
        r["time_ratio"] = r["step_time_s"] / b["step_time_s"] if ok else None
        r["memory_ratio"] = r["peak_rss_mb"] / b["peak_rss_mb"] if ok else None
        r["cpu_time_ratio"] = (
            r["cpu_time_s"] / b["cpu_time_s"]
            if ok and r.get("cpu_time_s") and b.get("cpu_time_s") else None
        )
        r["rss_increase_ratio"] = (
            r["rss_increase_mb"] / b["rss_increase_mb"]
            if ok and b["rss_increase_mb"] > 0 else None
        )
        for key in ("step_time_s", "peak_rss_mb", "cpu_time_s", "rss_increase_mb"):
            r.setdefault(key, None)
    return results


def format_table(results):
    """A fixed-width text table of `results`."""

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    def ms(v):
        return None if v is None else v * 1000

    header = (
        f"{'method':<11} {'xla':<4} {'step ms':>9} {'x time':>7} "
        f"{'peak MB':>8} {'x mem':>6} {'+RSS MB':>8} {'x +RSS':>7} "
        f"{'cpu ms':>8} {'x cpu':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['method']:<11} {'on' if r['jit_compile'] else 'off':<4} "
                         f"ERROR {r['error'].splitlines()[-1] if r['error'] else ''}")
            continue
        lines.append(
            f"{r['method']:<11} {'on' if r['jit_compile'] else 'off':<4} "
            f"{fmt(ms(r['step_time_s']), '9.1f')} {fmt(r['time_ratio'], '6.2f')}x "
            f"{fmt(r['peak_rss_mb'], '8.0f')} {fmt(r['memory_ratio'], '5.2f')}x "
            f"{fmt(r['rss_increase_mb'], '8.0f')} {fmt(r['rss_increase_ratio'], '6.2f')}x "
            f"{fmt(ms(r['cpu_time_s']), '8.1f')} {fmt(r['cpu_time_ratio'], '5.2f')}x"
        )
    return "\n".join(lines)


def main(argv=None):
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    if args.child_method is not None:
        return _run_child(args)
    jits = {"both": (False, True), "on": (True,), "off": (False,)}[args.jit_compile]
    methods = list(args.method_list)
    if "nonprivate" not in methods:
        methods.insert(0, "nonprivate")  # The ratios need it.

    def log(message):
        print(message, file=sys.stderr, flush=True)

    results = []
    for jit in jits:
        best = {}
        for _ in range(args.repeats):
            for method in methods:
                r = _measure(args, method, jit, log)
                old = best.get(method)
                if old is None or ("error" in old and "error" not in r) or (
                    "error" not in r and r["step_time_s"] < old["step_time_s"]
                ):
                    best[method] = r
        results.extend(best[m] for m in methods)
    add_ratios(results)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(
            f"model={args.model} image_size={args.image_size} "
            f"batch_size={args.batch_size} steps={args.steps} warmup={args.warmup} "
            f"repeats={args.repeats} "
            f"cpus={os.cpu_count()}"
        )
        print(format_table(results))
        draws = [r for r in results if "noise_draw_s" in r]
        if draws:
            ours = min(r["noise_draw_s"] for r in draws)
            theirs = min(r["tf_normal_draw_s"] for r in draws)
            print(
                f"noise draw per logical step ({draws[0]['num_params']:,} normals): "
                f"tfdp {ours * 1e3:.0f} ms (no cap below 9.49 sigma) against "
                f"tf.random.stateless_normal {theirs * 1e3:.0f} ms (capped at 5.68 sigma): "
                f"{ours / theirs:.2f}x"
            )
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
