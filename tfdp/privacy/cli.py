"""Command line privacy calculator: `python -m tfdp.privacy --help`."""

import argparse
import json
import math
import sys
import warnings

from tfdp import samplers
from tfdp.privacy import accounting
from tfdp.privacy import banded_mf
from tfdp.privacy import calibration
from tfdp.privacy import deltas
from tfdp.privacy import epsilon_tables

_DESCRIPTION = """\
Epsilon of a DP-SGD run, or the noise multiplier for a target epsilon.
Steps from epochs are ceil(epochs * steps per epoch): N / B for Poisson,
N // B for shuffle.
--sampler=poisson: Poisson-subsampled Gaussian per step, add/remove-one
adjacency.
--sampler=shuffle: fixed-size batches, each example once per pass, any
order: one Gaussian mechanism per pass, no amplification, under zero-out
adjacency (an example's slot left empty); the replace-one epsilon (sigma / 2
per pass) is printed too.
--bands=b (b > 1): banded matrix-factorization DP-SGD (sampler banded_poisson,
or banded_user_poisson for --sampler=user_poisson): the examples (users) are
split into b groups, step t samples group t mod b at
q = b*B/N, and epsilon is that of ceil(steps / b) Poisson-subsampled
Gaussians at that q. The model's noise (RMS prefix-sum error times sigma, in
units of C) is printed for the banded square root and optimized strategies."""


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    # argparse prints the usage block and exits; we want one `error:` line.
    def error(self, message):
        raise _UsageError(message)


def _int_at_least(minimum):
    """An argparse type: an integer >= `minimum`."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_nonnegative_int = _int_at_least(0)


def _finite_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number, got {text!r}"
        ) from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(
            f"expected a finite number, got {text}"
        )
    return value


def build_parser():
    parser = _Parser(
        prog="python -m tfdp.privacy",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--dataset_size", type=_positive_int, required=True, help="N"
    )
    parser.add_argument(
        "--batch_size",
        type=_positive_int,
        required=True,
        help="logical batch size B (expected size under Poisson)",
    )
    duration = parser.add_mutually_exclusive_group(required=True)
    duration.add_argument(
        "--epochs", type=_finite_float, help="steps = ceil(E * N / B)"
    )
    duration.add_argument(
        "--steps", type=_nonnegative_int, help="optimizer steps"
    )
    noise = parser.add_mutually_exclusive_group(required=True)
    noise.add_argument(
        "--noise_multiplier",
        type=_finite_float,
        help="effective sigma on the logical batch",
    )
    noise.add_argument(
        "--target_epsilon",
        type=_finite_float,
        help="calibrate the smallest sigma meeting this epsilon",
    )
    parser.add_argument(
        "--delta", type=_finite_float, default=None,
        help="delta of the guarantee (default: min(1e-5, the largest power of ten below "
             "1/N), as in the trainer and Keras)",
    )
    parser.add_argument(
        "--accountant", choices=("rdp", "pld", "both"), default="rdp"
    )
    parser.add_argument(
        "--sampler", choices=accounting.SAMPLERS, default="poisson"
    )
    parser.add_argument(
        "--bands", type=_positive_int, default=1,
        help="b: banded matrix factorization with b bands (sampler banded_poisson, or "
             "banded_user_poisson for users); 1 is DP-SGD (default)",
    )
    parser.add_argument(
        "--tolerance",
        type=_finite_float,
        default=1e-3,
        help="relative precision of a calibrated noise multiplier",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object"
    )
    return parser


def _json_float(value):
    # Strict JSON has no Infinity; null marks an unbounded epsilon.
    return None if math.isinf(value) else value


def compute(args):
    """Runs the accounting for parsed `args`; returns the result dict."""
    n, b = args.dataset_size, args.batch_size
    if args.delta is None:
        args.delta = deltas.default_delta(n)
    q, _, _ = accounting.resolve_sampling_rate(None, n, b)
    sampler_name, accounted = _accounted_sampler(args)
    if args.epochs is not None:
        steps = accounted.steps_for_epochs(args.epochs)
    else:
        steps = args.steps
    if args.accountant == "both":
        accountants = accounting.ACCOUNTANTS
    else:
        accountants = (args.accountant,)
    for acc in accountants:
        accounting.check_supported(acc, accounted)
    result = {
        "dataset_size": n,
        "batch_size": b,
        "epochs": args.epochs,
        "steps": steps,
        "sampling_rate": q,
        "sampler": sampler_name,
        "adjacency": accounting.adjacency(accounted),
        "adjacency_description": type(accounted).adjacency_description,
        "delta": args.delta,
        "accountant": args.accountant,
        "bands": args.bands,
    }
    if args.bands > 1:
        result["group_sampling_rate"] = accounted.group_sampling_rate
        result["rounds"] = accounted.unit_count(steps)
    # At b > 1 the banded sampler itself: its event is ceil(T/b) rounds at b*B/N.
    common = dict(dataset_size=n, batch_size=b,
                  sampler=accounted if args.bands > 1 else sampler_name)
    if args.target_epsilon is not None:
        # With both accountants, the larger sigma meets the target under
        # both, so that is the one reported and used below.
        calibrated = {
            acc: calibration.calibrate_noise(
                args.target_epsilon,
                args.delta,
                steps=steps,
                accountant=acc,
                tolerance=args.tolerance,
                **common,
            )
            for acc in accountants
        }
        sigma = max(calibrated.values())
        result["target_epsilon"] = args.target_epsilon
        result["tolerance"] = args.tolerance
        result["calibrated_noise_multiplier"] = calibrated
    else:
        sigma = args.noise_multiplier
    result["noise_multiplier"] = sigma
    if steps and args.bands > 1:
        result["noise_error"] = _noise_error(args.bands, steps, sigma)
    replace_one = type(accounted).replace_one_sensitivity
    for acc in accountants:
        result[f"epsilon_{acc}"] = accounting.epsilon(
            sigma, steps, args.delta, accountant=acc, **common
        )
        if replace_one is not None:
            result[f"epsilon_replace_one_{acc}"] = accounting.epsilon(
                sigma / replace_one, steps, args.delta, accountant=acc, **common
            )
    with warnings.catch_warnings():
        # The table sweeps fixed deltas; only --delta is worth a warning.
        warnings.simplefilter("ignore", UserWarning)
        result["epsilon_table"] = epsilon_tables.epsilon_table(
            sigma,
            steps,
            accounting.DEFAULT_DELTAS,
            accountant=args.accountant,
            **common,
        )
    for row in result["epsilon_table"]:
        row["sampler"] = sampler_name  # A name, not the banded sampler object.
    return result


def _accounted_sampler(args):
    """`(name, sampler)` of the run asked for: its banded form with b bands when b > 1."""
    if args.bands == 1:
        return args.sampler, samplers.make_sampler(
            args.sampler, dataset_size=args.dataset_size, logical_batch_size=args.batch_size)
    unit = samplers.sampler_class(args.sampler).privacy_unit
    name = samplers.resolve_name(args.sampler, privacy_unit=unit, bands=args.bands)
    return name, samplers.make_sampler(
        name, dataset_size=args.dataset_size, logical_batch_size=args.batch_size,
        bands=args.bands)


def _noise_error(bands, steps, sigma):
    """The model's noise per strategy: RMS prefix-sum error, and times σ (units of C)."""
    strategies = {"sqrt": banded_mf.square_root_coefficients(bands),
                  "optimized": banded_mf.optimized_coefficients(bands, steps)}
    out = {}
    for name, coefficients in strategies.items():
        error = banded_mf.prefix_sum_error(coefficients, steps)
        out[name] = {"coefficients": list(coefficients), "prefix_sum_error": error,
                     "noise": sigma * error}
    return out


def format_text(result):
    """Formats `compute`'s result as a readable report."""
    rows = [
        ("dataset_size (N)", f"{result['dataset_size']:,}"),
        ("batch_size (B)", f"{result['batch_size']:,}"),
    ]
    if result["epochs"] is not None:
        rows.append(("epochs", f"{result['epochs']:g}"))
    rows += [
        ("steps", f"{result['steps']:,}"),
        ("sampling_rate (q)", f"{result['sampling_rate']:.6g}"),
        ("sampler", f"{result['sampler']} ({result['adjacency']})"),
        ("adjacency", result["adjacency_description"]),
    ]
    if result["bands"] > 1:
        rows += [
            ("bands (b)", f"{result['bands']}"),
            ("q within a group", f"{result['group_sampling_rate']:.6g}"),
            ("rounds accounted", f"{result['rounds']:,}"),
        ]
    if "target_epsilon" in result:
        rows.append(("target_epsilon", f"{result['target_epsilon']:g}"))
        for acc, sigma in result["calibrated_noise_multiplier"].items():
            rows.append((f"calibrated sigma ({acc})", f"{sigma:.6g}"))
    rows += [
        ("noise_multiplier", f"{result['noise_multiplier']:.6g}"),
        ("delta", f"{result['delta']:g}"),
    ]
    for acc in accounting.ACCOUNTANTS:
        key = f"epsilon_{acc}"
        if key in result:
            shown = accounting.format_epsilon(result[key])
            rows.append((f"epsilon ({acc})", shown))
    for acc in accounting.ACCOUNTANTS:
        key = f"epsilon_replace_one_{acc}"
        if key in result:
            rows.append((f"replace-one epsilon ({acc})", accounting.format_epsilon(result[key])))
    for name, error in result.get("noise_error", {}).items():
        rows.append((f"noise, {name} (x C)",
                     f"{error['noise']:.4g} = sigma x prefix-sum error {error['prefix_sum_error']:.4g}"))
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines += ["", epsilon_tables.format_epsilon_table(result["epsilon_table"])]
    return "\n".join(lines)


def _to_json(result):
    out = dict(result)
    for key in ("epsilon_rdp", "epsilon_pld", "epsilon_replace_one_rdp",
                "epsilon_replace_one_pld"):
        if key in out:
            out[key] = _json_float(out[key])
    out["epsilon_table"] = [
        {
            k: (_json_float(v) if k.startswith("epsilon_") else v)
            for k, v in row.items()
        }
        for row in out["epsilon_table"]
    ]
    return json.dumps(out, allow_nan=False)


def main(argv=None, stdout=None, stderr=None):
    """Runs the CLI; returns the exit code (0 ok, 2 bad input)."""
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    try:
        args = build_parser().parse_args(argv)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = compute(args)
    except (_UsageError, ValueError) as e:
        message = " ".join(str(e).split())
        print(f"error: {message}", file=stderr)
        return 2
    seen = []
    for w in caught:
        text = str(w.message)
        if text not in seen:
            seen.append(text)
            print(f"warning: {text}", file=stderr)
    result["warnings"] = seen
    if args.json:
        print(_to_json(result), file=stdout)
    else:
        print(format_text(result), file=stdout)
    return 0
