"""Privacy auditing (``peg.dp.audit``): the empirical epsilon against the accountant's, and what an audit costs.

The model is the digits MLP of ``pegrad demo --dp`` (64-64-10, tanh, 4,810
parameters) trained with ``DPModel`` on the 1,438 training digits, clip 1,
Adam (learning rate 3e-3), delta 1e-5, the noise multiplier calibrated (PLD)
so that the run's epsilon is each target. Two samplings:

- ``demo``: Poisson batches at ``q = 128 / N`` for ``--epochs`` epochs (the
  demo's sampling; amplification by sampling is where one-run audits are
  known to be loose);
- ``full``: every example at every step (``q = 1``) for ``--full-steps``
  steps, where white-box canaries can reach the accountant's epsilon.

For each target epsilon, sampling and seed: one ``fit`` without canaries (the
baseline), and ``peg.dp.audit.audit`` of the same run with ``--canaries``
gradient (Dirac, white-box) canaries; with ``--input-canaries M``, also an
audit with ``M`` mislabeled digits (black box). Reported: the accountant's
epsilon, the one-run and Gaussian-DP lower bounds (mean and range over the
seeds; 95 % confidence), and the wall time of the audit's ``fit`` and of
its scoring against the baseline ``fit`` (tracing included in both, the
median over seeds).

    python benchmarks/bench_audit.py --out /tmp/audit.md
    python benchmarks/bench_audit.py --epsilons 2,8 --seeds 0 --samplings full   # quick
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

import keras

import per_example_grads as peg
from per_example_grads.apps import zoo
from per_example_grads.data import N_CLASSES, train_test_split_digits
from per_example_grads.dp import audit

DELTA = 1e-5
BATCH = 128


def _dp_model(sigma: float, seed: int) -> peg.keras.DPModel:
    dp_model = peg.keras.DPModel(
        zoo.build_model("digits_dp_mlp", seed), l2_norm_clip=1.0, noise_multiplier=sigma, seed=seed
    )
    dp_model.compile(
        optimizer=keras.optimizers.Adam(3e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return dp_model


def _cell(target: float, sampling: str, seed: int, args) -> dict:
    split = train_test_split_digits(seed=seed)
    x, y = split.x_train, split.y_train
    n = len(x)
    q = 1.0 if sampling == "full" else BATCH / n
    steps = args.full_steps if sampling == "full" else round(args.epochs / q)
    sigma = peg.dp.noise_multiplier_for_epsilon(target, DELTA, n, q * n, None, steps=steps)
    out = {"target": target, "sampling": sampling, "seed": seed, "q": q, "steps": steps, "sigma": sigma}

    baseline = _dp_model(sigma, seed)
    batches = peg.dp.poisson_batches(x, y, sampling_probability=q, steps=steps, seed=seed)
    t0 = time.perf_counter()
    baseline.fit(batches, epochs=1, verbose=0)
    out["baseline_s"] = time.perf_counter() - t0

    audited = _dp_model(sigma, seed)
    t0 = time.perf_counter()
    report = audit.audit(
        audited,
        x,
        y,
        canaries=audit.GradientCanaries(args.canaries, seed=seed),
        sampling_probability=q,
        steps=steps,
        delta=DELTA,
        seed=seed,
    )
    out["audit_s"] = time.perf_counter() - t0
    out["audit_fit_s"] = report.seconds
    out["accountant"] = report.epsilon_accountant
    out["one_run"] = report.epsilon_one_run
    out["gaussian_dp"] = report.epsilon_gaussian_dp
    out["clopper_pearson"] = report.threshold_test.epsilon_clopper_pearson
    if args.input_canaries:
        canaries, x_rest, y_rest = audit.mislabeled_canaries(
            x, y, args.input_canaries, num_classes=N_CLASSES, seed=seed
        )
        n_all = len(x_rest) + args.input_canaries
        q_in = 1.0 if sampling == "full" else BATCH / n_all
        sigma_in = peg.dp.noise_multiplier_for_epsilon(target, DELTA, n_all, q_in * n_all, None, steps=steps)
        black = audit.audit(
            _dp_model(sigma_in, seed),
            x_rest,
            y_rest,
            canaries=canaries,
            sampling_probability=q_in,
            steps=steps,
            delta=DELTA,
            seed=seed,
        )
        out["input_one_run"] = black.epsilon_one_run
        out["input_accountant"] = black.epsilon_accountant
    return out


def _summary(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _report(cells: list[dict], args, command: str) -> str:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "per_example_grads"], capture_output=True, text=True
    ).stdout.strip()
    import tensorflow as tf

    lines = [
        f"`{command}`",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}, git {rev}{' (uncommitted changes)' if dirty else ''}, TensorFlow "
        f"{tf.__version__}, Keras {keras.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs "
        f"({platform.processor() or platform.machine()}).",
        "",
        f"Digits MLP, {args.canaries} gradient (Dirac) canaries, delta = {DELTA:g}, 95 % confidence; "
        f"seeds {args.seeds}: mean (min-max).",
        "",
    ]
    header = "| sampling | target ε | σ | steps | accountant ε | one-run ε ≥ | Gaussian-DP ε ≥ | GDP / accountant |"
    rule = "|---|---|---|---|---|---|---|---|"
    if args.input_canaries:
        header += f" black box ({args.input_canaries} mislabeled): one-run ε ≥ |"
        rule += "---|"
    header += " fit s: baseline | fit s: audit | audit total s |"
    rule += "---|---|---|"
    lines += [header, rule]
    keys = sorted({(c["sampling"], c["target"]) for c in cells}, key=lambda k: (k[0] != "demo", k[1]))
    for sampling, target in keys:
        group = [c for c in cells if c["sampling"] == sampling and c["target"] == target]
        row = (
            f"| {sampling} (q = {group[0]['q']:.3g}) | {target:g} | {group[0]['sigma']:.3f} | {group[0]['steps']} | "
            f"{_summary([c['accountant'] for c in group])} | {_summary([c['one_run'] for c in group])} | "
            f"{_summary([c['gaussian_dp'] for c in group])} | "
            f"{_summary([c['gaussian_dp'] / c['accountant'] for c in group])} |"
        )
        if args.input_canaries:
            row += f" {_summary([c['input_one_run'] for c in group])} |"
        row += (
            f" {statistics.median(c['baseline_s'] for c in group):.1f} | {statistics.median(c['audit_fit_s'] for c in group):.1f} |"
            f" {statistics.median(c['audit_s'] for c in group):.1f} |"
        )
        lines.append(row)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilons", default="1,2,4,8", help="target epsilons (default: %(default)s)")
    parser.add_argument("--samplings", default="demo,full", help="demo and/or full (default: %(default)s)")
    parser.add_argument("--seeds", default="0,1,2", help="seeds (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs of the demo sampling (default: %(default)s)")
    parser.add_argument(
        "--full-steps", type=int, default=10, help="steps of the full-batch sampling (default: %(default)s)"
    )
    parser.add_argument("--canaries", type=int, default=1000, help="gradient canaries (default: %(default)s)")
    parser.add_argument(
        "--input-canaries", type=int, default=0, help="also a black-box audit with this many (default: off)"
    )
    parser.add_argument("--out", default=None, help="also write the Markdown report here")
    args = parser.parse_args()
    cells = []
    for sampling in args.samplings.split(","):
        for target in (float(e) for e in args.epsilons.split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                cell = _cell(target, sampling, seed, args)
                print({k: round(v, 4) if isinstance(v, float) else v for k, v in cell.items()}, flush=True)
                cells.append(cell)
    import sys

    text = _report(cells, args, "python benchmarks/bench_audit.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
