"""The ``pegrad`` command line.

Each subcommand is a pair of small functions: ``_add_<name>_parser`` declares
its arguments and ``_run_<name>`` runs it and returns the exit status. To add
one, write that pair and list the first in ``_SUBCOMMANDS``.

    pegrad demo [--out DIR] [--fast] [--epochs N] [--seed S]
    pegrad demo --dp [--out DIR] [--fast] [--epochs N] [--seed S] [--target-epsilon E]
    pegrad epsilon --num-examples N --batch-size B (--epochs E | --steps T)
                   (--noise-multiplier S | --target-epsilon EPS) --delta D
                   [--accountant pld|rdp] [--sampling poisson|shuffle]
                   [--mechanism dp-sgd|bandmf|blt|bisr] [--bands K] [--buffers D] [--cycle-length b]
                   [--rows-per-user K] [--monte-carlo [--samples M] [--seed S]]
    pegrad mechanisms --num-examples N --batch-size B --steps T --target-epsilon EPS --delta D
                      [--bands K,...] [--blt-buffers D,...] [--bisr-bands P,...] [--monte-carlo]
                      [--accountant pld|rdp]
    pegrad diagnose [MODEL.keras DATA.npz] [--out DIR] [--fast] [--batch-size B]
    pegrad audit [--out DIR] [--fast] [--canaries gradient|input] [--num-canaries M]
                 [--target-epsilon E] [--epochs N] [--full-batch] [--significance A] [--seed S]
    python -m per_example_grads.apps.cli demo --fast

Failures. A command that fails prints no traceback for what it expects to
go wrong, and writes nothing:

* exit 2, the arguments: argparse's usage line, then one line
  ``pegrad COMMAND: error: MESSAGE``, for what parsing finds (a malformed
  or out-of-range value, a missing or conflicting option), before
  TensorFlow loads; just that one line for what is found after parsing: a
  file the command cannot use, an ``--out`` that cannot name a folder (an
  existing file, or under one), an epsilon the accounting cannot compute
  or meet for these inputs (``tables.InputError``, raised before training).
* exit 1, the system: one line ``pegrad COMMAND: error: MESSAGE`` when it
  refuses an output file or folder (no permission, a read-only file system,
  a full disk; ``tables.OutputError``). ``--out`` is tried before
  TensorFlow loads (``tables.check_output_folder``: created, a probe file
  written and removed, the folders it created removed again), so such a
  folder fails at once; a disk that fills during the run fails at the end.
* exit 130, interrupted (Ctrl-C): one line ``pegrad COMMAND: interrupted``.

Every output file is written under a temporary name in its folder and moved
into place only when all of the command's files are written
(``tables.write_files``), so a failure leaves no half-written file and no
partial set. Anything else is a bug, and shows its traceback.
"""

from __future__ import annotations

# Only the standard library here (``apps.tables`` uses nothing else):
# ``pegrad --help`` and usage errors must answer without importing
# TensorFlow (seconds, and C++ log lines). Each ``_run_*`` imports what it
# needs, after ``_tensorflow_quietly``.
import argparse
import contextlib
import os
import sys
from typing import Any, Callable, Iterator, Sequence

from per_example_grads.apps.tables import InputError, OutputError, check_output_folder, first_line

_Adder = Callable[["argparse._SubParsersAction"], None]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``pegrad`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    try:
        with _tensorflow_quietly():
            return args.run(args)
    except InputError as e:
        return _error(args.parser, e, 2)
    except OutputError as e:
        return _error(args.parser, e, 1)
    except KeyboardInterrupt:
        print(f"{args.parser.prog}: interrupted", file=sys.stderr)
        return 130


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
            "timings, and save a histogram of the norms. With --dp: train it "
            "with DP-SGD at a target epsilon and without privacy, compare the "
            "test accuracies, and save a plot of both runs."
        ),
    )
    p.add_argument(
        "--dp",
        action="store_true",
        help="the private demo: DP-SGD against non-private training",
    )
    p.add_argument(
        "--out",
        default="pegrad_out",
        metavar="DIR",
        help="folder for norms_histogram.png, or dp_training.png with --dp (default: %(default)s)",
    )
    p.add_argument(
        "--fast",
        action="store_true",
        help="1 epoch on a subset and fewer timing repeats (a few seconds); with --dp: 5 epochs",
    )
    p.add_argument(
        "--epochs",
        type=_positive_int,
        default=None,
        help="training epochs (default: 15, or 1 with --fast; with --dp: 30, or 5 with --fast)",
    )
    p.add_argument("--seed", type=_seed, default=0, help="random seed (default: %(default)s)")
    p.add_argument(
        "--target-epsilon",
        type=_positive_float,
        default=None,
        metavar="E",
        help="with --dp: the privacy budget epsilon, at delta = 1e-5 (default: 8)",
    )
    p.set_defaults(run=_run_demo, parser=p)


def _run_demo(args: argparse.Namespace) -> int:
    if args.target_epsilon is not None and not args.dp:
        args.parser.error("--target-epsilon needs --dp")
    check_output_folder(args.out)  # before TensorFlow loads; the demos check again for other callers
    _start_tensorflow(report_device=True)
    if args.dp:
        from per_example_grads.apps.dp_demo import DEFAULT_TARGET_EPSILON, run_dp_demo

        target = DEFAULT_TARGET_EPSILON if args.target_epsilon is None else args.target_epsilon
        run_dp_demo(args.out, target_epsilon=target, epochs=args.epochs, fast=args.fast, seed=args.seed)
        return 0
    from per_example_grads.apps.demo import run_demo

    run_demo(args.out, epochs=args.epochs, fast=args.fast, seed=args.seed)
    return 0


@contextlib.contextmanager
def _tensorflow_quietly() -> Iterator[None]:
    """Raises the Python logger ``tensorflow`` to ERROR while a command runs.

    That hides retracing notes and the like; the level is restored after the
    command, so that ``main()`` called from a program leaves that program's
    logging as it was.
    """
    import logging

    logger = logging.getLogger("tensorflow")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _start_tensorflow(*, report_device: bool) -> None:
    """Imports TensorFlow without its start-up notices; optionally says where it runs.

    ``TF_CPP_MIN_LOG_LEVEL=2`` (unless the user set it: their setting wins)
    hides TensorFlow's C++ INFO and WARNING lines; errors still show. The
    notices absl prints before TensorFlow reads that setting, and the cuInit
    failure of a machine without a usable GPU, are filtered out of the import
    (``per_example_grads._core.quiet.import_tensorflow_filtered``) unless the level
    is 0; a line naming the device replaces the latter.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from per_example_grads._core.quiet import STARTUP_NOTICES, import_tensorflow_filtered

    verbose = os.environ["TF_CPP_MIN_LOG_LEVEL"].strip() == "0"
    tf, gpus = import_tensorflow_filtered(() if verbose else STARTUP_NOTICES)
    if report_device:
        where = f"{len(gpus)} GPU(s)" if gpus else "the CPU (TensorFlow found no usable GPU)"
        print(f"TensorFlow {tf.__version__} on {where}.")


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


MAX_SEED = 2**32 - 1  # numpy's legacy seeding, which keras.utils.set_random_seed calls, takes no more


def _seed(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_SEED}]; got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def _add_epsilon_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "epsilon",
        help="the epsilon of a DP-SGD run, or the noise multiplier for a target epsilon",
        description=(
            "Privacy accounting for DP-SGD (example-level, add/remove-one, "
            "through Google's dp_accounting). With --noise-multiplier, print "
            "the epsilon spent; with --target-epsilon, print the smallest "
            "noise multiplier that stays within it. The sampling probability "
            "is q = batch size / examples and the steps ceil(epochs / q)."
        ),
    )
    p.add_argument("--num-examples", type=_positive_int, required=True, metavar="N", help="training examples N")
    p.add_argument(
        "--batch-size", type=_positive_float, required=True, metavar="B", help="(expected) batch size B; q = B / N"
    )
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--epochs", type=_positive_float, metavar="E", help="epochs of training")
    length.add_argument("--steps", type=_positive_int, metavar="T", help="training steps (instead of --epochs)")
    goal = p.add_mutually_exclusive_group(required=True)
    goal.add_argument(
        "--noise-multiplier",
        type=_non_negative_float,
        metavar="SIGMA",
        help="noise std / clip norm; print the epsilon spent",
    )
    goal.add_argument(
        "--target-epsilon",
        type=_positive_float,
        metavar="EPS",
        help="print the noise multiplier needed for this epsilon",
    )
    p.add_argument(
        "--delta", type=_probability, required=True, metavar="D", help="delta in (0, 1), much smaller than 1/N"
    )
    p.add_argument(
        "--accountant",
        choices=("pld", "rdp"),
        default="pld",
        help="privacy loss distributions (tighter) or Renyi DP (default: %(default)s)",
    )
    p.add_argument(
        "--sampling",
        choices=("poisson", "shuffle"),
        default="poisson",
        help="how batches are drawn; 'shuffle' is accounted as Poisson, a "
        "heuristic without a proven bound (default: %(default)s)",
    )
    p.add_argument(
        "--mechanism",
        choices=tuple(_TAKES),
        default="dp-sgd",
        help="the noise: DP-SGD's independent noise, or correlated noise (peg.dp.BandMF, BLT, BISR), each "
        "accounted as DPModel accounts it, on cyclic Poisson batches (default: %(default)s)",
    )
    p.add_argument("--bands", type=_positive_int, metavar="K", help="bandmf, bisr: bands of the mechanism")
    p.add_argument("--buffers", type=_positive_int, metavar="D", help="blt: buffers of the mechanism")
    p.add_argument(
        "--cycle-length",
        type=_positive_int,
        metavar="b",
        help="correlated noise: poisson_batches(cycle_length=b), the least steps between an example's turns "
        "(q = b B / N); default --bands for bandmf and bisr, required for blt",
    )
    p.add_argument(
        "--truncated-batch-size",
        type=_positive_int,
        metavar="M",
        help="dp-sgd: truncated Poisson sampling (peg.dp.truncated_poisson_batches): a batch of more than M "
        "examples keeps M of them at random, accounted by its own event (rdp: by a looser one)",
    )
    p.add_argument(
        "--rows-per-user",
        type=_positive_int,
        metavar="K",
        help="dp-sgd: print epsilon per user instead, for rows sampled and clipped one by one on data where no "
        "user has more than K rows (a mixture of Gaussians; rdp: by a looser event); with --target-epsilon, "
        "the noise multiplier for that epsilon per user",
    )
    p.add_argument(
        "--monte-carlo",
        action="store_true",
        help="also print epsilon with the amplification of each example's random part, by Monte Carlo "
        "(peg.dp.monte_carlo_epsilon; with --target-epsilon, the noise multiplier for it and the certifying draw: "
        "peg.dp.monte_carlo_noise_multiplier; poisson sampling)",
    )
    p.add_argument(
        "--samples",
        type=_positive_int,
        metavar="M",
        help="--monte-carlo: draws of each side (default: the least that states delta, 60-120 / delta)",
    )
    p.add_argument("--seed", type=int, metavar="S", help="--monte-carlo: seed of the draws (default: 0)")
    p.set_defaults(run=_run_epsilon, parser=p)


# --mechanism: the options each takes, and those it needs (a correlated mechanism's cycle defaults to --bands)
_TAKES = {
    "dp-sgd": (),
    "bandmf": ("bands", "cycle_length"),
    "blt": ("buffers", "cycle_length"),
    "bisr": ("bands", "cycle_length"),
}
_NEEDS = {"dp-sgd": (), "bandmf": ("bands",), "blt": ("buffers", "cycle_length"), "bisr": ("bands",)}


def _mechanism_of(args: argparse.Namespace, steps: int, cycle: int) -> Any:
    """The ``peg.dp`` mechanism ``--mechanism`` names for a run of ``steps`` steps on ``cycle``, or None for DP-SGD."""
    if args.mechanism == "dp-sgd":
        return None
    from per_example_grads.dp.bisr import BISR  # TensorFlow and Keras: only where a mechanism is named
    from per_example_grads.dp.mechanisms import BLT, BandMF

    if args.mechanism == "bandmf":
        return BandMF(args.bands, steps, cycle_length=cycle)
    if args.mechanism == "bisr":
        return BISR(args.bands, steps, cycle_length=cycle)
    return BLT(args.buffers, steps, cycle_length=cycle)


def _check_mechanism_options(args: argparse.Namespace) -> int:
    """The cycle ``--mechanism`` samples with (1 for DP-SGD); a usage error for options it lacks or does not take."""
    for name in ("bands", "buffers", "cycle_length"):
        flag = "--" + name.replace("_", "-")
        takers = [m for m, options in _TAKES.items() if name in options]
        if getattr(args, name) is not None and args.mechanism not in takers:
            args.parser.error(f"{flag} needs --mechanism {' or '.join(takers)}")
        if name in _NEEDS[args.mechanism] and getattr(args, name) is None:
            args.parser.error(f"--mechanism {args.mechanism} needs {flag}")
    if args.mechanism == "dp-sgd":
        return 1
    return args.cycle_length if args.cycle_length is not None else args.bands


def _run_epsilon(args: argparse.Namespace) -> int:
    import warnings

    if args.batch_size > args.num_examples:
        args.parser.error(f"--batch-size ({args.batch_size:g}) must be <= --num-examples ({args.num_examples})")
    cycle = _check_mechanism_options(args)
    if args.rows_per_user is not None:
        if args.mechanism != "dp-sgd":
            args.parser.error("--rows-per-user needs --mechanism dp-sgd (independent noise)")
    if args.truncated_batch_size is not None:
        for wrong, message in (
            (args.mechanism != "dp-sgd", "needs --mechanism dp-sgd (independent noise)"),
            (args.sampling != "poisson", "needs --sampling poisson"),
            (args.rows_per_user is not None, "accounts per example, not with --rows-per-user"),
            (args.monte_carlo, "is accounted by its own event, not with --monte-carlo"),
        ):
            if wrong:
                args.parser.error(f"--truncated-batch-size {message}")
    if not args.monte_carlo and (args.samples is not None or args.seed is not None):
        args.parser.error("--samples and --seed need --monte-carlo")
    if args.monte_carlo:
        for wrong, message in (
            (args.rows_per_user is not None, "accounts per example, not with --rows-per-user"),
            (args.sampling != "poisson", "needs --sampling poisson (the random parts of cyclic Poisson sampling)"),
            (args.noise_multiplier == 0, "needs --noise-multiplier > 0"),
        ):
            if wrong:
                args.parser.error(f"--monte-carlo {message}")
    if args.mechanism != "dp-sgd":
        _start_tensorflow(report_device=False)  # a mechanism is a Keras layer: TensorFlow, without its notices
    from per_example_grads.dp import accounting  # dp_accounting only: no TensorFlow (unless a mechanism is named)

    run = dict(
        num_examples=args.num_examples,
        batch_size=args.batch_size,
        epochs=args.epochs,
        steps=args.steps,
        accountant=args.accountant,
        sampling=args.sampling,
    )
    # What the accounting refuses, or cannot represent, is these inputs' fault.
    try:
        q, steps = accounting.dp_sgd_schedule(
            args.num_examples, args.batch_size, args.epochs, args.steps, None, cycle_length=cycle
        )
        run["mechanism"] = mechanism = _mechanism_of(args, steps, cycle)
        if args.rows_per_user is not None:
            run["rows_per_user"] = args.rows_per_user
        if args.truncated_batch_size is not None:
            run["truncated_batch_size"] = args.truncated_batch_size
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if args.target_epsilon is None:
                sigma = args.noise_multiplier
            else:
                sigma = _rounded_up(accounting.noise_multiplier_for_epsilon(args.target_epsilon, args.delta, **run))
            epsilon = accounting.compute_epsilon(noise_multiplier=sigma, delta=args.delta, **run)
            if args.monte_carlo:
                from per_example_grads.dp import monte_carlo

                seed = 0 if args.seed is None else args.seed
                amplified_run = dict(
                    delta=args.delta,
                    sampling_probability=q,
                    samples=args.samples,
                    seed=seed,
                    progress=sys.stderr.isatty(),
                )
                coefficients = [1.0] if mechanism is None else mechanism
                if args.target_epsilon is None:
                    amplified = monte_carlo.monte_carlo_epsilon(coefficients, sigma, steps, **amplified_run)
                else:
                    calibrated = monte_carlo.monte_carlo_noise_multiplier(
                        coefficients, args.target_epsilon, steps, **amplified_run
                    )
                    amplified = calibrated.certificate
    except (ValueError, OverflowError) as e:
        raise InputError(first_line(e)) from e
    except MemoryError as e:  # the PLD accountant's arrays grow with the steps
        raise InputError(
            f"the {args.accountant} accountant ran out of memory for these inputs ({first_line(e)})"
        ) from e
    for message in dict.fromkeys(str(w.message) for w in caught):
        print(f"warning: {message}", file=sys.stderr)
    # The accountant that gave epsilon: RDP where PLD was past its cost bounds.
    fell_back = any(issubclass(w.category, accounting.AccountantFallbackWarning) for w in caught)
    answered = "rdp" if fell_back else args.accountant

    length = f"{args.epochs:g} epochs" if args.steps is None else "given"
    if cycle > 1:
        sampling = f"cycle {cycle} x batch size {args.batch_size:g} / {args.num_examples} examples, cyclic {args.sampling} sampling"
    elif args.truncated_batch_size is not None:
        sampling = (
            f"batch size {args.batch_size:g} / {args.num_examples} examples, Poisson sampling truncated to "
            f"{args.truncated_batch_size} rows"
        )
    else:
        sampling = f"batch size {args.batch_size:g} / {args.num_examples} examples, {args.sampling} sampling"
    print(f"sampling probability q = {q:.6g} ({sampling})")
    print(f"steps = {steps} ({length})")
    if mechanism is not None:
        print(f"mechanism = {_describe_mechanism(mechanism)}")
    per = "" if args.rows_per_user is None else f" per user of at most {args.rows_per_user} rows"
    if args.target_epsilon is not None:
        print(
            f"noise multiplier = {sigma:.6g} for epsilon <= {args.target_epsilon:g}{per} at delta = {args.delta:g} ({args.accountant} accountant)"
        )
    print(
        f"epsilon = {epsilon:.6g}{per} at delta = {args.delta:g} with noise multiplier {sigma:g} ({answered} accountant)"
    )
    if args.monte_carlo and args.target_epsilon is not None:
        print(
            f"noise multiplier = {_rounded_up(calibrated.noise_multiplier):.6g} for epsilon <= {args.target_epsilon:g} "
            f"at delta = {args.delta:g} by Monte Carlo, each example's part random (pilot "
            f"{calibrated.pilot_noise_multiplier:.6g}; certification {calibrated.certifications} of at most 3)"
        )
    if args.monte_carlo:
        drawn = f"seed {seed}" if args.target_epsilon is None else f"seed {amplified.seed}, drawn from --seed {seed}"
        bounded = f"; losses bounded within {amplified.loss_slack:.2g} nats" if amplified.loss_slack else ""
        print(
            f"epsilon = {amplified.epsilon:.6g} at delta = {amplified.delta:.6g} by Monte Carlo, each example's "
            f"part random ({amplified.samples} draws of each side, {drawn}; base delta "
            f"{amplified.base_delta:.6g}{bounded})"
        )
    return 0


def _rounded_up(sigma: float) -> float:
    """``sigma`` to 6 significant digits, rounded up: the printed value itself meets a target (more noise)."""
    import math

    scale = 10 ** (5 - math.floor(math.log10(sigma)))
    return math.ceil(sigma * scale) / scale


def _describe_mechanism(mechanism: Any) -> str:
    """``"BandMF(bands=4, num_steps=600, cycle_length=4)"``: the class and its configuration."""
    config = {k: v for k, v in mechanism.get_config().items() if k not in ("name", "theta", "omega")}
    return f"{type(mechanism).__name__}({', '.join(f'{k}={v}' for k, v in config.items())})"


def _positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0; got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0; got {text}")
    return value


def _probability(text: str) -> float:
    value = _float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1); got {text}")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be finite; got {text}")
    return value


def _add_mechanisms_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "mechanisms",
        help="rank DP-SGD, BandMF, BLT and BISR for a planned run by their noise at a target epsilon",
        description=(
            "Calibrate DP-SGD, BandMF at several band counts, BLT (and BISR if asked) to --target-epsilon, each on "
            "the batches it would train on, and print them ranked by the noise they leave in the run's running sums "
            "(sigma ||A C^-1||_F / sqrt(steps); peg.dp.rank_mechanisms), least first, with the sampling and "
            "noise multiplier to train each with. A guide for SGD with or without momentum; with Adam, use "
            "DP-SGD."
        ),
    )
    p.add_argument("--num-examples", type=_positive_int, required=True, metavar="N", help="training examples N")
    p.add_argument("--batch-size", type=_positive_int, required=True, metavar="B", help="expected batch size B")
    p.add_argument("--steps", type=_positive_int, required=True, metavar="T", help="planned training steps")
    p.add_argument("--target-epsilon", type=_positive_float, required=True, metavar="EPS", help="the run's epsilon")
    p.add_argument(
        "--delta", type=_probability, required=True, metavar="D", help="delta in (0, 1), much smaller than 1/N"
    )
    p.add_argument(
        "--bands",
        type=_int_list,
        metavar="K,...",
        help="BandMF's band counts, each at most N / B and T (default: the powers of two up to both)",
    )
    p.add_argument(
        "--blt-buffers",
        type=_int_list,
        metavar="D,...",
        help="BLT's buffer counts, on whole parts ('' for none; default: 2 if T >= N / B, else none)",
    )
    p.add_argument(
        "--bisr-bands",
        type=_int_list,
        default=(),
        metavar="P,...",
        help="BISR's band counts, on whole parts as BLT (default: none)",
    )
    p.add_argument(
        "--monte-carlo",
        action="store_true",
        help="calibrate BLT and BISR by Monte Carlo, each example's part random (minutes each), not the ledger",
    )
    p.add_argument(
        "--accountant", choices=("pld", "rdp"), default="pld", help="the ledger's accountant (default: %(default)s)"
    )
    p.set_defaults(run=_run_mechanisms, parser=p)


def _int_list(text: str) -> list[int]:
    return [_positive_int(t) for t in text.split(",") if t.strip()]


def _run_mechanisms(args: argparse.Namespace) -> int:
    import warnings

    _start_tensorflow(report_device=False)  # the mechanisms are Keras layers
    from per_example_grads.dp.planning import rank_mechanisms

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # tensorflow-probability's first use warns of its own distutils use: not this run's
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        try:
            ranked = rank_mechanisms(
                args.target_epsilon, args.delta, args.num_examples, args.batch_size, args.steps,
                bands=args.bands, blt_buffers=args.blt_buffers, bisr_bands=args.bisr_bands,
                monte_carlo=args.monte_carlo, accountant=args.accountant, progress=sys.stderr.isatty(),
            )  # fmt: skip
        except (ValueError, OverflowError) as e:
            raise InputError(first_line(e)) from e
    for message in dict.fromkeys(str(w.message) for w in caught):
        print(f"warning: {message}", file=sys.stderr)
    print(
        f"epsilon <= {args.target_epsilon:g} at delta = {args.delta:g}, {args.num_examples} examples, "
        f"expected batch {args.batch_size}, {args.steps} steps; least noise first:"
    )
    print(f"{'rank':>4}  {'mechanism':<11} {'cycle':>5}  {'q':>8}  {'noise mult.':>11}  {'error':>9}  accounting")
    for i, c in enumerate(ranked, 1):
        print(
            f"{i:>4}  {c.name:<11} {c.cycle_length:>5}  {c.sampling_probability:>8.4g}  "
            f"{_rounded_up(c.noise_multiplier):>11.6g}  {c.error:>9.4g}  {c.accounting}"
        )
    best = ranked[0]
    print(
        f"train the first: peg.dp.poisson_batches(x, y, sampling_probability={best.sampling_probability:.6g}, "
        f"cycle_length={best.cycle_length}, steps={args.steps}) and peg.keras.DPModel(..., "
        f"noise_multiplier={_rounded_up(best.noise_multiplier):.6g}, mechanism={_describe_mechanism(best.mechanism)})"
    )
    return 0


def _add_diagnose_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "diagnose",
        help="gradient statistics of a model on data: noise scale, variance, GSNR, top examples",
        description=(
            "Stream over DATA.npz (arrays x, y) and report the model's gradient "
            "statistics: trace of the per-example gradient covariance, GSNR per "
            "variable, per-example norms, the gradient noise scale B_simple and "
            "a suggested batch size. Writes report.json, report.png and "
            "norms_histogram.png. With no MODEL/DATA, trains the demo's digits "
            "MLP briefly and diagnoses it on the shipped digits."
        ),
    )
    p.add_argument("model", nargs="?", default=None, metavar="MODEL.keras", help="a saved Keras model")
    p.add_argument("data", nargs="?", default=None, metavar="DATA.npz", help="arrays x and y")
    p.add_argument(
        "--out", default="pegrad_diagnose", metavar="DIR", help="folder for the report files (default: %(default)s)"
    )
    p.add_argument("--fast", action="store_true", help="a small subset and 1 training epoch for the demo")
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=32,
        metavar="B",
        help="current training batch size, for the accumulation advice (default: %(default)s)",
    )
    p.add_argument(
        "--top-k",
        type=_positive_int,
        default=10,
        metavar="K",
        help="largest-norm examples to report (default: %(default)s)",
    )
    p.add_argument("--loss", default=None, metavar="NAME", help="Keras loss name, if the model has none")
    p.add_argument("--seed", type=_seed, default=0, help="random seed for the demo (default: %(default)s)")
    p.set_defaults(run=_run_diagnose, parser=p)


def _run_diagnose(args: argparse.Namespace) -> int:
    if (args.model is None) != (args.data is None):
        args.parser.error("give both MODEL.keras and DATA.npz, or neither for the demo model")
    # Importing the command loads numpy only: bad paths fail before TensorFlow loads.
    from per_example_grads.apps.diagnose import check_paths

    check_paths(args.out, args.model, args.data)
    _start_tensorflow(report_device=True)
    from per_example_grads.apps.diagnose import run_diagnose

    run_diagnose(
        args.out,
        args.model,
        args.data,
        fast=args.fast,
        batch_size=args.batch_size,
        top_k=args.top_k,
        loss=args.loss,
        seed=args.seed,
    )
    return 0


def _add_audit_parser(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "audit",
        help="audit DP-SGD on the digits with canaries: empirical epsilon beside the accountant's",
        description=(
            "Train the demo's digits MLP with DP-SGD at a target epsilon, with canaries each "
            "included with probability 1/2, guess which were included, and print the lower bounds "
            "on epsilon this gives (one-run, Gaussian DP, Clopper-Pearson) beside the accountant's "
            "epsilon. A lower bound above it means a broken implementation; one below proves "
            "nothing. Writes audit.png and audit.json."
        ),
    )
    p.add_argument(
        "--out",
        default="pegrad_audit",
        metavar="DIR",
        help="folder for audit.png and audit.json (default: %(default)s)",
    )
    p.add_argument("--fast", action="store_true", help="2 epochs instead of 10 (seconds)")
    p.add_argument(
        "--canaries",
        choices=("gradient", "input"),
        default="gradient",
        help="gradient: white-box Dirac canaries of the clipped sum, scored on the released "
        "gradients; input: mislabeled digits, scored by their loss (default: %(default)s)",
    )
    p.add_argument(
        "--num-canaries",
        type=_positive_int,
        default=None,
        metavar="M",
        help="canaries (default: 1000, at most the MLP's 4,810 parameters, for gradient canaries; "
        "a third of the training digits, 479, for input canaries)",
    )
    p.add_argument(
        "--target-epsilon",
        type=_positive_float,
        default=4.0,
        metavar="E",
        help="the epsilon claimed, at delta = 1e-5 (default: %(default)s)",
    )
    p.add_argument(
        "--epochs", type=_positive_int, default=None, help="passes over the data (default: 10, or 2 with --fast)"
    )
    p.add_argument(
        "--full-batch",
        action="store_true",
        help="every example at every step (q = 1), where white-box canaries can reach the accountant's epsilon",
    )
    p.add_argument(
        "--significance",
        type=_probability,
        default=0.05,
        metavar="A",
        help="the bounds hold with probability 1 - A (default: %(default)s)",
    )
    p.add_argument("--seed", type=_seed, default=0, help="random seed (default: %(default)s)")
    p.set_defaults(run=_run_audit, parser=p)


def _run_audit(args: argparse.Namespace) -> int:
    check_output_folder(args.out)  # before TensorFlow loads
    _start_tensorflow(report_device=True)
    from per_example_grads.apps.audit_demo import run_audit_demo

    run_audit_demo(
        args.out,
        target_epsilon=args.target_epsilon,
        kind=args.canaries,
        num_canaries=args.num_canaries,
        epochs=args.epochs,
        full_batch=args.full_batch,
        fast=args.fast,
        significance=args.significance,
        seed=args.seed,
    )
    return 0


def _error(parser: argparse.ArgumentParser, error: Exception, status: int) -> int:
    """An expected failure: ``PROG: error: MESSAGE`` (one line) on stderr; returns ``status``."""
    print(f"{parser.prog}: error: {first_line(error)}", file=sys.stderr)
    return status


_SUBCOMMANDS: tuple[_Adder, ...] = (
    _add_demo_parser,
    _add_epsilon_parser,
    _add_mechanisms_parser,
    _add_diagnose_parser,
    _add_audit_parser,
)


if __name__ == "__main__":
    raise SystemExit(main())
