"""Tables: the ratios against non-private training and their text tables.

`add_ratios` sets each result's time and memory ratios against
"nonprivate" with the same `jit_compile`; `format_table` prints them.
`format_phase_table` reports the private step's overhead twice: per
physical batch (`accumulate`: per-example clipping) and per logical step
(`apply`: the noise, drawn once per logical step, and the update), the
latter also amortised over the 64 or 256 physical batches per logical step
of large-batch training. `format_search_table` prints the memory search's
largest batches.

Pure Python: no TensorFlow, no processes.
"""

_SEARCH_MEMORY = {
    "auto": "peak memory (the accelerator's allocator peak, else peak RSS)",
    "rss": "peak RSS",
    "tensors": "TensorFlow's allocator peak",
}


def format_search_table(results, budget_mb, search_memory="auto"):
    """A text table of `search.search_method` results, each batch against non-private's.

    Rows may come from several models (`results[i]["model"]`); step times
    are of one step at the row's largest batch, after its trace.
    """
    base = {(r.get("model"), r["jit_compile"]): r.get("max_batch_size") for r in results
            if r["method"] == "nonprivate"}
    header = (f"{'model':<13} {'method':<11} {'xla':<4} {'max batch':>9} {'x nonpriv':>9} "
              f"{'peak MiB':>9} {'step ms':>8} {'ms/ex':>6}  stopped by")
    lines = [f"largest physical batch within {budget_mb:.0f} MiB of "
             f"{_SEARCH_MEMORY[search_memory]}", header, "-" * len(header)]
    for r in results:
        head = f"{str(r.get('model', '-')):<13} {r['method']:<11} " \
               f"{'on' if r['jit_compile'] else 'off':<4}"
        if r.get("max_batch_size") is None:
            lines.append(f"{head} {'none':>9}  {r.get('error', '')}")
            continue
        b = base.get((r.get("model"), r["jit_compile"]))
        ratio = f"{r['max_batch_size'] / b:8.2f}x" if b else f"{'-':>9}"
        t = r.get("step_time_s")
        ms = "-" if t is None else f"{t * 1e3:.1f}"
        per = "-" if t is None else f"{t * 1e3 / r['max_batch_size']:.2f}"
        stop = ("--max_batch_size" if r["capped"] else
                f"{r['reason']} at {r['first_failure']}" if r["first_failure"] else "-")
        lines.append(f"{head} {r['max_batch_size']:>9} {ratio} {r['peak_mb']:>9.0f} "
                     f"{ms:>8} {per:>6}  {stop}")
    return "\n".join(lines)


def add_ratios(results):
    """Adds time/memory ratios against "nonprivate" with the same jit_compile."""
    base = {
        r["jit_compile"]: r for r in results
        if r["method"] == "nonprivate" and "error" not in r
    }
    for r in results:
        b = base.get(r["jit_compile"])
        ok = b is not None and "error" not in r
        r["separate_time_ratio"] = r["step_time_s"] / b["step_time_s"] if ok else None
        r["memory_ratio"] = r["peak_rss_mb"] / b["peak_rss_mb"] if ok else None
        r["cpu_time_ratio"] = (
            r["cpu_time_s"] / b["cpu_time_s"]
            if ok and r.get("cpu_time_s") and b.get("cpu_time_s") else None
        )
        r["tensor_peak_ratio"] = (
            r["tensor_peak_mb"] / b["tensor_peak_mb"]
            if ok and r.get("tensor_peak_mb") and b.get("tensor_peak_mb") else None
        )
        r["rss_increase_ratio"] = (
            r["rss_increase_mb"] / b["rss_increase_mb"]
            if ok and b["rss_increase_mb"] > 0 else None
        )
        if r["method"] == "nonprivate" and "error" not in r:
            r.setdefault("paired_time_ratio", 1.0)
        for key in ("step_time_s", "peak_rss_mb", "cpu_time_s", "rss_increase_mb",
                    "tensor_peak_mb", "paired_time_ratio"):
            r.setdefault(key, None)
        # The paired ratio where there is one: the separate processes' ratio
        # also holds the machine's drift between them.
        r["time_ratio"] = (r["paired_time_ratio"] if r["paired_time_ratio"] is not None
                           else r["separate_time_ratio"])
        _add_phase_overheads(r, b if ok else None)
    return results


# Physical batches per logical step at which `format_phase_table` reports the
# private step's cost: one (the whole noise draw and update on one batch), and
# the paper's accumulations (a logical batch of 2,048 or 8,192 examples in
# physical batches of 32).
BATCHES_PER_STEP = (1, 64, 256)


def amortised_ratio(batch, update, base_batch, base_update, batches_per_step):
    """Private over non-private time per physical batch, `batches_per_step` per step.

    A logical step of k physical batches costs k·batch + update, so per
    physical batch the ratio is (batch + update/k) / (base_batch + base_update/k).
    """
    k = float(batches_per_step)
    return (batch + update / k) / (base_batch + base_update / k)


def _add_phase_overheads(r, base):
    """Per-batch (clipping) and per-step (noise, update) overheads of `r` over `base`.

    From the paired child's phase medians where `r` has them (both steps
    measured in one process), else from the separate processes'.
    """
    r["batch_overhead_ratio"] = r["update_overhead_s"] = None
    r["amortised_time_ratios"] = {}
    if r.get("paired_batch_time_s") is not None:
        mine = (r["paired_batch_time_s"], r["paired_update_time_s"])
        theirs = (r["paired_nonprivate_batch_time_s"], r["paired_nonprivate_update_time_s"])
    elif base is not None and r.get("batch_time_s") and base.get("batch_time_s"):
        mine = (r["batch_time_s"], r["update_time_s"])
        theirs = (base["batch_time_s"], base["update_time_s"])
    else:
        return
    r["batch_overhead_ratio"] = mine[0] / theirs[0]
    r["update_overhead_s"] = mine[1] - theirs[1]
    r["amortised_time_ratios"] = {
        k: amortised_ratio(*mine, *theirs, k) for k in BATCHES_PER_STEP}


def format_phase_table(results):
    """The private step's overhead per physical batch and per logical step.

    One row per private method (non-private is the reference). `x batch`: a
    physical batch's time (forward, per-example clipping, gradient sum) over
    non-private's. `+update ms`: the extra time of the logical step's update
    (noise, division, optimizer step), drawn once per logical step. `x at
    k`: the whole cost per physical batch with k physical batches per
    logical step (`amortised_ratio`).
    """
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    header = (f"{'method':<11} {'xla':<4} {'batch ms':>9} {'x batch':>8} "
              f"{'update ms':>10} {'+update ms':>11} "
              + " ".join(f"{f'x at {k}':>9}" for k in BATCHES_PER_STEP))
    lines = [header, "-" * len(header)]
    for r in results:
        if r["method"] == "nonprivate" or "error" in r or r.get("batch_overhead_ratio") is None:
            continue
        paired = r.get("paired_batch_time_s") is not None
        batch = r["paired_batch_time_s"] if paired else r["batch_time_s"]
        update = r["paired_update_time_s"] if paired else r["update_time_s"]
        ratios = r["amortised_time_ratios"]
        lines.append(
            f"{r['method']:<11} {'on' if r['jit_compile'] else 'off':<4} "
            f"{batch * 1e3:9.1f} {r['batch_overhead_ratio']:7.2f}x "
            f"{update * 1e3:10.1f} {r['update_overhead_s'] * 1e3:+11.1f} "
            + " ".join(f"{fmt(ratios.get(k), '8.2f')}x" for k in BATCHES_PER_STEP))
    lines.append(
        "x batch: a physical batch (forward, clipping, gradient sum) over non-private's.\n"
        "+update ms: a logical step's update (noise, division, update) over non-private's.\n"
        "x at k: (batch + update/k) over non-private's, k physical batches per logical step.\n"
        "Phases from the paired child where it ran, else from the separate processes.")
    return "\n".join(lines)


def format_table(results):
    """A fixed-width text table of `results`."""

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    def ms(v):
        return None if v is None else v * 1000

    header = (
        f"{'method':<11} {'xla':<4} {'x time':>7} {'step ms':>9} {'x sep':>6} "
        f"{'tensors MB':>10} {'x tens':>6} "
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
            f"{fmt(r['time_ratio'], '6.2f')}x "
            f"{fmt(ms(r['step_time_s']), '9.1f')} {fmt(r['separate_time_ratio'], '5.2f')}x "
            f"{fmt(r['tensor_peak_mb'], '10.0f')} {fmt(r['tensor_peak_ratio'], '5.2f')}x "
            f"{fmt(r['peak_rss_mb'], '8.0f')} {fmt(r['memory_ratio'], '5.2f')}x "
            f"{fmt(r['rss_increase_mb'], '8.0f')} {fmt(r['rss_increase_ratio'], '6.2f')}x "
            f"{fmt(ms(r['cpu_time_s']), '8.1f')} {fmt(r['cpu_time_ratio'], '5.2f')}x"
        )
    private = [r for r in results if r["method"] != "nonprivate" and "error" not in r]
    paired = [r for r in private if r.get("paired_rounds")]
    if paired:
        lines.append(
            f"x time: steps alternated with non-private's in one process, median of "
            f"{paired[0]['paired_rounds']} rounds' ratios.\n"
            f"step ms, x sep, memory, cpu: one process per method, best of --repeats "
            f"(x sep also holds the machine's drift between processes)."
        )
        unpaired = [r["method"] for r in private if not r.get("paired_rounds")]
        if unpaired:
            lines.append(f"No paired timing for {', '.join(unpaired)} (see the log): "
                         f"x time is x sep there.")
    elif private:
        lines.append("x time: one process per method (no paired timing: one private method "
                     "by default, --no-paired, or the paired children failed: see the log), "
                     "best of --repeats; it also holds the machine's drift between processes. "
                     "--paired times each against non-private in one process.")
    return "\n".join(lines)


def format_row_line(result, nonprivate=None):
    """One line for `result` as soon as it is measured, before the final table.

    Args:
        result: dict. One child's result (or one with "error").
        nonprivate: dict or None. Non-private training's result with the
            same `jit_compile`, measured before, for the separate processes'
            time ratio.
    """
    head = f"[tfdp.bench] {result['method']} (XLA {'on' if result['jit_compile'] else 'off'})"
    if "error" in result:
        return f"{head}: ERROR {result['error']}"
    line = f"{head}: {result['step_time_s'] * 1e3:.1f} ms/step"
    if (nonprivate is not None and "error" not in nonprivate
            and result["method"] != "nonprivate"):
        line += f" ({result['step_time_s'] / nonprivate['step_time_s']:.2f}x non-private)"
    return line + f", peak RSS {result['peak_rss_mb']:.0f} MB"


def format_noise_draw(results):
    """tfdp's noise draw per logical step against TF's, and the hardened release's
    cost against the plain one's and the physical batch; or None without a draw."""
    draws = [r for r in results if "noise_draw_s" in r]
    if not draws:
        return None
    ours = min(r["noise_draw_s"] for r in draws)
    theirs = min(r["tf_normal_draw_s"] for r in draws)
    line = (
        f"noise draw per logical step ({draws[0]['num_params']:,} normals): "
        f"tfdp {ours * 1e3:.0f} ms (no cap below 9.49 sigma) against "
        f"tf.random.stateless_normal {theirs * 1e3:.0f} ms (capped at 5.68 sigma): "
        f"{ours / theirs:.2f}x"
    )
    releases = [r for r in draws if "hardened_noise_release_s" in r]
    if not releases:
        return line
    best = min(releases, key=lambda r: r["hardened_noise_release_s"])
    plain, hardened = best["noise_release_s"], best["hardened_noise_release_s"]
    extra = hardened - plain
    return line + (
        f"\nnoise release per logical step (draw, add, divide): {plain * 1e3:.0f} ms, "
        f"hardened {hardened * 1e3:.0f} ms ({hardened / plain:.1f}x): +{extra * 1e3:.0f} ms "
        f"per logical step, {extra / best['batch_time_s']:.2f}x one physical batch "
        f"({best['batch_time_s'] * 1e3:.0f} ms), {extra / (64 * best['batch_time_s']):.1%} "
        "of a logical step of 64"
    )
