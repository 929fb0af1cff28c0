"""`write_report`: one self-contained HTML page with a run's plots.

The trainer writes `report.html` into the workdir at the end of a run; any
finished or interrupted workdir can be (re)reported with

    python3 -m tfdp.report workdir/mnist_default

The page needs nothing but a browser: the plots are PNGs (matplotlib)
embedded in the file. It shows:
- ε against the logical steps, at the run's δ (from the privacy ledger);
- the privacy profile ε(δ) of the final model;
- test (and validation) accuracy against ε;
- the clip fraction and the gradient norms, labelled as not covered by ε;
- where `python3 -m tfdp.audit --workdir=WORKDIR` was run (its `audit.json`), its
  empirical lower bound on ε beside the accountant's upper bound;
- what `summary.json` lists under `not_covered_by_epsilon` besides the
  plotted figures: the exact counts of the private data (N, the validation
  and test counts) and the model's state set before training (adapted
  preprocessing statistics, loaded buffers), labelled as not covered by ε.

Everything on the page is what the run already wrote (its ledger,
`summary.json` and TensorBoard scalars): the report releases nothing new.
"""

import base64
import glob
import html
import io
import json
import math
import os
import sys

from tfdp.privacy import ledger as ledger_lib

REPORT_NAME = "report.html"
AUDIT_NAME = "audit.json"
NOT_COVERED = "not covered by ε"


def read_scalars(tensorboard_dir):
    """The scalars of a TensorBoard directory: `{tag: [(step, value), ...]}`.

    Args:
        tensorboard_dir: str. A directory of `events.out.tfevents.*` files.

    Returns:
        A dict from tag to its (step, value) pairs, sorted by step; a step
        written twice (a resumed run) keeps its last value.
    """
    import tensorflow as tf

    scalars = {}
    for path in sorted(glob.glob(os.path.join(tensorboard_dir, "**", "*tfevents*"),
                              recursive=True)):
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.HasField("tensor"):
                    array = tf.make_ndarray(value.tensor)
                    if array.size != 1 or array.dtype.kind not in "fiub":
                        continue  # Text summaries and histograms.
                    number = float(array.reshape(()))
                elif value.HasField("simple_value"):
                    number = float(value.simple_value)
                else:
                    continue
                scalars.setdefault(value.tag, {})[int(event.step)] = number
    return {tag: sorted(points.items()) for tag, points in scalars.items()}


def _figure_png(figure):
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _new_figure():
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    return plt.subplots(figsize=(6.4, 3.8))


def _close(figure):
    from matplotlib import pyplot as plt

    plt.close(figure)


def _epsilon_curve(ledger, points=40):
    steps = sorted({max(1, round(ledger.steps * i / points)) for i in range(1, points + 1)})
    return steps, [ledger.epsilon_after(s) for s in steps]


def _privacy_profile(record, points=25):
    """ε(δ) at the final step, for δ from 1e-12 up to min(1e-2, 1/N)."""
    n = record.get("dataset_size")
    top = min(1e-2, 1.0 / n) if n else 1e-2
    low = min(1e-12, top / 100)
    deltas = [10 ** (math.log10(low) + (math.log10(top) - math.log10(low)) * i / (points - 1))
              for i in range(points)]
    profile = []
    for delta in deltas:
        try:
            profile.append((delta, ledger_lib.PrivacyLedger.from_dict(
                {**record, "delta": delta}).epsilon()))
        except ValueError:  # δ outside what the accountant accepts for this N.
            continue
    return profile


def _section(title, caption, png):
    return (f'<section><h2>{html.escape(title)}</h2>'
            f'<img class="plot" alt="{html.escape(title)}" src="data:image/png;base64,{png}">'
            f'<p>{caption}</p></section>')


def _plots(record, summary, scalars, audit):
    sections = []
    ledger = ledger_lib.PrivacyLedger.from_dict(record) if record else None
    delta = record.get("delta") if record else None
    if ledger is not None and ledger.steps > 0:
        steps, epsilons = _epsilon_curve(ledger)
        figure, axes = _new_figure()
        axes.plot(steps, epsilons, color="tab:blue")
        axes.set_xlabel("logical steps")
        axes.set_ylabel(f"ε (δ = {delta:g})")
        axes.grid(alpha=0.3)
        sections.append(_section(
            "ε against steps",
            f"The accountant's ({html.escape(str(record.get('accountant')))}) upper bound "
            f"after each logical step, at δ = {delta:g}.", _figure_png(figure)))
        _close(figure)

        profile = _privacy_profile(record)
        if profile:
            figure, axes = _new_figure()
            axes.semilogx([d for d, _ in profile], [e for _, e in profile], color="tab:purple")
            axes.axvline(delta, color="gray", linestyle="--", label=f"run's δ = {delta:g}")
            axes.set_xlabel("δ")
            axes.set_ylabel("ε")
            axes.legend()
            axes.grid(alpha=0.3, which="both")
            sections.append(_section(
                "Privacy profile of the final model",
                f"Every (ε, δ) pair on this curve holds for the released model after "
                f"{ledger.steps} steps.", _figure_png(figure)))
            _close(figure)

    epsilon_at = dict(scalars.get("privacy/epsilon", []))
    test = scalars.get("test/accuracy", [])
    validation = scalars.get("non_dp/validation_accuracy", [])
    if test or validation:
        figure, axes = _new_figure()
        plotted = False
        for points, label, style in (
            (test, "test accuracy", "o-"),
            (validation, f"validation accuracy ({NOT_COVERED})", "s--"),
        ):
            pairs = [(epsilon_at[s], v) for s, v in points if s in epsilon_at]
            if pairs:
                axes.plot([e for e, _ in pairs], [v for _, v in pairs], style, label=label)
                plotted = True
        if plotted:
            axes.set_xlabel(f"ε (δ = {delta:g})" if delta else "ε")
            axes.set_ylabel("accuracy")
            axes.legend()
            axes.grid(alpha=0.3)
            held_out = (summary or {}).get("test_set_is_private")
            caption = "Accuracy after each epoch, against the ε spent by then."
            if held_out:
                caption += (f" The test set was held out from the private data: its "
                            f"accuracy is {NOT_COVERED}.")
            sections.append(_section("Accuracy against ε", caption, _figure_png(figure)))
        _close(figure)

    clip = scalars.get("non_dp/clipped_fraction", [])
    norm_tags = sorted(tag for tag in scalars
                       if tag.startswith("non_dp/") and "grad_norm" in tag)
    if clip or norm_tags:
        figure, axes = _new_figure()
        if clip:
            axes.plot([s for s, _ in clip], [v for _, v in clip], color="tab:red",
                      label="clipped fraction")
            axes.set_ylabel("fraction of examples clipped")
            axes.set_ylim(0, 1.05)
        if norm_tags:
            other = axes.twinx() if clip else axes
            for tag in norm_tags:
                points = scalars[tag]
                other.plot([s for s, _ in points], [v for _, v in points], alpha=0.8,
                           label=tag[len("non_dp/"):].replace("_", " "))
            other.set_ylabel("per-example gradient norm")
            other.set_yscale("log")
            if other is not axes:
                other.legend(loc="lower right")
        axes.set_xlabel("logical steps")
        if clip:
            axes.legend(loc="upper right")
        axes.grid(alpha=0.3)
        sections.append(_section(
            f"Clipping statistics ({NOT_COVERED})",
            "Computed from the private training examples without noise: these figures "
            f"are <strong>{NOT_COVERED}</strong>. "
            "<code>RunConfig.report_non_dp_statistics=False</code> turns them off.",
            _figure_png(figure)))
        _close(figure)

    if audit:
        try:  # The audit writes an infinite ε as the string "inf".
            lower, upper = float(audit["epsilon_lower"]), float(audit["accountant_epsilon"])
        except (KeyError, TypeError, ValueError):
            lower = upper = math.nan
        if math.isfinite(lower) and math.isfinite(upper):
            figure, axes = _new_figure()
            bars = axes.bar(["audit lower bound", "accountant upper bound"], [lower, upper],
                            color=["tab:orange", "tab:blue"])
            axes.bar_label(bars, fmt="%.3f")
            axes.set_ylabel(f"ε (δ = {audit.get('delta', delta)})")
            sections.append(_section(
                "Audit: empirical lower bound against the accountant",
                "The audit (Steinke et al. 2023, one run with canaries) bounds ε from below "
                f"at confidence {audit.get('confidence', 0.95):.2f}; a lower bound above the "
                "upper bound would mean a broken guarantee.", _figure_png(figure)))
            _close(figure)
    return sections


# The ledger's entries that are exact counts of the private data.
_PRIVATE_COUNTS = ("dataset_size",)


def _header(record, summary):
    rows = []
    if record and record.get("private", True) is not False:
        for name in ("sampler", "accountant", "noise_multiplier", "l2_norm_clip",
                     "sampling_rate", "dataset_size", "batch_size", "delta", "steps",
                     "neighboring_relation"):
            if record.get(name) is not None:
                label = f"{name} ({NOT_COVERED})" if name in _PRIVATE_COUNTS else name
                rows.append((label, record[name]))
        if (record.get("bands") or 1) > 1:
            # A banded run samples each example at b·B / N within its group:
            # the q that is accounted, beside the b and coefficients it rests on.
            rows += [(name, record[name]) for name in ("bands", "band_coefficients")
                     if record.get(name) is not None]
            if (summary or {}).get("sampling_probability") is not None:
                rows.append(("sampling_probability (within a group)",
                             summary["sampling_probability"]))
    for name in ("epsilon", "test_accuracy", "wall_time_s"):
        if summary and summary.get(name) is not None:
            rows.append((name, summary[name]))
    cells = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_format(v))}</td></tr>"
        for k, v in rows)
    guarantee = (summary or {}).get("privacy_guarantee")
    text = f"<p class=guarantee>{html.escape(str(guarantee))}</p>" if guarantee else ""
    return f"<table>{cells}</table>{text}{_not_covered(summary)}"


def _not_covered(summary):
    """The counts and the state set before training that `summary.json` labels."""
    entries = (summary or {}).get("not_covered_by_epsilon") or {}
    counts = [(name, entries[name]) for name in ("dataset_size", "validation_size")
              if entries.get(name) is not None]
    counts += [(name, value) for name, value in
               (entries.get("data_preparation") or {}).items()]
    adapted = entries.get("adapted_state") or []
    if not counts and not adapted:
        return ""
    parts = [f"<section><h2>{html.escape(f'Counts and state ({NOT_COVERED})')}</h2>"]
    if counts:
        cells = "".join(
            f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_format(v))}</td></tr>"
            for k, v in counts)
        parts.append("<p>Exact counts of the private data, released without noise: "
                     f"<strong>{NOT_COVERED}</strong>.</p><table>{cells}</table>")
    if adapted:
        items = "".join(
            f"<li><code>{html.escape(str(e.get('variable')))}</code>: "
            f"{html.escape(str(e.get('reason')))}</li>" for e in adapted)
        parts.append("<p>State the model held before training (adapted or loaded, not "
                     f"declared public): <strong>{NOT_COVERED}</strong> unless it came "
                     f"from public data.</p><ul>{items}</ul>")
    parts.append("</section>")
    return "".join(parts)


def _format(value):
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):  # A banded strategy's coefficients.
        return ", ".join(_format(v) for v in value)
    return str(value)


def _read_json(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_report(workdir, output=None):
    """Writes the HTML report of the run in `workdir`.

    Args:
        workdir: str. A trainer workdir (`checkpoints/`, `tensorboard/`,
            `summary.json`; any of them may be missing).
        output: str or None. The HTML file. Defaults to
            `WORKDIR/report.html`.

    Returns:
        The path written.

    Raises:
        ValueError: if `workdir` is not a directory.
    """
    if not os.path.isdir(workdir):
        raise ValueError(f"No such run directory. Received: workdir={workdir!r}")
    record = _read_json(os.path.join(workdir, "checkpoints", "privacy_ledger.json"))
    if record is not None and record.get("private") is False:
        record = None
    summary = _read_json(os.path.join(workdir, "summary.json"))
    audit = _read_json(os.path.join(workdir, AUDIT_NAME))
    tensorboard = os.path.join(workdir, "tensorboard")
    scalars = read_scalars(tensorboard) if os.path.isdir(tensorboard) else {}
    sections = _plots(record, summary, scalars, audit)
    title = f"tfdp run: {os.path.basename(os.path.abspath(workdir))}"
    body = "".join(sections) or "<p>No figures yet: the run has not finished an epoch.</p>"
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; max-width: 760px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
th, td {{ text-align: left; padding: 2px 12px 2px 0; }}
img.plot {{ max-width: 100%; }}
.guarantee {{ background: #f3f3f3; padding: 8px; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
{_header(record, summary)}
{body}
<script>
// Marks the page once every plot has decoded, for automated checks.
window.addEventListener("load", () => {{
  const plots = Array.from(document.querySelectorAll("img.plot"));
  document.body.dataset.plots = plots.length;
  document.body.dataset.rendered = plots.filter(i => i.complete && i.naturalWidth > 0).length;
}});
</script>
</body></html>
"""
    output = output or os.path.join(workdir, REPORT_NAME)
    with open(output, "w") as f:
        f.write(page)
    return output


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(
        prog="python3 -m tfdp.report",
        description="Writes WORKDIR/report.html: the plots of a training run.")
    parser.add_argument("workdir", help="the run's --workdir")
    parser.add_argument("--output", default=None,
                        help="the HTML file (default: WORKDIR/report.html)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.workdir, args.output)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
