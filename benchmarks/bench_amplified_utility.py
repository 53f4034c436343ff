"""Correlated noise with its amplification against DP-SGD at equal epsilon, in the many-step regime.

The task trains for ``STEPS = 1000`` steps at expected batch 64 (8 epochs) on
8,000 generated examples: 64 Gaussian features, 10 classes drawn from a fixed
random teacher network (64 -> 32 tanh -> 10, logits / 0.2 plus Gumbel noise:
the teacher's own accuracy is 0.88), 4,000 held out. The student is the
digits MLP of ``pegrad demo`` (64-64-10, tanh), clip 1, delta 1e-4 (below
1 / N = 1.25e-4: the Monte-Carlo draws grow as 1 / delta, and 1e-5 costs
about 16 minutes a draw here).

Each mechanism runs on the batches its accounting is stated for, and its
noise multiplier is calibrated to each target epsilon by that accounting:

- DP-SGD: Poisson sampling at ``q = 64 / N``; PLD (dp_accounting).
- BandMF(16), ledger: cyclic Poisson over 16 parts at ``q = 16 * 64 / N``;
  PLD of its cyclic reduction (the part taken as known).
- BLT(2), ledger: whole parts, one epoch a cycle (125 parts, ``q = 1``); no
  amplification (the part taken as known).
- BandMF(16) and BLT(2), Monte Carlo: the same batches as their ledger
  rows, each example's part random; ``peg.dp.monte_carlo_noise_multiplier``
  (seed 0), whose certifying draw states the epsilon at delta with the
  draws' failure probability folded in. (BandMF(16) on whole parts of 125,
  by Monte Carlo, needs more noise than on 16 parts by the ledger: sigma
  3.70 against 3.45 at epsilon 1.)

Reported: for SGD(0.1, momentum 0.9) and Adam(3e-3), each at its learning
rate times 0.1, 0.3 and 1, the test accuracy (mean ± std over ``--seeds``)
at the scale whose mean accuracy on a validation set (4,000 more examples
of the teacher) is best, for each mechanism and epsilon, and every scale's
validation and test means; the calibration (sigma, stated epsilon and
delta, seconds); a PNG of accuracy against epsilon.

    python benchmarks/bench_amplified_utility.py --calibration /tmp/sigmas.json --png docs/guides/img/amplified_utility.png
"""

from __future__ import annotations

import argparse
import json
import os
import time

import keras
import numpy as np

import per_example_grads as peg
from per_example_grads.apps import zoo

N_TRAIN, N_TEST, STEPS, BATCH, DELTA = 8000, 4000, 1000, 64, 1e-4
PARTS = N_TRAIN // BATCH  # 125: one epoch's steps
OPTIMIZERS = {  # name -> optimizer at its learning rate times a scale (``--lr-check``)
    "SGD(0.1, momentum 0.9)": lambda scale=1.0: keras.optimizers.SGD(0.1 * scale, momentum=0.9),
    "Adam(3e-3)": lambda scale=1.0: keras.optimizers.Adam(3e-3 * scale),
}
LR_SCALES = (0.1, 0.3, 1.0)


def teacher_task(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``x [n, 64] float32`` standard normal and ``y [n] int32`` from a fixed random teacher (module docstring)."""
    teacher = np.random.default_rng(1234)
    w1 = teacher.standard_normal((64, 32)) * (0.7 / 8.0)
    w2 = teacher.standard_normal((32, 10)) * (3.0 / np.sqrt(32))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 64)).astype(np.float32)
    logits = np.tanh(x @ w1) @ w2
    return x, np.argmax(logits / 0.2 + rng.gumbel(size=logits.shape), axis=1).astype(np.int32)


def mechanisms() -> dict[str, tuple]:
    """name -> (factory of a fresh mechanism or None, cycle_length, sampling_probability, accounting)."""
    whole = 1.0  # q of whole parts: 64 examples a step
    return {
        "DP-SGD": (lambda: None, 1, BATCH / N_TRAIN, "ledger"),
        "BandMF(16), ledger": (lambda: peg.dp.BandMF(bands=16, num_steps=STEPS), 16, 16 * BATCH / N_TRAIN, "ledger"),
        "BLT(2), ledger": (lambda: peg.dp.BLT(buffers=2, num_steps=STEPS, cycle_length=PARTS), PARTS, whole, "ledger"),
        "BandMF(16), Monte Carlo": (
            lambda: peg.dp.BandMF(bands=16, num_steps=STEPS),
            16,
            16 * BATCH / N_TRAIN,
            "monte_carlo",
        ),
        "BLT(2), Monte Carlo": (
            lambda: peg.dp.BLT(buffers=2, num_steps=STEPS, cycle_length=PARTS),
            PARTS,
            whole,
            "monte_carlo",
        ),
    }


def calibrate(name: str, epsilon: float) -> dict:
    """``{"sigma", "epsilon", "delta", "s"}``: the noise multiplier for ``epsilon`` and what its accounting states."""
    make, cycle, q, accounting = mechanisms()[name]
    start = time.perf_counter()
    if accounting == "ledger":
        sigma = peg.dp.noise_multiplier_for_epsilon(
            epsilon, DELTA, N_TRAIN, q * N_TRAIN / cycle, None, steps=STEPS, mechanism=make()
        )
        stated = peg.dp.compute_epsilon(N_TRAIN, q * N_TRAIN / cycle, None, sigma, DELTA, steps=STEPS, mechanism=make())
        return {"sigma": sigma, "epsilon": stated, "delta": DELTA, "s": time.perf_counter() - start}
    found = peg.dp.monte_carlo_noise_multiplier(make(), epsilon, STEPS, delta=DELTA, sampling_probability=q, seed=0)
    return {
        "sigma": found.noise_multiplier,
        "epsilon": found.certificate.epsilon,
        "delta": found.certificate.delta,
        "s": time.perf_counter() - start,
        "certifications": found.certifications,
    }


def _scores(model, data) -> tuple[float, float]:
    """``(validation accuracy, test accuracy)``."""
    _, (x_val, y_val), (x_test, y_test) = data
    return tuple(
        model.evaluate(x, y, verbose=0, return_dict=True)["accuracy"] for x, y in ((x_val, y_val), (x_test, y_test))
    )


def accuracy(name: str, sigma: float, optimizer: str, seed: int, data, lr_scale: float) -> tuple[float, float]:
    """``(validation, test)`` accuracy after ``STEPS`` DP steps of ``name`` at ``sigma`` (model, batches, noise seeded)."""
    (x, y), _, _ = data
    make, cycle, q, _ = mechanisms()[name]
    dp = peg.keras.DPModel(
        zoo.build_model("digits_dp_mlp", seed), l2_norm_clip=1.0, noise_multiplier=sigma, seed=seed, mechanism=make()
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dp.compile(optimizer=OPTIMIZERS[optimizer](lr_scale), loss=loss, metrics=["accuracy"])
    batches = peg.dp.poisson_batches(x, y, sampling_probability=q, cycle_length=cycle, steps=STEPS, seed=seed)
    dp.fit(batches, epochs=1, verbose=0)
    assert int(dp.dp_steps.numpy()) == STEPS, (name, dp.dp_steps)
    return _scores(dp, data)


def plain_accuracy(optimizer: str, seed: int, data, lr_scale: float) -> tuple[float, float]:
    """``(validation, test)`` accuracy after 8 epochs at batch 64 without privacy (the same model and steps)."""
    (x, y), _, _ = data
    model = zoo.build_model("digits_dp_mlp", seed)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=OPTIMIZERS[optimizer](lr_scale), loss=loss, metrics=["accuracy"])
    keras.utils.set_random_seed(seed)
    model.fit(x, y, batch_size=BATCH, epochs=STEPS // PARTS, verbose=0)
    return _scores(model, data)


def best_learning_rate(run, seeds: int) -> dict:
    """``run(seed, lr_scale) -> (validation, test)`` at every ``LR_SCALES``; the scale of the best mean validation.

    Returns ``{"scale", "test": [per seed], "sweep": {scale: (mean validation, mean test)}}``.
    """
    sweep, tests = {}, {}
    for scale in LR_SCALES:
        scores = [run(seed, scale) for seed in range(seeds)]
        tests[scale] = [t for _, t in scores]
        sweep[scale] = (float(np.mean([v for v, _ in scores])), float(np.mean(tests[scale])))
    scale = max(LR_SCALES, key=lambda s: sweep[s][0])
    return {"scale": scale, "test": tests[scale], "sweep": sweep}


def plot(results: dict, epsilons: list[float], path: str) -> None:
    """Accuracy against epsilon, one panel per optimizer, one line per mechanism (error bars: std over seeds)."""
    from per_example_grads.plots import new_figure

    fig = new_figure(10, 4)
    axes = fig.subplots(1, len(OPTIMIZERS), sharey=True)
    for ax, optimizer in zip(axes, OPTIMIZERS):
        for name in mechanisms():
            cells = [results[optimizer][name][e]["test"] for e in epsilons]
            style = "-" if name == "DP-SGD" or "Monte Carlo" in name else ":"
            ax.errorbar(
                epsilons,
                [np.mean(c) for c in cells],
                [np.std(c) for c in cells],
                fmt="o" + style,
                capsize=3,
                label=name,
            )
        ax.axhline(np.mean(results[optimizer]["no privacy"]["test"]), color="gray", lw=0.8, label="no privacy")
        ax.set_xscale("log", base=2)
        ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
        ax.set_xlabel(f"epsilon at delta {DELTA:g}")
        ax.set_title(optimizer)
    axes[0].set_ylabel("test accuracy (learning rate chosen on validation)")
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(f"{STEPS} steps, expected batch {BATCH}, N = {N_TRAIN}: equal epsilon, each by its own accounting")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the tables (markdown) here")
    parser.add_argument("--png", default=None, help="write the plot here")
    parser.add_argument("--calibration", default=None, help="JSON of the calibrations: read if it exists, else written")
    args = parser.parse_args()
    data = (teacher_task(N_TRAIN, 0), teacher_task(N_TEST, 2), teacher_task(N_TEST, 1))  # train, validation, test
    epsilons = args.epsilons
    cached = {}
    if args.calibration and os.path.exists(args.calibration):
        with open(args.calibration) as f:
            cached = json.load(f)
    lines = [
        "### Calibration: sigma (the epsilon and delta its accounting states; seconds)",
        "",
        "| mechanism | " + " | ".join(f"eps = {e:g}" for e in epsilons) + " |",
        "|---|" + "---:|" * len(epsilons),
    ]
    sigmas = {}
    for name in mechanisms():
        cells = []
        for eps in epsilons:
            c = cached.get(f"{name}|{eps:g}") or calibrate(name, eps)
            cached[f"{name}|{eps:g}"] = c
            sigmas[name, eps] = c["sigma"]
            cells.append(f"{c['sigma']:.3f} ({c['epsilon']:.3f}, {c['delta']:.3g}; {c['s']:.0f} s)")
            print(name, eps, c, flush=True)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if args.calibration:
        with open(args.calibration, "w") as f:
            json.dump(cached, f, indent=1)
    results, sweeps = {}, ["", "### Every learning rate: mean validation / test accuracy", ""]
    sweeps += ["| optimizer | mechanism | eps | " + " | ".join(f"lr x {s:g}" for s in LR_SCALES) + " |"]
    sweeps += ["|---|---|---:|" + "---:|" * len(LR_SCALES)]
    for optimizer in OPTIMIZERS:
        plain = best_learning_rate(lambda seed, scale: plain_accuracy(optimizer, seed, data, scale), args.seeds)
        results[optimizer] = {"no privacy": plain}
        lines += [
            "",
            f"### {optimizer}: test accuracy, learning rate x {' / '.join(f'{s:g}' for s in LR_SCALES)} chosen on "
            f"validation (no privacy: {np.mean(plain['test']):.3f} ± {np.std(plain['test']):.3f}, x {plain['scale']:g})",
            "",
            "| mechanism | " + " | ".join(f"eps = {e:g}" for e in epsilons) + " |",
            "|---|" + "---:|" * len(epsilons),
        ]
        for name in mechanisms():
            results[optimizer][name] = {}
            cells = []
            for eps in epsilons:
                sigma = sigmas[name, eps]
                found = best_learning_rate(
                    lambda seed, scale: accuracy(name, sigma, optimizer, seed, data, scale), args.seeds
                )
                results[optimizer][name][eps] = found
                t = found["test"]
                cells.append(f"{np.mean(t):.3f} ± {np.std(t):.3f} (x {found['scale']:g}, σ {sigma:.2f})")
                sweep = " | ".join(f"{v:.3f} / {te:.3f}" for v, te in found["sweep"].values())
                sweeps.append(f"| {optimizer} | {name} | {eps:g} | {sweep} |")
                print(optimizer, name, eps, cells[-1], sweeps[-1], flush=True)
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    _write(lines + sweeps, args.out)
    if args.png:
        plot(results, epsilons, args.png)


def _write(lines: list[str], path: str | None) -> None:
    text = "\n".join(lines)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
