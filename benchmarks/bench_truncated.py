"""Truncated Poisson sampling against Poisson sampling: what each truncated size costs in epsilon and saves in time.

    .venv/bin/python benchmarks/bench_truncated.py                       # both parts
    .venv/bin/python benchmarks/bench_truncated.py --part epsilon        # the accounting only (no TensorFlow)
    .venv/bin/python benchmarks/bench_truncated.py --part time --repeats 5

``epsilon``: for a run of ``T = 2,000`` steps on ``N = 60,000`` examples at an
expected batch of 256 (``q = 256 / N``, about 8.5 epochs), ``delta = 1e-5``:
for ``poisson_batches`` (padded to its default ``M``, never cut) and for
``truncated_poisson_batches`` at ``B = 256 + k sd`` (``sd = sqrt(N q (1 - q))``),
each batch's padded rows, the examples a step drops on average
(``E[max(0, Binomial(N, q) - B)]``), epsilon at ``sigma = 1`` (PLD,
``compute_epsilon``) and the noise multiplier for epsilon 4
(``noise_multiplier_for_epsilon``, rtol 1e-3).

``time``: ``DPModel.fit`` of an MLP (64 -> 1024 -> 1024 -> 10, SGD; ``--hidden``) on 20,000 generated
examples at the same expected batch, ``poisson_batches`` against
``truncated_poisson_batches`` at ``B = 256 + 3 sd``, with and without XLA
(under XLA every padded row is computed; without it only the real rows,
rounded up to a bucket). Each configuration's model is traced on a first
pass; then passes of 30 steps are timed round robin, and the median
milliseconds per step reported.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

N, BATCH, STEPS, DELTA = 60_000, 256, 2_000, 1e-5
SDS = (2, 3, 4, 5, 6)  # B = BATCH + k sd


def epsilon_table() -> None:
    from scipy import stats

    from per_example_grads.dp import accounting
    from per_example_grads.dp.sampling import default_max_batch_size

    q = BATCH / N
    sd = math.sqrt(N * q * (1 - q))
    rows = [("poisson_batches, M", default_max_batch_size(N, q), None)]
    rows += [(f"truncated, B = 256 + {k} sd", round(BATCH + k * sd), round(BATCH + k * sd)) for k in SDS]
    print(f"N = {N}, q = {q:.6g} (expected batch {BATCH}, sd {sd:.1f}), T = {STEPS}, delta = {DELTA:g}")
    print("| sampling | rows per batch | examples dropped per step | epsilon at sigma 1 | sigma for epsilon 4 |")
    print("|---|---|---|---|---|")
    for name, padded, b in rows:
        dropped = 0.0 if b is None else float(sum(stats.binom.pmf(k, N, q) * (k - b) for k in range(b + 1, 2 * b)))
        run = dict(steps=STEPS, truncated_batch_size=b)
        started = time.perf_counter()
        eps = accounting.compute_epsilon(N, BATCH, None, 1.0, DELTA, **run)
        try:
            sigma = f"{accounting.noise_multiplier_for_epsilon(4.0, DELTA, N, BATCH, None, **run):.4g}"
        except ValueError as e:  # past the search's bounded cost: say so, with RDP's answer
            sigma = "past the PLD search's bound; " + str(e).rsplit("; ", 1)[-1].rstrip(".")
        seconds = time.perf_counter() - started
        print(f"| {name} | {padded} | {dropped:.3g} | {eps:.4g} | {sigma} |  ({seconds:.0f} s)")


def time_table(repeats: int, hidden: int) -> None:
    import keras
    import numpy as np

    import per_example_grads as peg

    n = 20_000
    q = BATCH / n
    sd = math.sqrt(n * q * (1 - q))
    b = round(BATCH + 3 * sd)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 64)).astype("float32")
    y = rng.integers(0, 10, size=n).astype("int64")

    def make(jit: bool, truncated: bool):
        keras.utils.set_random_seed(0)
        net = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(hidden, activation="relu"),
                keras.layers.Dense(hidden, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        dp = peg.keras.DPModel(net, noise_multiplier=1.0, seed=0)
        dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
        if truncated:
            data = peg.dp.truncated_poisson_batches(
                x, y, sampling_probability=q, truncated_batch_size=b, steps=30, seed=0
            )
        else:
            data = peg.dp.poisson_batches(x, y, sampling_probability=q, steps=30, seed=0)
        dp.fit(data, verbose=0)  # traces
        return dp, data

    configs = {(jit, truncated): make(jit, truncated) for jit in (False, True) for truncated in (False, True)}
    times = {key: [] for key in configs}
    for _ in range(repeats):
        for key, (dp, data) in configs.items():
            started = time.perf_counter()
            dp.fit(data, verbose=0)
            times[key].append((time.perf_counter() - started) / 30 * 1e3)
    m = peg.dp.default_max_batch_size(n, q)
    print(
        f"MLP 64-{hidden}-{hidden}-10, N = {n}, q = {q:.6g}, poisson_batches M = {m}, truncated B = {b} "
        f"(256 + 3 sd); ms per step (a fit of 30 steps / 30), median of {repeats}"
    )
    print("| XLA | poisson_batches | truncated | truncated / poisson |")
    print("|---|---|---|---|")
    for jit in (False, True):
        p, t = statistics.median(times[(jit, False)]), statistics.median(times[(jit, True)])
        print(f"| {'yes' if jit else 'no'} | {p:.2f} | {t:.2f} | {t / p:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("epsilon", "time", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024, help="the MLP's hidden width (time)")
    args = parser.parse_args()
    if args.part in ("epsilon", "both"):
        epsilon_table()
    if args.part in ("time", "both"):
        time_table(args.repeats, args.hidden)


if __name__ == "__main__":
    main()
