"""Choosing among the runs of a sweep by validation accuracy.

    python -m tfdp.tuning workdir/cifar10_vgg_noise_*

reads each run's `summary.json`, picks the run with the best
`validation_accuracy` (the split held out from the training data by
`train.validation_fraction`) and prints its test accuracy as the final
number. The test accuracy of the other runs is not shown: a setting chosen
by looking at test accuracy makes the test number optimistic.
"""

import argparse
import json
import os
import sys


def read_summaries(workdirs):
    """`{workdir: summary dict}` of the runs; a run without a summary is an error."""
    summaries = {}
    for workdir in workdirs:
        path = os.path.join(workdir, "summary.json")
        if not os.path.isfile(path):
            raise ValueError(f"A run of the sweep has no summary.json (did it finish?). "
                             f"Received: workdir={workdir!r}")
        with open(path) as f:
            summaries[workdir] = json.load(f)
    return summaries


def select_by_validation(summaries):
    """The workdir with the highest validation accuracy.

    Args:
        summaries: dict. `{workdir: summary}` as written by `tfdp.train`.

    Returns:
        The selected workdir (ties go to the first in sorted order).
    """
    if not summaries:
        raise ValueError("No runs to select from. Received: 0 workdirs")
    missing = sorted(w for w, s in summaries.items() if validation_accuracy(s) is None)
    if missing:
        raise ValueError(
            "Runs without a validation accuracy cannot be compared without the test set; "
            "rerun them with --gin_param='train.validation_fraction = 0.1'. "
            f"Received: runs without validation: {missing}"
        )
    return max(sorted(summaries), key=lambda w: validation_accuracy(summaries[w]))


def validation_accuracy(summary):
    """A run's validation accuracy from its summary.json dict, or None.

    It sits under `not_covered_by_epsilon`: the validation split is private
    data held out from training, evaluated without noise.
    """
    return summary.get("not_covered_by_epsilon", {}).get("validation_accuracy")


def report(summaries, selected):
    """The lines `main` prints: every run's validation accuracy, the selection's test accuracy."""
    lines = ["run  validation_accuracy  epsilon  (selected by validation accuracy; test "
             "accuracy shown for the selected run only)"]
    for workdir in sorted(summaries):
        s = summaries[workdir]
        mark = "  <- selected" if workdir == selected else ""
        lines.append(f"{workdir}  {validation_accuracy(s):.4f}  {s['epsilon']:.3f}{mark}")
    best = summaries[selected]
    test = f"test_accuracy={best['test_accuracy']:.4f}" if "test_accuracy" in best else (
        # A test set held out of the training data: private, evaluated without noise.
        f"test_accuracy={best['not_covered_by_epsilon']['test_accuracy']:.4f} (held out "
        "from training, not covered by epsilon)")
    lines.append(
        f"selected by validation accuracy: {selected} "
        f"(validation_accuracy={validation_accuracy(best):.4f}); "
        f"final {test} epsilon={best['epsilon']:.3f}"
    )
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdirs", nargs="+", help="Workdirs of the sweep's runs.")
    args = parser.parse_args(argv)
    try:
        summaries = read_summaries(args.workdirs)
        selected = select_by_validation(summaries)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(report(summaries, selected)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
