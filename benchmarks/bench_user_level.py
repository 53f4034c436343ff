"""User-level DP-SGD against example-level DP-SGD at equal user-level epsilon, and the cost of a step.

Task: a synthetic classification where users differ. ``U`` training users,
each with 1 to ``2 k`` rows (uniform); user ``u``'s rows share a style (a
shift ``s_u ~ N(0, tau^2 I)`` of every feature vector) and a label bias
(class probabilities ``~ Dirichlet(alpha)``); ``x = mu_y + s_u + N(0, I)``.
The test set is held-out users drawn the same way; the metric is accuracy.

Both runs take the same number of steps ``T`` with the same expected rows
per step, and every user gets the same guarantee ``(epsilon, delta)`` for
all of their rows:

- **user-level**: ``poisson_batches(..., unit_ids=user, rows_per_unit=k)``
  samples users at ``q_u``, each bringing at most ``k`` rows (drawn afresh
  each step); ``DPModel(privacy_unit="unit")`` clips each user's summed
  gradient to ``C_u``; sigma from ``peg.dp.noise_multiplier_for_epsilon``
  over the ``U`` users (PLD), and the epsilon reported is
  ``DPModel.epsilon``.
- **example-level + group privacy**: each user's rows are first cut to at
  most ``k`` (chosen once, at random: contribution bounding, as Charles et
  al. 2024 do for example-level sampling), rows are sampled at ``q_e``,
  each row clipped to ``C_e``. A user's guarantee is then that of ``k`` rows:
  per step, ``j ~ Binomial(k, q_e)`` of the user's rows are in the batch and
  shift the clipped sum by at most ``j C_e``, so the step is dominated by the
  mixture of Gaussians ``sum_j P(j) N(j, sigma^2)`` against ``N(0, sigma^2)``
  (in units of ``C_e``): dp-accounting's ``MixtureOfGaussiansDpEvent``,
  composed ``T`` times with its PLD accountant (the tight group-privacy
  accountant for Poisson example sampling of Charles et al. 2024). sigma is
  calibrated on that (``dp_accounting.calibrate_dp_mechanism``). The
  standard conversion from the per-row guarantee, ``(k eps_row, k
  e^{(k-1) eps_row} delta_row)``, is printed beside it to show what a
  looser analysis would claim.

Per-step cost: the train steps of the two ``DPModel`` s (user-level: units
of ``k`` rows) on the same batch size, timed side by side (round-robin,
medians), on the task's MLP and on a tiny KerasHub GPT-2.

Run: ``python benchmarks/bench_user_level.py [--seeds 3] [--steps 150]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import dp_accounting
import keras
import numpy as np
from dp_accounting.pld import PLDAccountant

import per_example_grads as peg
from per_example_grads.dp.accounting import user_level_event

D, CLASSES, TAU, ALPHA = 16, 4, 1.0, 0.5


def make_users(num_users: int, k: int, rng: np.random.Generator, means: np.ndarray):
    """``(x, y, user)`` rows of ``num_users`` users with 1..2k rows each (module docstring).

    The users' sizes are the same for every seed (their own fixed draw), so
    ``q`` and sigma are too; styles, labels and features vary with ``rng``.
    """
    sizes = np.random.default_rng(12345).integers(1, 2 * k + 1, num_users)
    xs, ys, users = [], [], []
    for u, n in enumerate(sizes):
        style = TAU * rng.normal(size=D)
        labels = rng.choice(CLASSES, size=n, p=rng.dirichlet([ALPHA] * CLASSES))
        xs.append(means[labels] + style + rng.normal(size=(n, D)))
        ys.append(labels)
        users.append(np.full(n, u))
    return np.concatenate(xs).astype("float32"), np.concatenate(ys), np.concatenate(users)


def cap_rows(user: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of at most ``k`` rows per user, chosen once at random (contribution bounding)."""
    keep = []
    for u in np.unique(user):
        rows = np.flatnonzero(user == u)
        keep.extend(rng.choice(rows, size=min(k, len(rows)), replace=False))
    return np.sort(np.array(keep))


def group_epsilon(sigma: float, q: float, k: int, steps: int, delta: float, interval: float = 1e-4) -> float:
    """Epsilon for all ``k`` rows of one user under Poisson example sampling (module docstring)."""
    event = user_level_event(sigma, q, k, steps)
    accountant = PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=interval
    )
    return accountant.compose(event).get_epsilon(delta)


def group_sigma(target: float, q: float, k: int, steps: int, delta: float) -> float:
    """The smallest sigma whose ``group_epsilon`` (on a 10x coarser grid, then checked on the fine one) is at most ``target``."""

    def event(sigma):
        return user_level_event(sigma, q, k, steps)

    sigma = dp_accounting.calibrate_dp_mechanism(
        lambda: PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-3),
        event,
        target,
        delta,
        dp_accounting.ExplicitBracketInterval(0.3, 50.0),
        tol=1e-2,
    )
    while group_epsilon(sigma, q, k, steps, delta) > target:  # the coarse grid is pessimistic, rarely short
        sigma *= 1.002
    return sigma


def conversion_epsilon(sigma: float, q: float, k: int, steps: int, delta: float) -> float:
    """The standard group-privacy conversion: ``k eps_row`` at ``delta_row = delta / (k e^{(k-1) eps_row})``.

    Solved for the per-row delta by fixed-point iteration, so the user's
    delta is ``delta``.
    """
    composed = PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE).compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
        )
    )
    eps_row = 0.0
    for _ in range(100):
        new = composed.get_epsilon(delta / (k * math.exp((k - 1) * eps_row)))
        if abs(new - eps_row) < 1e-6:
            break
        eps_row = new
    return k * eps_row


def mlp(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((D,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(CLASSES)])


def accuracy(model, x, y) -> float:
    return float(np.mean(np.argmax(model.predict(x, verbose=0, batch_size=1024), -1) == y))


def run_utility(args) -> None:
    delta = args.delta
    print(
        f"U={args.users} users (1..{2 * args.k} rows each), k={args.k}, T={args.steps} steps, "
        f"{args.rows_per_step} expected rows per step, delta={delta:g}, {args.seeds} seeds"
    )
    print(
        "| target eps | mode | sigma | eps a user gets (accountant) | eps by (k eps, k e^((k-1)eps) delta) conversion | test accuracy (mean +- sd) |"
    )
    print("|---|---|---|---|---|---|")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for target in args.epsilons:
        results = {"user-level": [], "example-level": []}
        sigmas, eps_given, conv = {}, {}, {}
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            means = 1.5 * rng.normal(size=(CLASSES, D))
            x, y, user = make_users(args.users, args.k, rng, means)
            xt, yt, _ = make_users(args.test_users, args.k, rng, means)
            # user-level
            brought = np.minimum(np.bincount(user), args.k).sum()
            q_u = args.rows_per_step / brought
            if "user-level" not in sigmas:
                sigmas["user-level"] = peg.dp.noise_multiplier_for_epsilon(
                    target, delta, args.users, q_u * args.users, None, steps=args.steps
                )
            net = mlp(seed)
            dp = peg.keras.DPModel(
                net,
                l2_norm_clip=args.clip * args.k**0.5,
                noise_multiplier=sigmas["user-level"],
                seed=seed,
                privacy_unit="unit",
            )
            dp.compile(optimizer=keras.optimizers.Adam(args.lr), loss=loss)
            data = peg.dp.poisson_batches(
                x, y, unit_ids=user, rows_per_unit=args.k, sampling_probability=q_u, steps=args.steps, seed=seed
            )
            dp.fit(data, verbose=0)
            eps_given["user-level"] = dp.epsilon(delta)
            results["user-level"].append(accuracy(net, xt, yt))
            # example-level, each user cut to k rows, group privacy over k rows
            keep = cap_rows(user, args.k, rng)
            q_e = args.rows_per_step / len(keep)
            if "example-level" not in sigmas:
                sigmas["example-level"] = group_sigma(target, q_e, args.k, args.steps, delta)
                eps_given["example-level"] = group_epsilon(sigmas["example-level"], q_e, args.k, args.steps, delta)
                conv["example-level"] = conversion_epsilon(sigmas["example-level"], q_e, args.k, args.steps, delta)
                conv["user-level"] = float("nan")
            net = mlp(seed)
            dp = peg.keras.DPModel(net, l2_norm_clip=args.clip, noise_multiplier=sigmas["example-level"], seed=seed)
            dp.compile(optimizer=keras.optimizers.Adam(args.lr), loss=loss)
            dp.fit(
                peg.dp.poisson_batches(x[keep], y[keep], sampling_probability=q_e, steps=args.steps, seed=seed),
                verbose=0,
            )
            results["example-level"].append(accuracy(net, xt, yt))
        for mode, accs in results.items():
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            c = conv[mode]
            print(
                f"| {target:g} | {mode} | {sigmas[mode]:.3f} | {eps_given[mode]:.3f} | "
                f"{'-' if math.isnan(c) else f'{c:.2f}'} | {statistics.mean(accs):.3f} +- {sd:.3f} |",
                flush=True,
            )
    # Non-private reference.
    accs = []
    for seed in range(args.seeds):
        rng = np.random.default_rng(seed)
        means = 1.5 * rng.normal(size=(CLASSES, D))
        x, y, _ = make_users(args.users, args.k, rng, means)
        xt, yt, _ = make_users(args.test_users, args.k, rng, means)
        net = mlp(seed)
        net.compile(optimizer=keras.optimizers.Adam(args.lr), loss=loss)
        net.fit(
            x,
            y,
            batch_size=int(args.rows_per_step),
            epochs=max(1, round(args.steps * args.rows_per_step / len(x))),
            verbose=0,
        )
        accs.append(accuracy(net, xt, yt))
    print(
        f"| - | non-private | - | - | - | {statistics.mean(accs):.3f} +- {statistics.stdev(accs) if len(accs) > 1 else 0:.3f} |"
    )


def _time_steps(models, reps: int, steps: int) -> dict:
    """Median seconds per DP step of each ``(dp, data)``, timed round-robin, after one warm-up fit each."""
    for dp, data in models.values():
        dp.fit(data, verbose=0)
    times = {name: [] for name in models}
    for _ in range(reps):
        for name, (dp, data) in models.items():
            start = time.perf_counter()
            dp.fit(data, verbose=0)
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(t) for name, t in times.items()}


def run_cost(args) -> None:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    print("\n| model | rows per step | example-level step (ms) | user-level step, units of k rows (ms) | ratio |")
    print("|---|---|---|---|---|")
    cases = []
    b, k = args.cost_rows, args.k
    x = rng.normal(size=(4 * b, D)).astype("float32")
    y = rng.integers(0, CLASSES, 4 * b)
    cases.append(("mlp", lambda: mlp(0), x, y, loss))
    from per_example_grads.apps import zoo

    t, vocab = 16, 256
    ids = rng.integers(1, vocab, (4 * args.cost_rows_lm, t + 1))
    lm_x, lm_y = {"token_ids": ids[:, :t], "padding_mask": np.ones_like(ids[:, :t])}, ids[:, 1:]
    cases.append(("gpt2_lm", lambda: zoo.build_model("gpt2_lm", vocabulary_size=vocab, seq_len=t), lm_x, lm_y, loss))
    for name, build, x, y, loss_fn in cases:
        n = len(y)
        rows = b if name == "mlp" else args.cost_rows_lm
        models = {}
        for mode in ("example", "unit"):
            dp = peg.keras.DPModel(build(), l2_norm_clip=1.0, noise_multiplier=1.0, seed=0, privacy_unit=mode)
            dp.compile(optimizer="sgd", loss=loss_fn)
            q = 0.25  # rows per step: q n = rows (units of k rows: q (n / k) units)
            units = {} if mode == "example" else dict(unit_ids=np.arange(n) // k, rows_per_unit=k)
            data = peg.dp.poisson_batches(x, y, sampling_probability=q, steps=args.cost_steps, seed=0, **units)
            models[mode] = (dp, data)
        med = _time_steps(models, args.reps, args.cost_steps)
        print(
            f"| {name} | {rows} (expected) | {1e3 * med['example']:.1f} | {1e3 * med['unit']:.1f} | "
            f"{med['unit'] / med['example']:.2f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=500)
    parser.add_argument("--test-users", type=int, default=300)
    parser.add_argument("--k", type=int, default=8, help="rows_per_unit, and the rows kept per user for example-level")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rows-per-step", type=float, default=256)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--delta", type=float, default=1e-4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--clip", type=float, default=1.0, help="C per row; per user C sqrt(k)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--cost-rows", type=int, default=256)
    parser.add_argument("--cost-rows-lm", type=int, default=64)
    parser.add_argument("--cost-steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip-utility", action="store_true")
    parser.add_argument("--skip-cost", action="store_true")
    args = parser.parse_args()
    if not args.skip_utility:
        run_utility(args)
    if not args.skip_cost:
        run_cost(args)


if __name__ == "__main__":
    main()
