"""Command line one-run privacy audit: `python -m tfdp.audit --help`."""

import argparse
import json
import math
import os
import sys

from tfdp import report
from tfdp.audit import run as run_lib

_DESCRIPTION = """\
One-run empirical privacy audit (Steinke, Nasr & Jagielski 2023) of tfdp's
DP-SGD. Trains the small convnet on MNIST digits plus m random-noise canaries
(each with a random label, each included with probability 1/2), guesses
membership from each canary's loss, and prints a lower bound on epsilon at
confidence 1 - beta beside the RDP accountant's epsilon for the same run.
With neither --noise_multiplier nor --target_epsilon, sigma is calibrated to
--target_epsilon=2."""


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(message)


def _number(kind, check, what):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if not check(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_POS_INT = _number(int, lambda v: v >= 1, "an integer >= 1")
_POS_FLOAT = _number(float, lambda v: v > 0, "a number > 0")
_NONNEG_FLOAT = _number(float, lambda v: v >= 0, "a number >= 0")
_UNIT = _number(float, lambda v: 0 < v < 1, "a number in (0, 1)")
_MOMENTUM = _number(float, lambda v: 0 <= v < 1, "a number in [0, 1)")
_INT = _number(int, lambda v: True, "an integer")


def _guess_counts(text):
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def build_parser():
    p = _Parser(prog="python -m tfdp.audit", description=_DESCRIPTION,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num_canaries", type=_POS_INT, default=1000, help="m (default 1000)")
    p.add_argument("--num_train", type=_POS_INT, default=500,
                   help="MNIST digits besides the canaries (default 500)")
    noise = p.add_mutually_exclusive_group()
    noise.add_argument("--noise_multiplier", type=_NONNEG_FLOAT, default=None,
                       help="sigma; 0 trains with clipping but no noise")
    noise.add_argument("--target_epsilon", type=_POS_FLOAT, default=None,
                       help="calibrate sigma to this RDP epsilon (default 2)")
    p.add_argument("--epochs", type=_POS_FLOAT, default=30.0, help="default 30")
    p.add_argument("--batch_size", type=_POS_INT, default=64,
                   help="expected Poisson batch size (default 64)")
    p.add_argument("--l2_norm_clip", type=_POS_FLOAT, default=1.0, help="C (default 1)")
    p.add_argument("--learning_rate", type=_POS_FLOAT, default=0.2, help="default 0.2")
    p.add_argument("--momentum", type=_MOMENTUM, default=0.9, help="default 0.9")
    p.add_argument("--delta", type=_UNIT, default=1e-5, help="default 1e-5")
    p.add_argument("--beta", type=_UNIT, default=0.05,
                   help="1 - confidence of the lower bound (default 0.05)")
    p.add_argument("--guess_counts", type=_guess_counts, default=None,
                   help="comma-separated total guess counts r to try (Bonferroni); "
                        "default 5%%,10%%,20%%,40%%,60%%,80%%,100%% of m")
    p.add_argument("--seed", type=_INT, default=0, help="default 0")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--workdir", default=None,
                   help="also write the result to WORKDIR/audit.json and its plot to "
                        "WORKDIR/report.html (a trainer workdir gets its report redone "
                        "with the audit beside the run's plots)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else "-inf" if value < 0 else "nan"
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _format(result):
    eps_up = result["accountant_epsilon"]
    up = "inf" if not math.isfinite(eps_up) else f"{eps_up:.4f}"
    lines = [
        f"run: N={result['dataset_size']} ({result['config']['num_train']} digits + "
        f"{result['num_included_canaries']} of {result['m']} canaries) "
        f"q={result['sampling_rate']:.4f} steps={result['steps']} "
        f"sigma={result['noise_multiplier']:.4f} C={result['config']['l2_norm_clip']} "
        f"test_accuracy={result['test_accuracy']:.4f}",
        f"canaries: train accuracy included={result['canary_accuracy_included']:.3f} "
        f"excluded={result['canary_accuracy_excluded']:.3f}",
        f"guesses: r={result['r']} ({result['num_positive_guesses']} in, "
        f"{result['num_negative_guesses']} out), correct v={result['v']}",
        f"audit: epsilon_lower={result['epsilon_lower']:.4f} "
        f"(confidence {result['confidence']:.2f}, delta={result['delta']:g}) "
        f"accountant_epsilon={up} (RDP, Poisson, delta={result['delta']:g}) "
        f"wall={result['wall_seconds']:.1f}s",
    ]
    if result["epsilon_lower"] > eps_up:
        lines.append("VIOLATION: the empirical lower bound exceeds the accountant's epsilon")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(argv)
    except _UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Read by TensorFlow's first import.

    target = args.target_epsilon
    if args.noise_multiplier is None and target is None:
        target = 2.0
    config = run_lib.AuditConfig(
        num_canaries=args.num_canaries, num_train=args.num_train, epochs=args.epochs,
        batch_size=args.batch_size, l2_norm_clip=args.l2_norm_clip,
        noise_multiplier=args.noise_multiplier, target_epsilon=target,
        delta=args.delta, beta=args.beta, learning_rate=args.learning_rate,
        momentum=args.momentum, seed=args.seed, guess_counts=args.guess_counts,
        verbose=not (args.quiet or args.json),
    )
    try:
        config.validate()
        result = run_lib.run_audit(config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(_jsonable(result), allow_nan=False))
    else:
        print(_format(result))
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        with open(os.path.join(args.workdir, report.AUDIT_NAME), "w") as f:
            json.dump(_jsonable(result), f, indent=2, allow_nan=False)
        path = report.write_report(args.workdir)
        if not args.json:
            print(f"wrote {os.path.join(args.workdir, report.AUDIT_NAME)} and {path}")
    return 0
