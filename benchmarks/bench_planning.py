"""``peg.dp.rank_mechanisms`` at the utility benchmark's setting: which mechanism it picks at each epsilon, and why.

    python benchmarks/bench_planning.py                         # bench_amplified_utility's run: 8,000 x 64, 1,000 steps
    python benchmarks/bench_planning.py --epsilons 1,8 --blt-buffers 2,4 --json plan.json
    python benchmarks/bench_planning.py --epsilons 1,4 --utility   # and train every candidate

For each epsilon: every candidate (DP-SGD, BandMF at the default bands, BLT
at ``--blt-buffers`` on whole parts) calibrated by the ledger's PLD
accountant, with its noise multiplier, its sampling, the prefix-sum error
per unit noise and the ranking's error (their product), least first, and the
seconds the ranking took. Compare the ranking with the test accuracies of
``bench_amplified_utility.py`` (``benchmarks/RESULTS.md``): it measured
DP-SGD, BandMF(16) and BLT(2) at these settings. With ``--utility``, every
candidate also trains on that benchmark's task as it does there (its
``teacher_task``, model, SGD with momentum at the learning rate times 0.1,
0.3 or 1 chosen on validation, ``--seeds`` seeds), on the batches its
choice names, so the ranking is set beside the test accuracy it predicts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def test_accuracy(choice, seeds: int) -> dict:
    """``bench_amplified_utility.best_learning_rate`` of ``choice`` with SGD and momentum, on that benchmark's task."""
    import bench_amplified_utility as amp
    import keras

    import per_example_grads as peg
    from per_example_grads.apps import zoo

    data = (amp.teacher_task(amp.N_TRAIN, 0), amp.teacher_task(amp.N_TEST, 2), amp.teacher_task(amp.N_TEST, 1))
    (x, y), _, _ = data
    optimizer = amp.OPTIMIZERS["SGD(0.1, momentum 0.9)"]

    def run(seed, scale):
        mechanism = type(choice.mechanism).from_config(choice.mechanism.get_config())  # a fresh one: state is per run
        dp = peg.keras.DPModel(
            zoo.build_model("digits_dp_mlp", seed), l2_norm_clip=1.0, noise_multiplier=choice.noise_multiplier,
            seed=seed, mechanism=mechanism,
        )  # fmt: skip
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        dp.compile(optimizer=optimizer(scale), loss=loss, metrics=["accuracy"])
        batches = peg.dp.poisson_batches(
            x, y, sampling_probability=choice.sampling_probability, cycle_length=choice.cycle_length,
            steps=amp.STEPS, seed=seed,
        )  # fmt: skip
        dp.fit(batches, epochs=1, verbose=0)
        return amp._scores(dp, data)

    return amp.best_learning_rate(run, seeds)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epsilons", default="1,2,4,8")
    p.add_argument("--delta", type=float, default=1e-4)
    p.add_argument("--num-examples", type=int, default=8000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--blt-buffers", default="2", help="comma list; empty for none")
    p.add_argument("--utility", action="store_true", help="train every candidate (bench_amplified_utility's task)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.utility and (args.num_examples, args.batch_size, args.steps) != (8000, 64, 1000):
        p.error("--utility trains bench_amplified_utility's run: N 8000, batch 64, 1000 steps")

    import numpy as np

    import per_example_grads as peg

    rows = []
    buffers = tuple(int(d) for d in args.blt_buffers.split(",") if d)
    print(
        f"N = {args.num_examples}, B = {args.batch_size}, {args.steps} steps, delta = {args.delta}; "
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {os.cpu_count()} CPUs\n"
    )
    print("| epsilon | rank | mechanism | cycle | q | sigma | prefix error / sigma | error | test accuracy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for eps in (float(e) for e in args.epsilons.split(",")):
        start = time.perf_counter()
        ranked = peg.dp.rank_mechanisms(
            eps, args.delta, args.num_examples, args.batch_size, args.steps, blt_buffers=buffers, progress=False
        )
        seconds = time.perf_counter() - start
        for i, c in enumerate(ranked, 1):
            row = dict(epsilon=eps, rank=i, mechanism=c.name, cycle=c.cycle_length, q=c.sampling_probability,
                       sigma=c.noise_multiplier, error=c.error, seconds=seconds)  # fmt: skip
            accuracy = ""
            if args.utility:
                found = test_accuracy(c, args.seeds)
                row |= {"test": found["test"], "lr_scale": found["scale"]}
                accuracy = f"{np.mean(found['test']):.3f} ± {np.std(found['test']):.3f} (x {found['scale']:g})"
            rows.append(row)
            print(
                f"| {eps:g} | {i} | {c.name} | {c.cycle_length} | {c.sampling_probability:.3f} | "
                f"{c.noise_multiplier:.3f} | {c.error / c.noise_multiplier:.2f} | {c.error:.2f} | {accuracy} |",
                flush=True,
            )
        print(f"| {eps:g} | ranked in {seconds:.0f} s | | | | | | | |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
