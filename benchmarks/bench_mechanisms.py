"""Correlated noise (BandMF, BLT, BISR) against DP-SGD: test accuracy at equal epsilon, and what a step costs.

Utility (``--utility``): the digits MLP of ``pegrad demo`` (64-64-10, tanh),
trained with ``DPModel`` for ``--epochs`` epochs at expected batch 64 on the
1,438 training digits, with ``--optimizer`` (Adam 3e-3, or SGD 0.1 with
momentum 0.9, which is linear in the gradients as the factorization's
analysis assumes; neither tuned per mechanism),
clip 1, delta 1e-5, for each target epsilon and seed:

- DP-SGD: Poisson sampling at ``q = 64 / N``;
- BandMF(b): cyclic Poisson sampling over ``b`` parts at ``q = 64 b / N``;
- BLT(d), BISR(p): cyclic over ``N / 64`` parts (one epoch a cycle), each
  part taken whole (``q = 1``: their accounting claims no amplification);
- BISR(p) on b-min-sep batches (``min_sep_batches``) with ``b`` one epoch's
  steps and ``p`` giving an expected batch of 64: the same epsilon.

Each mechanism's noise multiplier is calibrated to the target epsilon with
``noise_multiplier_for_epsilon(..., mechanism=...)`` (PLD). Reported: test
accuracy mean and std over seeds, and the noise multiplier.

Cost (``--cost``): one ``DPModel`` step with each mechanism on zoo models,
on the same cyclic Poisson batches (DP-SGD's noise as ``BandMF(bands=1)``),
side by side in one process, median ms per step over ``--repeats`` fits of
``--steps`` steps (the first fit, which traces, excluded), and the floats of
state each keeps (``(b - 1) x P`` for BandMF, ``d x P`` for BLT).

Sampling (``--sampling``): what cyclic Poisson sampling costs the input
pipeline against plain Poisson sampling (``sampling``).

    python benchmarks/bench_mechanisms.py --utility --cost
"""

from __future__ import annotations

import argparse
import statistics
import time

import keras
import numpy as np

import per_example_grads as peg
from per_example_grads.apps import zoo
from per_example_grads.data import train_test_split_digits

DELTA = 1e-5
BATCH = 64


def _mechanisms(n: int, steps: int, steps_per_epoch: int):
    """name -> (factory of a fresh mechanism or None, cycle_length, sampler: "poisson" or "min_sep")."""
    e = steps_per_epoch
    return {
        "DP-SGD": (lambda: None, 1, "poisson"),
        "BandMF(b=4)": (lambda: peg.dp.BandMF(bands=4, num_steps=steps), 4, "poisson"),
        f"BandMF(b={e})": (lambda: peg.dp.BandMF(bands=e, num_steps=steps), e, "poisson"),
        "BLT(d=4)": (lambda: peg.dp.BLT(buffers=4, num_steps=steps, cycle_length=e), e, "poisson"),
        # p = one epoch's steps: the fewest bands at which its sensitivity x prefix-sum error is near its least
        # here (19.7, as BLT(4)'s 19.2; p = 4: 27; DP-SGD without amplification: 66).
        f"BISR(p={e})": (lambda: peg.dp.BISR(bands=e, num_steps=steps, cycle_length=e), e, "poisson"),
        f"BISR(p={e}), {e}-min-sep": (lambda: peg.dp.BISR(bands=e, num_steps=steps, cycle_length=e), e, "min_sep"),
    }


def _optimizer(name: str):
    if name == "adam":
        return keras.optimizers.Adam(3e-3)
    return keras.optimizers.SGD(0.1, momentum=0.9)  # linear in the gradients, as the factorization's analysis assumes


def utility(epsilons, seeds, epochs, optimizer="adam") -> list[str]:
    split = train_test_split_digits(seed=0)
    n = len(split.x_train)
    steps_per_epoch = n // BATCH
    steps = steps_per_epoch * epochs
    rows = ["| mechanism | " + " | ".join(f"eps = {e:g}" for e in epsilons) + " |", "|---|" + "---:|" * len(epsilons)]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for name, (make, cycle, sampler) in _mechanisms(n, steps, steps_per_epoch).items():
        cells = []
        for eps in epsilons:
            mechanism = make()
            unamplified = not getattr(mechanism, "amplified", True)
            batch = n / cycle if unamplified and sampler == "poisson" else BATCH
            sigma = peg.dp.noise_multiplier_for_epsilon(eps, DELTA, n, batch, None, steps=steps, mechanism=mechanism)
            q = batch * cycle / n
            accuracies = []
            for seed in seeds:
                mechanism = make()
                dp = peg.keras.DPModel(
                    zoo.build_model("digits_dp_mlp", seed),
                    l2_norm_clip=1.0,
                    noise_multiplier=sigma,
                    seed=seed,
                    mechanism=mechanism,
                )
                dp.compile(optimizer=_optimizer(optimizer), loss=loss, metrics=["accuracy"])
                if sampler == "min_sep":  # expected batch n / (b - 1 + 1 / p) = BATCH
                    data = peg.dp.min_sep_batches(
                        split.x_train,
                        split.y_train,
                        sampling_probability=1.0 / (n / BATCH - (cycle - 1)),
                        min_separation=cycle,
                        steps=steps,
                        seed=seed,
                    )
                else:
                    data = peg.dp.poisson_batches(
                        split.x_train,
                        split.y_train,
                        sampling_probability=min(q, 1.0),
                        cycle_length=cycle,
                        steps=steps,
                        seed=seed,
                    )
                dp.fit(data, epochs=1, verbose=0)
                assert dp.epsilon(DELTA) <= eps * 1.001, (name, eps, dp.epsilon(DELTA))
                accuracies.append(dp.evaluate(split.x_test, split.y_test, verbose=0, return_dict=True)["accuracy"])
            cells.append(f"{np.mean(accuracies):.3f} ± {np.std(accuracies):.3f} (σ {sigma:.2f})")
            print(name, eps, cells[-1], flush=True)
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return [
        f"N = {n}, {epochs} epochs = {steps} steps, seeds {list(seeds)}, delta {DELTA:g}, optimizer {optimizer}",
        "",
        *rows,
    ]


def cost(models, steps, repeats) -> list[str]:
    rows = [
        "| model | P | DP-SGD ms/step | BandMF(b=4) | BandMF(b=16) | BLT(d=4) | BISR(p=4) | state floats (b=16 / d=4) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for model_name in models:
        runs, state, fits = {}, {}, {}
        for name, make in (
            # DP-SGD's noise (one band: x_t = z_t) on the same cyclic batches, so that only the noise differs.
            ("DP-SGD", lambda: peg.dp.BandMF(bands=1, num_steps=1000, cycle_length=16)),
            ("BandMF(b=4)", lambda: peg.dp.BandMF(bands=4, num_steps=1000, cycle_length=16)),
            ("BandMF(b=16)", lambda: peg.dp.BandMF(bands=16, num_steps=1000)),
            ("BLT(d=4)", lambda: peg.dp.BLT(buffers=4, num_steps=1000, cycle_length=16)),
            ("BISR(p=4)", lambda: peg.dp.BISR(bands=4, num_steps=1000, cycle_length=16)),
        ):
            net, x, y = zoo.build(model_name, 256)  # the same weights and data every time (seed 0)
            p = sum(int(np.prod(w.shape)) for w in net.trainable_weights)
            mechanism = make()
            dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0, mechanism=mechanism)
            dp.compile(optimizer="sgd", loss=loss)
            # 16 parts of 16 examples at q = 1/2: 8 real rows a step in expectation.
            data = peg.dp.poisson_batches(x, y, sampling_probability=0.5, cycle_length=16, steps=steps, seed=0)
            dp.fit(data, epochs=1, verbose=0)  # traces
            fits[name], runs[name] = (dp, data), []
            state[name] = getattr(mechanism, "state_floats", 0)
        for _ in range(repeats):  # interleaved, so that a change of load hits every mechanism alike
            for name, (dp, data) in fits.items():
                t0 = time.perf_counter()
                dp.fit(data, epochs=1, verbose=0)
                runs[name].append((time.perf_counter() - t0) * 1000 / steps)
        timings = {name: statistics.median(r) for name, r in runs.items()}
        base = timings["DP-SGD"]
        cells = [
            f"{timings[k] / base:.2f} ({timings[k]:.2f}, {timings[k] - base:+.2f} ms)"
            for k in ("BandMF(b=4)", "BandMF(b=16)", "BLT(d=4)", "BISR(p=4)")
        ]
        rows.append(
            f"| {model_name} | {p:,} | {base:.2f} | "
            + " | ".join(cells)
            + f" | {state['BandMF(b=16)']:,} / {state['BLT(d=4)']:,} |"
        )
        print(rows[-1], flush=True)
    return rows


def sampling(repeats: int, steps: int = 64) -> list[str]:
    """What cyclic Poisson sampling costs the input pipeline: ``poisson_batches`` on ``[60000, 784]`` float32 rows.

    For cycle 1 and 4 at an expected batch of 256, interleaved: the call
    (for a cycle, the digest of the rows that fixes the partition), the
    first batch, and the median ms per batch of the rest of a ``steps``-step
    pass, drained with nothing trained.
    """
    x = np.random.RandomState(0).rand(60_000, 784).astype("float32")
    y = np.zeros(len(x), "int64")
    times: dict[int, list[tuple[float, float, float]]] = {1: [], 4: []}
    for seed in range(repeats):
        for cycle in times:
            started = time.perf_counter()
            ds = peg.dp.poisson_batches(
                x, y, sampling_probability=256 * cycle / len(x), cycle_length=cycle, seed=seed, steps=steps
            )
            built = time.perf_counter()
            batches = iter(ds)
            next(batches)
            first = time.perf_counter()
            for _ in batches:
                pass
            times[cycle].append((built - started, first - built, (time.perf_counter() - first) / (steps - 1)))
    rows = ["| cycle_length | call ms | first batch ms | ms per batch |", "|---:|---:|---:|---:|"]
    for cycle, runs in times.items():
        call, first, per = (1e3 * statistics.median(column) for column in zip(*runs))
        rows.append(f"| {cycle} | {call:.1f} | {first:.1f} | {per:.2f} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--utility", action="store_true")
    parser.add_argument("--cost", action="store_true")
    parser.add_argument("--sampling", action="store_true")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument(
        "--optimizer",
        choices=["adam", "sgd"],
        default="adam",
        help="adam: Adam(3e-3); sgd: SGD(0.1, momentum 0.9); neither tuned per mechanism",
    )
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "transformer", "embedding_bag", "gpt2_lm"])
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = []
    if args.utility:
        lines += [
            "### Test accuracy at equal epsilon (mean ± std over seeds)",
            "",
            *utility(args.epsilons, range(args.seeds), args.epochs, args.optimizer),
            "",
        ]
    if args.cost:
        lines += [
            "### Cost of a DPModel step, ratio to DP-SGD's (median ms, added ms)",
            "",
            *cost(args.models, args.steps, args.repeats),
            "",
        ]
    if args.sampling:
        lines += [
            "### poisson_batches on [60000, 784] rows, expected batch 256 (medians)",
            "",
            *sampling(args.repeats),
            "",
        ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
