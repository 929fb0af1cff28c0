"""Runners: a method's train step timed in this process (a bench child).

A step is a full train step: forward, (clipped) gradient sum, noise and the
optimizer update, i.e. `PrivateTrainStep.accumulate` + `apply` with one
physical batch per logical step (`NonPrivateTrainStep` for "nonprivate").
Its two phases are timed too: the physical batch (`accumulate`) and the
logical step's update (`apply`).

`run_timing_child` measures one method: the median step time, the peak
resident set size (`getrusage(RUSAGE_SELF).ru_maxrss`, the process' own as
each method runs in its own child), its increase over the RSS right after
the model and step were built (TensorFlow's import dominates RSS), and the
peak of TensorFlow's own allocator over the timed steps
(`tf.config.experimental.get_memory_info` on the accelerator, else on the
CPU). `run_paired_child` times a private method against non-private
training in one process, their steps alternated.

Imports no TensorFlow at module level: the parent process, which spawns the
children, and `--help` never import it.
"""

import resource
import sys
import time

import numpy as np

from tfdp.bench import children, models


def _current_rss_mb():
    """Current resident set size in MiB (Linux /proc; falls back to peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return peak_rss_mb()


def peak_rss_mb():
    """Peak resident set size of this process in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0


def step_runner(args, step, batch_size):
    """A function running one logical step of `virtual_steps` batches of `batch_size`."""
    # Here, not at the top: keeps TensorFlow out of the parent process and --help.
    import tensorflow as tf

    from tfdp import dp

    rng = np.random.default_rng(0)
    shape = (batch_size, args.image_size, args.image_size, args.channels)
    x = tf.constant(rng.normal(size=shape).astype(np.float32))
    y = tf.constant(rng.integers(0, args.num_classes, size=(batch_size,)), tf.int32)
    w = tf.ones([batch_size], tf.float32)
    probe = step.variables[0]
    # Reading the smallest accumulator waits for a physical batch's work.
    batch_done = min(step.accumulators, key=lambda v: v.shape.num_elements())
    # One logical step: `virtual_steps` physical batches, the last one marked.
    logical_step = [(x, y, w, i == args.virtual_steps - 1) for i in range(args.virtual_steps)]
    phases = {"batch": [], "update": []}

    def one_step():
        marks = [time.perf_counter()]

        def batch_finished(images):
            del images
            batch_done.numpy()
            marks.append(time.perf_counter())

        for _ in dp.run_logical_steps(step, logical_step, on_batch=batch_finished):
            pass
        probe.numpy()  # Waits for the step to finish.
        phases["batch"].extend(b - a for a, b in zip(marks, marks[1:]))
        phases["update"].append(time.perf_counter() - marks[-1])

    one_step.phases = phases
    return one_step


def phase_medians(runner):
    """Median seconds of `runner`'s physical batch and of its logical step's update.

    A physical batch is `accumulate` (forward, gradient sum; per-example
    clipping when private); the update is `apply` (noise when private,
    division, optimizer update), once per logical step.
    """
    return {"batch_time_s": float(np.median(runner.phases["batch"])),
            "update_time_s": float(np.median(runner.phases["update"]))}


def accelerator():
    """The first GPU/TPU device name for `get_memory_info`, or None on CPU."""
    # Here, not at the top: keeps TensorFlow out of the parent process and --help.
    import tensorflow as tf

    for kind in ("GPU", "TPU"):
        if tf.config.list_logical_devices(kind):
            return f"{kind}:0"
    return None


def run_paired_child(args):
    """Non-private and one private method in this process, steps alternated.

    Separate processes run minutes apart, and on a shared or throttled
    machine the same step's time moves between them by more than the
    private overhead (the 32-px non-private step measured 99–145 ms across
    runs of one session, and within one process 103–123 ms a minute apart).
    Here each round times one step of each, adjacent in time, in the order
    AB then BA on alternate rounds (so neither always runs first); the
    ratio is the median over rounds of each round's private/non-private
    ratio, which slow drift moves little. Prints one marked line.
    """
    method, jit = args.child_method, args.child_jit == "on"
    runners = {}
    for name in ("nonprivate", method):
        args.child_method = name
        _, step = models.build_step(args)
        runners[name] = step_runner(args, step, args.batch_size)
        # Two at least: a tiny model's second step still traced once.
        for _ in range(max(args.warmup, 2)):
            runners[name]()
        for times in runners[name].phases.values():
            times.clear()
    args.child_method = method
    times = {name: [] for name in runners}
    names = list(runners)
    for round_index in range(paired_rounds(args.steps)):
        for name in names if round_index % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - t0)
    medians = {name: float(np.median(t)) / args.virtual_steps for name, t in times.items()}
    ratios = np.asarray(times[method]) / np.asarray(times["nonprivate"])
    children.emit({"method": method, "jit_compile": jit, "batch_size": args.batch_size,
                   "paired_step_time_s": medians[method],
                   "paired_nonprivate_step_time_s": medians["nonprivate"],
                   "paired_rounds": len(ratios),
                   "paired_time_ratio": float(np.median(ratios)),
                   "paired_time_ratio_quartiles": [float(np.percentile(ratios, 25)),
                                                   float(np.percentile(ratios, 75))],
                   **{f"paired_{k}": v for k, v in phase_medians(runners[method]).items()},
                   **{f"paired_nonprivate_{k}": v
                      for k, v in phase_medians(runners["nonprivate"]).items()}})
    return 0


def paired_rounds(steps):
    """Rounds of the paired timing: twice `--steps`, at least 20."""
    return max(2 * steps, 20)


def run_timing_child(args):
    """Measures one method in this process; prints one marked JSON line."""
    # Here, not at the top: keeps TensorFlow out of the parent process and --help.
    import tensorflow as tf

    method = args.child_method
    jit = args.child_jit == "on"
    try:
        model, step = models.build_step(args)
        one_step = step_runner(args, step, args.batch_size)
        baseline_rss = _current_rss_mb()
        baseline_peak = peak_rss_mb()
        t0 = time.perf_counter()
        one_step()  # Traces (and compiles with XLA).
        first_step_s = time.perf_counter() - t0
        for _ in range(max(args.warmup - 1, 0)):
            one_step()
        for phase_times in one_step.phases.values():
            phase_times.clear()
        tensor_device = accelerator() or "CPU:0"
        tf.config.experimental.reset_memory_stats(tensor_device)
        times, cpu_times = [], []
        for _ in range(args.steps):
            c0 = time.process_time()
            t0 = time.perf_counter()
            one_step()
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    except tf.errors.ResourceExhaustedError:
        children.emit({"method": method, "jit_compile": jit, "batch_size": args.batch_size,
                       "error": "out_of_memory"})
        return 3
    peak = peak_rss_mb()
    tensor_peak = tf.config.experimental.get_memory_info(tensor_device)["peak"] / 2**20
    result = {
        "method": method,
        "resolved_method": getattr(step, "method", method) if method != "nonprivate" else method,
        "jit_compile": jit,
        "batch_size": args.batch_size,
        "step_time_s": float(np.median(times)) / args.virtual_steps,
        "step_time_min_s": float(np.min(times)) / args.virtual_steps,
        "cpu_time_s": float(np.median(cpu_times)) / args.virtual_steps,
        "first_step_s": first_step_s,
        "peak_rss_mb": peak,
        "baseline_rss_mb": baseline_rss,
        "rss_increase_mb": max(peak - baseline_rss, 0.0),
        "peak_before_steps_mb": baseline_peak,
        "tensor_peak_mb": tensor_peak,
        "num_params": int(sum(int(np.prod(v.shape)) for v in model.trainable_variables)),
        **phase_medians(one_step),
    }
    device = accelerator()
    if device is not None:
        result["device_peak_mb"] = (
            tf.config.experimental.get_memory_info(device)["peak"] / 2**20
        )
    if method != "nonprivate":
        result.update(_noise_draw_times(model.trainable_variables, args.noise_multiplier))
    children.emit(result)
    return 0


def _noise_draw_times(variables, stddev, repeats=7):
    """Median seconds of one logical step's noise: tfdp's samplers against TF's.

    `noise_draw_s` and `tf_normal_draw_s`: tfdp's draw against TF's
    `stateless_normal`, which caps every draw at 5.68σ where tfdp's sampler
    does not (docs/PRIVACY.md, "Floating-point noise"). `noise_release_s`
    and `hardened_noise_release_s`: the whole release of a logical step
    (draw, add to the sums, divide; `tfdp.dp.noise.noisy_divided`), plain
    and hardened. The calls are interleaved, round by round, so that the
    machine's drift moves them alike.
    """
    # Here, not at the top: keeps TensorFlow out of the parent process and --help.
    import tensorflow as tf

    from tfdp.dp import noise as noise_lib

    shapes = [v.shape for v in variables]
    seed = tf.constant([1, 2], tf.int64)
    sums = [tf.Variable(tf.zeros(s)) for s in shapes]

    @tf.function
    def tfdp_draw(seed):
        zeros = [tf.zeros(s) for s in shapes]
        return [tf.reduce_sum(n) for n in noise_lib.gaussian_noise(zeros, stddev, seed)]

    @tf.function
    def tf_draw(seed):
        seeds = tf.random.experimental.stateless_split(seed, len(shapes))
        return [tf.reduce_sum(tf.random.stateless_normal(s, seeds[i], stddev=stddev))
                for i, s in enumerate(shapes)]

    def release(hardened_noise):
        @tf.function
        def fn(seed):
            return [tf.reduce_sum(r) for r in noise_lib.noisy_divided(
                sums, stddev, seed, 256.0, hardened_noise=hardened_noise)]
        return fn

    fns = {"noise_draw_s": tfdp_draw, "tf_normal_draw_s": tf_draw,
           "noise_release_s": release(False), "hardened_noise_release_s": release(True)}
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn(seed)
    for i in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            [t.numpy() for t in fn(seed + i)]
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}
