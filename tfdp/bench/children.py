"""The bench's child processes: their command line, results and failures.

Every measurement runs in a child, `python -m tfdp.bench --child_method=...`,
so that its peak memory is its own. A child prints each result as one
marked JSON line (`emit`); the parent reads them back (`child_results`)
and, when a child fails (killed by the OOM killer, out of accelerator
memory, timed out), says so with a message naming a smaller batch or a
leaner method (`failure_message`), never silently.
"""

import json
import os
import subprocess
import sys

_MARKER = "TFDP_BENCH_RESULT "

# A method whose memory grows more slowly, to suggest when one runs out.
LEANER_METHOD = {
    "ghost": "mixed", "vectorized": "bk", "naive": "bk", "bk": "mixed", "mixed": "bk",
    "auto": "mixed",
}


def emit(result):
    """Prints `result` as one marked JSON line, for the parent to read (in a child)."""
    sys.stdout.write(_MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()


def child_results(stdout):
    """The results a bench child printed, one dict per marked line of `stdout`."""
    return [json.loads(line[len(_MARKER):]) for line in (stdout or "").splitlines()
            if line.startswith(_MARKER)]


def _child_command(args, method, jit, batch_size=None, batches=None, paired=False):
    """The child's argv: `args`' settings, and the method, XLA and batches to run."""
    command = [
        sys.executable, "-m", "tfdp.bench",
        f"--model={args.model}", f"--image_size={args.image_size}",
        f"--channels={args.channels}", f"--num_classes={args.num_classes}",
        f"--batch_size={batch_size or args.batch_size}", f"--steps={args.steps}",
        f"--warmup={args.warmup}", f"--l2_norm_clip={args.l2_norm_clip}",
        f"--noise_multiplier={args.noise_multiplier}",
        f"--weight_decay={args.weight_decay}", f"--virtual_steps={args.virtual_steps}",
        f"--child_method={method}", f"--child_jit={'on' if jit else 'off'}",
    ]
    if args.hardened_noise:
        command.append("--hardened_noise")
    if paired:
        command.append("--child_paired")
    if batches:
        command += [f"--child_batches={','.join(str(b) for b in batches)}",
                    f"--max_batch_size={max(batches)}",
                    f"--memory_budget_mb={args.memory_budget_mb}",
                    f"--search_memory={args.search_memory}"]
    return command


def failure_message(method, batch_size, *, returncode=None, out_of_memory=False,
                    timeout=None, detail=""):
    """One line saying why a child failed and what to try instead.

    Args:
        method: str. The method that failed.
        batch_size: int. Its physical batch.
        returncode: int or None. The child's exit status (-9: SIGKILL).
        out_of_memory: bool. The child reported a ResourceExhaustedError.
        timeout: float or None. Seconds after which the child was stopped.
        detail: str. The last line of the child's output, for other errors.
    """
    smaller = max(batch_size // 2, 1)
    leaner = LEANER_METHOD.get(method)
    fix = f"try --batch_size={smaller}" + (f" or --methods={leaner}" if leaner else "")
    if timeout is not None:
        return (f"{method} at batch {batch_size} timed out after {timeout:.0f}s: raise "
                f"--timeout or {fix}")
    if out_of_memory:
        return (f"{method} ran out of accelerator memory at batch {batch_size}: {fix}, or "
                "--memory_budget_mb to find the largest batch that fits")
    if returncode in (-9, 137):
        return (f"{method} was killed (SIGKILL, most likely the kernel's OOM killer: out of "
                f"host memory) at batch {batch_size}: {fix}, or --memory_budget_mb to find "
                "the largest batch that fits")
    return f"{method} at batch {batch_size} failed (exit {returncode}): {detail}"


def spawn(args, method, jit, log, batch_size=None, batches=None, paired=False,
          progress=None):
    """Runs one child; returns `(marked results, failure message or None)`.

    Its progress line (`log`) says what it measures, before it starts:
    a child takes from seconds to minutes. `progress` (e.g. "2/3") leads it.
    """
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    batch_size = batch_size or args.batch_size
    log(f"[tfdp.bench]{f' {progress}' if progress else ''} measuring {method}"
        f"{' paired with nonprivate' if paired else ''} (XLA {'on' if jit else 'off'}, "
        f"batch {','.join(str(b) for b in batches) if batches else batch_size}) ...")
    tried = max(batches) if batches else batch_size
    try:
        proc = subprocess.run(
            _child_command(args, method, jit, batch_size, batches, paired), capture_output=True,
            text=True, env=env, timeout=args.timeout,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        results = child_results(out)
        return results, failure_message(method, _next_batch(results, batches, tried),
                                        timeout=args.timeout)
    results = child_results(proc.stdout)
    if proc.returncode == 0 and results:
        return results, None
    text = (proc.stderr or "") + (proc.stdout or "")
    oom = "ResourceExhausted" in text or "out of memory" in text.lower()
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return results, failure_message(
        method, _next_batch(results, batches, tried), returncode=proc.returncode,
        out_of_memory=oom, detail=lines[-1][-300:] if lines else "no output",
    )


def _next_batch(results, batches, default):
    """The batch a child was on when it died: the first it did not report."""
    if not batches:
        return default
    return batches[min(len(results), len(batches) - 1)]


def measure(args, method, jit, log, progress=None):
    """Times `method` at `--batch_size` in one child: its result, or one with "error"."""
    results, failure = spawn(args, method, jit, log, progress=progress)
    if results and "error" not in results[0]:
        return results[0]
    if results and results[0]["error"] == "out_of_memory":
        failure = failure_message(method, args.batch_size, out_of_memory=True)
    log(f"[tfdp.bench] {failure}")
    return {"method": method, "jit_compile": jit, "error": failure}
