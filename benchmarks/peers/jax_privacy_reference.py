"""Reference sensitivities and epsilons of correlated-noise strategies, computed by jax_privacy.

Runs in jax_privacy's own virtualenv (never a dependency of per_example_grads;
this script does not import it):

    python3 -m venv /tmp/venv-jp && /tmp/venv-jp/bin/pip install jax-privacy==2.0.0
    /tmp/venv-jp/bin/python benchmarks/peers/jax_privacy_reference.py > tests/data/jax_privacy_reference.json

For every case of the grid below it writes, from jax_privacy's own functions
(``matrix_factorization.toeplitz`` and ``buffered_toeplitz``):

- ``bisr``: the banded inverse square root (Kalinin, McKenna, Upadhyay,
  Lampert 2025, arXiv 2505.12128): ``C^{-1}`` keeps the first ``bands``
  coefficients of ``(1 - z)^{1/2}`` (jax_privacy's
  ``optimal_max_error_noising_coefs``, truncated), ``C`` is its inverse
  (``inverse_coef``);
- ``blt``: a buffered linear Toeplitz ``C`` of given decays and scales
  (``BufferedToeplitz.build(...).toeplitz_coefs``);

- ``min_sep``: the law of its ``BMinSepSampling`` (warm start), over
  ``RUNS`` seeds: every example's number of participations in ``T`` steps
  (mean and variance over examples and runs), and the smallest gap between
  two participations of an example;

- ``monte_carlo``: Monte-Carlo accounting of balls-in-bins sampling
  (``experimental.monte_carlo``: every example in one random part of
  ``cycle_length``, in every turn of it) for BLT and banded ``C``: a few
  draws ``y`` of the dominating pair's ``P`` and ``Q`` with their privacy
  losses (``compute_privacy_loss``), and the estimated delta at a few
  epsilons from ``MC_SAMPLES`` draws of each (``get_privacy_loss_sample``,
  ``delta_from_epsilon_and_samples``) with its standard error;

then, for the strategies, the squared sensitivity of ``C`` for ``ceil(n / min_sep)``
participations at least ``min_sep`` apart (``minsep_sensitivity_squared``),
and the epsilon at ``delta`` of one Gaussian release, at noise multipliers
of 2 and 8 times ``sqrt(ceil(n / min_sep))``, of noise multiplier
``sigma / sensitivity`` by dp_accounting's PLD accountant: the accounting of a
correlated mechanism without amplification. ``tests/test_dp_bisr.py`` and
``tests/test_dp_mechanisms.py`` compare this library's figures with these.
"""

from __future__ import annotations

import json
import sys

import dp_accounting
import jax
import numpy as np

jax.config.update("jax_enable_x64", True)

from jax_privacy import batch_selection  # noqa: E402
from jax_privacy.experimental.monte_carlo import delta_calculation, sample_generation  # noqa: E402
from jax_privacy.matrix_factorization import buffered_toeplitz, toeplitz  # noqa: E402

DELTA = 1e-5
NOISE_PER_PARTICIPATION = (2.0, 8.0)  # sigma = this x sqrt(max participations): epsilon of a few units
BISR_GRID = [(n, bands, sep) for n in (16, 64, 256) for bands in (1, 2, 4, 8) for sep in (1, 4, 16) if sep <= n]
MIN_SEP_GRID = [(1000, 0.2, 4, 400), (500, 0.5, 8, 400), (300, 1.0, 5, 100)]  # (N, p, b, T)
RUNS = 10
BLT_GRID = [
    (64, 4, (0.9, 0.5), (0.3, 0.1)),
    (256, 16, (0.99, 0.8, 0.3), (0.05, 0.1, 0.2)),
    (100, 1, (0.7,), (0.4,)),
]

# (steps, cycle_length, noise multiplier, C): C a BLT (theta, omega) or explicit banded coefficients
MC_GRID = [
    (48, 12, 1.5, {"theta": (0.9, 0.5), "omega": (0.3, 0.1)}),
    (60, 20, 1.0, {"theta": (0.7,), "omega": (0.4,)}),
    (40, 8, 2.0, {"coefficients": (1.0, 0.6, 0.3)}),
]
MC_DRAWS = 6
MC_SAMPLES = 400_000
MC_EPSILONS = (0.5, 1.0, 2.0)


def epsilon(noise_multiplier: float) -> float:
    accountant = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4
    )
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier))
    return float(accountant.get_epsilon(DELTA))


def entry(coefs, n: int, sep: int) -> dict:
    k = -(-n // sep)
    s2 = float(toeplitz.minsep_sensitivity_squared(coefs, min_sep=sep, max_participations=k, n=n))
    return {
        "n": n,
        "min_sep": sep,
        "max_participations": k,
        "sensitivity_squared": s2,
        "epsilon": [
            {"noise_multiplier": sigma, "epsilon": epsilon(sigma / np.sqrt(s2))}
            for sigma in (m * np.sqrt(k) for m in NOISE_PER_PARTICIPATION)
        ],
    }


def min_sep_law(n: int, p: float, b: int, steps: int) -> dict:
    counts, gaps = [], []
    for run in range(RUNS):
        sampler = batch_selection.BMinSepSampling(sampling_prob=p, iterations=steps, min_sep=b, warm_start=True)
        last = np.full(n, -(10**9))
        count = np.zeros(n, np.int64)
        for t, batch in enumerate(sampler.batch_iterator(n, rng=run)):
            batch = np.asarray(batch, np.int64)
            gaps.extend((t - last[batch]).tolist())
            last[batch] = t
            count[batch] += 1
        counts.append(count)
    counts = np.concatenate(counts).astype(np.float64)
    return {
        "n": n,
        "p": p,
        "min_sep": b,
        "steps": steps,
        "runs": RUNS,
        "count_mean": float(counts.mean()),
        "count_variance": float(counts.var(ddof=1)),
        "smallest_gap": int(min(gaps)),
    }


def monte_carlo(steps: int, cycle: int, sigma: float, spec: dict) -> dict:
    if "theta" in spec:
        c = np.asarray(
            buffered_toeplitz.BufferedToeplitz.build(
                buf_decay=spec["theta"], output_scale=spec["omega"]
            ).toeplitz_coefs(steps)
        )
    else:
        c = np.asarray(spec["coefficients"], np.float64)
    strategy = batch_selection.BallsInBinsSampling(cycle_length=cycle, iterations=steps)
    entry = {"steps": steps, "cycle_length": cycle, "noise_multiplier": sigma, **spec, "c": c.tolist()}
    for positive in (True, False):
        y = sample_generation.generate_sample(
            strategy, sigma, c, seed=7, positive_sample=positive, num_samples=MC_DRAWS
        )
        loss = sample_generation.compute_privacy_loss(strategy, y, sigma, c)
        losses, _ = sample_generation.get_privacy_loss_sample(
            strategy, sigma, c, seed=11, positive_sample=positive, num_samples=MC_SAMPLES
        )
        deltas = []
        for eps in MC_EPSILONS:
            terms = -np.expm1(np.minimum(eps - np.asarray(losses), 0.0))
            deltas.append(
                {
                    "epsilon": eps,
                    "delta": float(delta_calculation.delta_from_epsilon_and_samples(eps, losses)),
                    "standard_error": float(terms.std(ddof=1) / np.sqrt(terms.size)),
                }
            )
        entry["P" if positive else "Q"] = {
            "y": np.asarray(y).T.tolist(),
            "loss": np.asarray(loss).tolist(),
            "samples": MC_SAMPLES,
            "deltas": deltas,
        }
    return entry


def main() -> None:
    import importlib.metadata as metadata

    out = {
        "generated_by": "benchmarks/peers/jax_privacy_reference.py",
        "jax_privacy": metadata.version("jax-privacy"),
        "dp_accounting": metadata.version("dp-accounting"),
        "delta": DELTA,
        "bisr": [],
        "blt": [],
        "min_sep": [min_sep_law(*case) for case in MIN_SEP_GRID],
        "monte_carlo": [monte_carlo(*case) for case in MC_GRID],
    }
    for n, bands, sep in BISR_GRID:
        inverse = np.asarray(toeplitz.optimal_max_error_noising_coefs(n))[:bands]
        coefs = toeplitz.inverse_coef(inverse, n)
        out["bisr"].append({"bands": bands, **entry(coefs, n, sep)})
    for n, sep, theta, omega in BLT_GRID:
        blt = buffered_toeplitz.BufferedToeplitz.build(buf_decay=theta, output_scale=omega)
        coefs = blt.toeplitz_coefs(n)
        out["blt"].append({"theta": list(theta), "omega": list(omega), **entry(coefs, n, sep)})
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
