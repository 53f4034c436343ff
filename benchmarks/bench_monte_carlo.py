"""What the amplification of a random part is worth: the ledger's epsilon against Monte-Carlo accounting.

For runs of ``T`` steps on ``poisson_batches(cycle_length=b)``, ``T / b``
epochs, each mechanism's noise multiplier is calibrated so that the ledger's
accounting (``compute_epsilon``: the part taken as known) spends
``--target-epsilon`` at ``--delta``; the table gives the epsilon of that same
run by ``peg.dp.monte_carlo_epsilon`` (the part random; seed 0, the default
number of draws for ``delta``; at ``q < 1`` BLT's and BISR's losses bounded
within the slack shown), and the seconds it took on this machine.

Run: ``python benchmarks/bench_monte_carlo.py [--steps 1000] [--epochs 2,4,16,64]
[--target-epsilon 8] [--delta 1e-3] [--only BLT]``. ``delta`` sets the draws (60 to 120 times ``1 /
delta`` of each side) and so the time: 1e-3 keeps the table to minutes on 2
cores; 1e-5 takes 141 times as long.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import per_example_grads as peg  # noqa: E402


def _mechanisms(steps: int, cycle: int) -> list[tuple[str, object, float]]:
    bands = min(16, cycle)
    return [
        (f"BandMF({bands}), q = 0.5", peg.dp.BandMF(bands, steps, cycle_length=cycle), 0.5),
        (f"BandMF({bands}), q = 1", peg.dp.BandMF(bands, steps, cycle_length=cycle), 1.0),
        ("BLT(2), q = 1", peg.dp.BLT(2, steps, cycle_length=cycle), 1.0),
        ("BLT(2), q = 0.5", peg.dp.BLT(2, steps, cycle_length=cycle), 0.5),
        (f"BISR({bands}), q = 1", peg.dp.BISR(bands, steps, cycle_length=cycle), 1.0),
        (f"BISR({bands}), q = 0.5", peg.dp.BISR(bands, steps, cycle_length=cycle), 0.5),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--epochs", default="2,4,16,64")
    parser.add_argument("--target-epsilon", type=float, default=8.0)
    parser.add_argument("--delta", type=float, default=1e-3)
    parser.add_argument("--only", default="", help="run only the mechanisms whose name starts with this (e.g. BLT)")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    print(f"commit {commit}, {cpu}, {os.cpu_count()} CPUs, T = {args.steps}, delta = {args.delta:g}")
    print("| epochs (b) | mechanism | sigma | ledger eps | Monte-Carlo eps | loss slack (nats) | draws per side | s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    examples = int(1.0 / args.delta) // 2  # delta < 1 / N, as a run's delta must be
    for epochs in (int(e) for e in args.epochs.split(",")):
        cycle = args.steps // epochs
        for name, mechanism, q in _mechanisms(args.steps, cycle):
            if not name.startswith(args.only):
                continue
            batch = q * examples / cycle
            plan = dict(steps=args.steps, sampling_probability=q, mechanism=mechanism)
            sigma = peg.dp.noise_multiplier_for_epsilon(args.target_epsilon, args.delta, examples, batch, None, **plan)
            ledger = peg.dp.compute_epsilon(examples, batch, None, sigma, args.delta, **plan)
            start = time.perf_counter()
            r = peg.dp.monte_carlo_epsilon(
                mechanism, sigma, args.steps, delta=args.delta, sampling_probability=q, seed=0
            )
            seconds = time.perf_counter() - start
            print(
                f"| {epochs} ({cycle}) | {name} | {sigma:.3f} | {ledger:.2f} | {r.epsilon:.2f} | {r.loss_slack:.2g} | "
                f"{r.samples:,} | {seconds:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
