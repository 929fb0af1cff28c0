"""`python -m tfdp.tuning`: choosing a run by its accuracy on private validation data.

Private selection, accounted (Papernot & Steinke 2022):

    python -m tfdp.tuning --gin_file=gin/mnist_default.gin \\
        --gin_param='DataConfig.validation_fraction = 0.1' \\
        --grid='OptimizationConfig.base_lr=0.1,0.5,1.0' --mean_trials=4 --workdir=W

runs the trainer a secret, random number of times (Poisson with mean
--mean_trials, or --distribution=truncated_negative_binomial with --shape),
each trial on a setting drawn uniformly from the product of the --grid flags,
and releases only the trial of best validation accuracy, into W/selected/.
The final line gives the selection's epsilon and delta. Everything else in
W/ (the trials, their number, W/selection.json) is as private as the data.

Existing runs, NOT accounted:

    python -m tfdp.tuning workdir/run_a workdir/run_b ...

picks the run of best validation accuracy among finished runs and says that
the selection is not covered by any epsilon.
"""

import argparse
import sys

from tfdp import tensorflow_startup
from tfdp.tuning import existing_runs
from tfdp.tuning import private_selection
from tfdp.tuning import trial_count as trial_count_lib


def make_parser():
    parser = argparse.ArgumentParser(prog="python -m tfdp.tuning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdirs", nargs="*",
                        help="Existing runs to choose among (not accounted).")
    parser.add_argument("--gin_file", action="append", default=[],
                        help="The trainer's gin file(s), as for python -m tfdp.train.")
    parser.add_argument("--gin_param", action="append", default=[],
                        help="The trainer's gin bindings, applied before the grid's.")
    parser.add_argument("--grid", action="append", default=[],
                        help="BINDING=V1,V2,... (gin values); repeatable: the product grid.")
    parser.add_argument("--mean_trials", type=float,
                        help="Mean of the random number of trials (>= 1).")
    parser.add_argument("--distribution", default=trial_count_lib.POISSON,
                        choices=trial_count_lib.DISTRIBUTIONS,
                        help="Distribution of the number of trials. Default: poisson.")
    parser.add_argument("--shape", type=float, default=None,
                        help="Shape >= 0 of the truncated negative binomial (0: logarithmic, "
                             "1: geometric).")
    parser.add_argument("--workdir", help="W: trials in W/trial_<i>/, the release in "
                                          "W/selected/.")
    parser.add_argument("--seed", type=int, default=0,
                        help="The trainer's public --seed, the same in every trial (so the "
                             "same validation split).")
    return parser


def select_privately(args):
    """The private selection of `args`; returns the lines to print."""
    if args.workdirs:
        raise ValueError("Give either existing workdirs or a --grid to run, not both. "
                         f"Received: workdirs={args.workdirs}")
    missing = [flag for flag, value in (("--gin_file", args.gin_file),
                                        ("--mean_trials", args.mean_trials),
                                        ("--workdir", args.workdir)) if not value]
    if missing:
        raise ValueError(f"A private selection needs {', '.join(missing)}. "
                         f"Received: gin_file={args.gin_file}, mean_trials={args.mean_trials}, "
                         f"workdir={args.workdir!r}")
    trial_count = trial_count_lib.TrialCount(args.mean_trials, args.distribution, args.shape)
    grid = private_selection.parse_grid(args.grid)
    # The grid is checked as the trainer parses it, which imports TensorFlow.
    tensorflow_startup.import_tensorflow()
    print(f"private selection: a secret number of trials ~ {trial_count.describe()}, each of a "
          f"setting drawn uniformly from {len(private_selection.grid_settings(grid))} settings; "
          f"the trials and their number stay private in {args.workdir}", flush=True)
    record = private_selection.select_privately(
        gin_files=args.gin_file, gin_params=args.gin_param, grid=grid, trial_count=trial_count,
        workdir=args.workdir, seed=args.seed)
    if record["released"] is None:
        return [f"nothing released ({record['nothing_released']}); a new selection on the "
                "same data adds its epsilon to this one's"]
    test = record["test_accuracy"]
    return [
        f"selected setting: {record['setting']} (validation_accuracy="
        f"{record['validation_accuracy']:.4f} on the held-out validation split: those "
        "examples are not covered by epsilon)",
        f"released: {record['released']} (the selected trial's model and summary only)",
        f"final: {'' if test is None else f'test_accuracy={test:.4f} '}"
        f"epsilon={record['epsilon']:.4f} delta={record['delta']:g} for the selection "
        f"(best of a {trial_count.describe()} number of trials, {record['adjacency']} "
        f"adjacency, RDP); one run's own epsilon={record['run_epsilon']:.4f} covers one "
        "run only",
    ]


def main(argv=None):
    args = make_parser().parse_args(argv)
    private = args.grid or args.gin_file or args.mean_trials is not None or args.workdir
    try:
        if private:
            lines = select_privately(args)
        elif args.workdirs:
            summaries = existing_runs.read_summaries(args.workdirs)
            lines = existing_runs.report(summaries,
                                         existing_runs.select_by_validation(summaries))
        else:
            raise ValueError("Give existing workdirs, or --gin_file, --grid, --mean_trials and "
                             "--workdir for a private selection. Received: no arguments")
    except ValueError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0
