"""The ``pegrad`` command line.

Each subcommand is a pair of small functions: ``_add_<name>_parser`` declares
its arguments and ``_run_<name>`` runs it and returns the exit status. To add
one, write that pair and list the first in ``_SUBCOMMANDS``.

    pegrad demo [--out DIR] [--fast] [--epochs N] [--seed S]
    python -m per_example_grads.cli demo --fast
"""

from __future__ import annotations

import os

# Quiet TensorFlow's C++ logging. This only takes effect if TensorFlow has not
# been imported yet; importing ``per_example_grads`` (which happens before this
# module runs) already imports it, so the user's own environment setting, or
# a lazy package ``__init__``, decides what is printed at import time.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
from typing import Callable, Sequence  # noqa: E402

_Adder = Callable[["argparse._SubParsersAction"], None]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``pegrad`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``pegrad`` parser with every subcommand in ``_SUBCOMMANDS``."""
    parser = argparse.ArgumentParser(
        prog="pegrad",
        description="Per-example gradients for TensorFlow 2 / Keras 3.",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def _add_demo_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "demo",
        help="train a digits MLP and inspect its per-example gradient norms",
        description=(
            "Train a small MLP on the bundled digits, print per-class gradient "
            "norm statistics, the examples with the largest norms, and engine "
            "timings, and save a histogram of the norms."
        ),
    )
    p.add_argument(
        "--out", default="pegrad_out", metavar="DIR",
        help="folder for norms_histogram.png (default: %(default)s)",
    )
    p.add_argument(
        "--fast", action="store_true",
        help="1 epoch on a subset and fewer timing repeats (a few seconds)",
    )
    p.add_argument(
        "--epochs", type=_positive_int, default=None,
        help="training epochs (default: 15, or 1 with --fast)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    _quiet_tensorflow()
    from per_example_grads.demo import run_demo

    run_demo(args.out, epochs=args.epochs, fast=args.fast, seed=args.seed)
    return 0


def _quiet_tensorflow() -> None:
    """Silences TensorFlow's Python-side logger (retracing notes and the like)."""
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


_SUBCOMMANDS: tuple[_Adder, ...] = (_add_demo_parser,)


if __name__ == "__main__":
    raise SystemExit(main())
