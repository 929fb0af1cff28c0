"""Choosing among existing runs by validation accuracy: not accounted.

    python -m tfdp.tuning workdir/cifar10_vgg_noise_*

reads each run's `summary.json`, picks the run with the best
`validation_accuracy` (the split held out from the training data by
`DataConfig.validation_fraction`) and prints its test accuracy as the final
number. The test accuracy of the other runs is not shown: a setting chosen
by looking at test accuracy makes the test number optimistic.

The selection itself is computed from private data (the validation split)
without noise, so it spends privacy that no run's epsilon accounts for
(Papernot & Steinke 2022). The printed lines say so: each run's epsilon
covers that run only, and the epsilon of the released choice is not
accounted (`selection_guarantee`). `python -m tfdp.tuning --grid=...`
(`tfdp.tuning.private_selection`) runs a selection that is accounted.
"""

import dataclasses
import json
import os


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
            "rerun them with --gin_param='DataConfig.validation_fraction = 0.1'. "
            f"Received: runs without validation: {missing}"
        )
    return max(sorted(summaries), key=lambda w: validation_accuracy(summaries[w]))


def validation_accuracy(summary):
    """A run's validation accuracy from its summary.json dict, or None.

    It sits under `not_covered_by_epsilon`: the validation split is private
    data held out from training, evaluated without noise.
    """
    return summary.get("not_covered_by_epsilon", {}).get("validation_accuracy")


@dataclasses.dataclass(frozen=True)
class SelectionGuarantee:
    """What is claimed for the run released by a selection.

    Args:
        runs: int. K, the runs the selection looked at.
        run_epsilon: float. The selected run's own ε: it covers that run's
            training, not the choice among the K runs.
        run_delta: float or None. Its δ.
        epsilon: float or None. ε of the released choice, selection
            included; None while the selection is not accounted.
        delta: float or None. Its δ; None with `epsilon`.
    """

    runs: int
    run_epsilon: float
    run_delta: float = None
    epsilon: float = None
    delta: float = None

    def describe(self):
        """The statement that `report`'s final line ends with."""
        run_delta = "" if self.run_delta is None else f" delta={self.run_delta:g}"
        own = (f"the selected run's own epsilon={self.run_epsilon:.3f}{run_delta} covers "
               "that run only")
        if self.epsilon is not None:
            return (f"epsilon={self.epsilon:.3f} delta={self.delta:g} for the selection over "
                    f"{self.runs} runs ({own})")
        return (f"selected over {self.runs} runs by accuracy on private validation data: the "
                f"selection is NOT COVERED by epsilon ({own})")


def selection_guarantee(summaries, selected):
    """The guarantee of releasing `selected`, chosen among `summaries` by validation accuracy.

    The choice reads the private validation split of every run without
    noise, so it is not covered by any run's ε. It is not accounted here:
    the result's `epsilon` is None, and its statement says so.

    Args:
        summaries: dict. `{workdir: summary}` as written by `tfdp.train`.
        selected: str. The chosen workdir (`select_by_validation`).

    Returns:
        A `SelectionGuarantee`.
    """
    if selected not in summaries:
        raise ValueError(
            f"The selected run is not one of the runs. Received: selected={selected!r}")
    best = summaries[selected]
    return SelectionGuarantee(runs=len(summaries), run_epsilon=best["epsilon"],
                              run_delta=best.get("delta"))


def report(summaries, selected):
    """The lines `main` prints: every run's validation accuracy, the selection's test accuracy.

    The final line names what the selection costs: the selected run's ε
    is shown as that run's own, never as the ε of the released choice.
    """
    lines = ["run  validation_accuracy (private, not covered by epsilon)  epsilon (the run's "
             "own)  (selected by validation accuracy; test accuracy shown for the selected "
             "run only)"]
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
        f"final {test}; {selection_guarantee(summaries, selected).describe()}"
    )
    return lines
