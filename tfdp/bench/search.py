"""Memory search: each method's largest physical batch under a memory budget.

With `--memory_budget_mb=M` the bench searches, for every method, the
largest physical batch whose peak memory fits in M MiB: the accelerator's
peak (`tf.config.experimental.get_memory_info`) when there is one, else
the child's peak RSS; `--search_memory=tensors` measures TensorFlow's
allocator peak on a CPU too, which is what decides the batch on an
accelerator (peak RSS adds the runtime and malloc's fragmentation, which a
CPU cannot reset between batches). Batches double from `--batch_size` in
one child (`run_search_child`) until one does not fit (over budget, out of
memory or killed), then `--search_refine` bisection steps, each in a fresh
child, narrow the gap (`search_largest_batch`).

Imports no TensorFlow at module level: the parent process, which spawns the
children, and `--help` never import it.
"""

import time

from tfdp.bench import children, models, runners


def run_search_child(args):
    """Peak memory at each of `--child_batches` (ascending), one marked line each.

    Stops at the first batch that does not fit `--memory_budget_mb` or runs
    out of accelerator memory. The accelerator's peak is reset per batch; a
    CPU's peak RSS cannot be, which is why the batches ascend (the peak at
    the largest batch so far is that batch's, give or take cached memory).
    """
    # Here, not at the top: keeps TensorFlow out of the parent process and --help.
    import tensorflow as tf

    method, jit = args.child_method, args.child_jit == "on"
    _, step = models.build_step(args)
    device = runners.accelerator()
    if device is not None and args.search_memory == "rss":
        raise SystemExit("--search_memory=rss measures a CPU's peak RSS; on an "
                         f"accelerator use 'tensors' or 'auto'. Received: device {device}")
    if device is None and args.search_memory == "tensors":
        device = "CPU:0"
    for batch_size in (int(b) for b in args.child_batches.split(",")):
        result = {"method": method, "jit_compile": jit, "batch_size": batch_size}
        try:
            if device is not None:
                tf.config.experimental.reset_memory_stats(device)
            one_step = runners.step_runner(args, step, batch_size)
            one_step()  # Traces.
            t0 = time.perf_counter()
            one_step()
            result["step_time_s"] = (time.perf_counter() - t0) / args.virtual_steps
        except tf.errors.ResourceExhaustedError:
            result["error"] = "out_of_memory"
            children.emit(result)
            return 0
        if device is not None:
            result["peak_mb"] = tf.config.experimental.get_memory_info(device)["peak"] / 2**20
            result["memory"] = f"TensorFlow allocator peak on {device}"
        else:
            result["peak_mb"] = runners.peak_rss_mb()
            result["memory"] = "peak RSS"
        result["fits"] = result["peak_mb"] <= args.memory_budget_mb
        children.emit(result)
        if not result["fits"]:
            return 0
    return 0


def search_largest_batch(probe, *, start, max_batch, budget_mb, refine=2):
    """The largest physical batch whose peak memory fits `budget_mb`.

    Doubles from `start` (one `probe` call for the whole ascending list,
    which stops at the first batch that does not fit), then bisects
    `refine` times between the largest fit and the first failure.

    Args:
        probe: callable. `probe(batches) -> (results, failure)`: `results`
            one dict per batch tried, in order, with "batch_size" and either
            "peak_mb" or "error"; `failure` a message or None.
        start: int. First batch tried.
        max_batch: int. Largest batch tried.
        budget_mb: float. The memory budget in MiB.
        refine: int. Bisection steps. Defaults to 2.

    Returns:
        A dict: "max_batch_size" (None when even `start` does not fit),
        "peak_mb" at it, "first_failure" (the smallest batch seen not to
        fit, or None), "reason" (why that batch did not fit) and
        "capped" (True when `max_batch` itself fitted).
    """
    state = {"max_batch_size": None, "peak_mb": None, "first_failure": None,
             "reason": None, "step_time_s": None}

    def record(results, failure):
        for r in results:
            fits = "error" not in r and r["peak_mb"] <= budget_mb
            b = r["batch_size"]
            if fits and (state["max_batch_size"] is None or b > state["max_batch_size"]):
                state.update(max_batch_size=b, peak_mb=r["peak_mb"],
                             step_time_s=r.get("step_time_s"))
            elif not fits and (state["first_failure"] is None or b < state["first_failure"]):
                state["first_failure"] = b
                state["reason"] = (
                    "out of memory" if "error" in r else
                    f"peak {r['peak_mb']:.0f} MiB > budget {budget_mb:.0f} MiB"
                )
        if failure is not None:
            reported = {r["batch_size"] for r in results}
            if state["first_failure"] is None or all(
                b <= (state["max_batch_size"] or 0) for b in reported
            ):
                # The child died on the batch after the last it reported.
                return failure
        return None

    batches = []
    b = start
    while b <= max_batch:
        batches.append(b)
        b *= 2
    if batches[-1] < max_batch:
        batches.append(max_batch)
    died = record(*probe(batches))
    if died is not None and state["first_failure"] is None:
        lo = state["max_batch_size"] or 0
        state["first_failure"] = next((b for b in batches if b > lo), None)
        state["reason"] = died
    for _ in range(refine):
        lo, hi = state["max_batch_size"], state["first_failure"]
        if lo is None or hi is None or hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        died = record(*probe([mid]))
        if died is not None and (state["first_failure"] is None or mid < state["first_failure"]):
            state["first_failure"], state["reason"] = mid, died
    state["capped"] = state["max_batch_size"] == max_batch
    return state


def search_method(args, method, jit, log):
    """`search_largest_batch` for one method, each probe a child process."""
    result = search_largest_batch(
        lambda batches: children.spawn(args, method, jit, log, batches=batches),
        start=args.batch_size, max_batch=args.max_batch_size,
        budget_mb=args.memory_budget_mb, refine=args.search_refine,
    )
    result.update(method=method, jit_compile=jit, model=args.model,
                  image_size=args.image_size, budget_mb=args.memory_budget_mb)
    if result["max_batch_size"] is None:
        leaner = children.LEANER_METHOD.get(method)
        result["error"] = (
            f"{method}: no batch from {args.batch_size} up was measured within "
            f"{args.memory_budget_mb:.0f} MiB ({result['reason']}); try a smaller --batch_size"
            + (f" or --methods={leaner}" if leaner else "")
        )
        log(f"[tfdp.bench] {result['error']}")
    return result
