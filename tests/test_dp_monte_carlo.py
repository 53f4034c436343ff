"""Monte-Carlo accounting (``per_example_grads.dp.monte_carlo``) against three independent references.

* The privacy loss against brute force: the dominating pair's density ratio
  summed over every part and every participation pattern (``2^k`` Gaussians
  per part), on runs small enough to enumerate; where ``C`` outlasts the
  cycle at ``q < 1``, its bounds on each side of it, within their slack.
* jax_privacy 2.0.0's own Monte-Carlo accounting of balls-in-bins sampling
  (``data/jax_privacy_reference.json``, "monte_carlo"; computed in its own
  virtualenv by ``benchmarks/peers/jax_privacy_reference.py``): the losses of
  its draws, and its estimated deltas.
* dp_accounting's PLD for DP-SGD (``C = I``, one part), where the pair is the
  Poisson-subsampled Gaussian's and the exact delta is known.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib

import dp_accounting
import keras
import numpy as np
import pytest
import scipy.special

import per_example_grads as peg
from per_example_grads.dp import monte_carlo as mc
from per_example_grads.dp.accounting import compute_epsilon, noise_multiplier_for_epsilon

REFERENCE = json.loads((pathlib.Path(__file__).parent / "data" / "jax_privacy_reference.json").read_text())
# Two float64 programs evaluating the same log-sum-exp of T-term dot products (T <= 60, |y| < 20):
# a few hundred roundings of values below 1e3.
LOSS_ATOL = 1e-9
# Means of independent Monte-Carlo draws: their difference over its standard error is about N(0, 1);
# five standard errors fail a correct pair once in 1.7 million.
STANDARD_ERRORS = 5.0


def _toeplitz(c, steps):
    c = np.asarray(c, np.float64)
    return np.array([[c[i - j] if 0 <= i - j < c.size else 0.0 for j in range(steps)] for i in range(steps)])


def _brute_force_loss(c, sigma, steps, cycle, q, y):
    """``log dP/dQ`` at every column of ``y``, summed over every part and participation pattern."""
    matrix = _toeplitz(c, steps)
    losses = []
    for column in y.T:
        terms = []
        for part in range(cycle):
            turns = list(range(part, steps, cycle))
            for joined in itertools.product((0, 1), repeat=len(turns)):
                k = sum(joined)
                if q == 1.0 and k < len(turns):
                    continue
                weight = 0.0 if q == 1.0 else k * math.log(q) + (len(turns) - k) * math.log1p(-q)
                x = np.zeros(steps)
                x[turns] = joined
                mean = matrix @ x
                terms.append(weight + (mean @ column - 0.5 * mean @ mean) / sigma**2)
        losses.append(scipy.special.logsumexp(terms) - math.log(cycle))
    return np.array(losses)


@pytest.mark.parametrize(
    "c, steps, cycle, q",
    [
        ([1.0], 7, 1, 0.3),  # DP-SGD
        ([1.0, 0.5, 0.2], 9, 3, 0.4),  # BandMF, bands = cycle
        ([1.0, 0.5], 9, 4, 1.0),  # bands < cycle, whole parts
        ([1.0, 0.6, 0.3, 0.2, 0.1], 8, 2, 1.0),  # C longer than the cycle: one mode per part
        ([1.0, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05], 8, 3, 1.0),
        ([1.0, 0.5], 5, 8, 1.0),  # more parts than steps: some parts never take a turn (a run cut short)
        ([1.0, 0.5, 0.2], 4, 6, 0.5),
        # C longer than the cycle at q < 1: the chain's window spans every turn, so both bounds are L
        ([1.0, 0.6, 0.3, 0.2, 0.1], 8, 2, 0.4),
        ([1.0, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05], 9, 3, 0.3),
        ([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4], 7, 1, 0.5),  # seven turns, every pair overlapping
        ([1.0, 0.5, 0.2], 7, 1, 0.3),
    ],
)
def test_privacy_loss_is_the_enumerated_mixtures(c, steps, cycle, q):
    rng = np.random.default_rng(1)
    pair = mc._Pair(mc._checked_coefficients(c, steps, cycle, q), 0.8, steps, cycle, q)
    assert pair.slack == 0.0
    for positive in (True, False):
        y = pair.draw(rng, 6, positive)
        expected = _brute_force_loss(c, 0.8, steps, cycle, q, y)
        for upper in (True, False):
            np.testing.assert_allclose(pair.loss(y, upper), expected, rtol=0, atol=LOSS_ATOL)


BOUNDED_RUNS = [  # (c, steps, cycle, q, window): more turns than the window keeps exactly
    ([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1], 10, 1, 0.5, 2),
    ([1.0] + [0.85**k for k in range(1, 12)], 12, 2, 0.4, 1),
    ([1.0] + [0.85**k for k in range(1, 12)], 12, 2, 0.4, 3),
]


@pytest.mark.parametrize("c, steps, cycle, q, window", BOUNDED_RUNS)
def test_a_window_short_of_the_run_bounds_the_loss_within_its_slack(monkeypatch, c, steps, cycle, q, window):
    """Draws of P get an upper bound of L, draws of Q a lower one, each within the pair's slack of the enumeration."""
    monkeypatch.setattr(mc, "_MAX_WINDOW", window)
    monkeypatch.setattr(mc, "_LOSS_SLACK", 0.0)  # the window stays at its maximum
    pair = mc._Pair(mc._checked_coefficients(c, steps, cycle, q), 0.8, steps, cycle, q)
    assert pair.window == window and pair.slack > 0
    rng = np.random.default_rng(3)
    gaps = []
    for positive in (True, False):
        y = pair.draw(rng, 8, positive)
        exact = _brute_force_loss(c, 0.8, steps, cycle, q, y)
        above, below = pair.loss(y, True) - exact, exact - pair.loss(y, False)
        assert np.all(above >= -LOSS_ATOL) and np.all(below >= -LOSS_ATOL)
        assert np.all(above <= pair.slack + LOSS_ATOL) and np.all(below <= pair.slack + LOSS_ATOL)
        gaps.append(above.max() + below.max())
    assert max(gaps) > 1e-3  # the bounds are bounds here, not the exact loss


def test_a_bounded_epsilon_is_at_most_its_slack_above_the_exact_one(monkeypatch):
    """On the same draws, the epsilon of the bounded losses lies in [exact, exact + slack]."""
    c, steps, cycle, q = [1.0] + [0.85**k for k in range(1, 12)], 12, 2, 0.4
    exact = mc.monte_carlo_epsilon(c, 0.8, steps, delta=1e-2, cycle_length=cycle, sampling_probability=q, seed=2)
    assert exact.loss_slack == 0.0  # six turns: the default window spans them
    monkeypatch.setattr(mc, "_MAX_WINDOW", 1)
    monkeypatch.setattr(mc, "_LOSS_SLACK", 0.0)
    bounded = mc.monte_carlo_epsilon(c, 0.8, steps, delta=1e-2, cycle_length=cycle, sampling_probability=q, seed=2)
    assert bounded.loss_slack > 0.05
    assert exact.epsilon < bounded.epsilon <= exact.epsilon + bounded.loss_slack + 1e-5


def test_whole_parts_give_one_loss_by_either_formula():
    """A banded C at q = 1 has both formulas (factorized and one mode per part); they agree."""
    c, steps, cycle = np.array([1.0, 0.5, 0.25]), 30, 5
    banded = mc._Pair(c, 1.3, steps, cycle, 1.0)
    modes = mc._Pair(c, 1.3, steps, cycle, 1.0)
    modes.banded = False
    y = banded.draw(np.random.default_rng(0), 50, True)
    np.testing.assert_allclose(banded.loss(y), modes.loss(y), rtol=0, atol=LOSS_ATOL)


def _reference_pair(case):
    c = np.asarray(case["c"])
    if "theta" in case:  # jax_privacy's BufferedToeplitz is this library's BLT
        blt = peg.dp.BLT(
            buffers=len(case["theta"]),
            num_steps=case["steps"],
            cycle_length=case["cycle_length"],
            theta=case["theta"],
            omega=case["omega"],
        )
        np.testing.assert_allclose(blt.coefficients, c, rtol=1e-12, atol=0)
    return mc._Pair(
        mc._checked_coefficients(c, case["steps"], case["cycle_length"], 1.0),
        case["noise_multiplier"],
        case["steps"],
        case["cycle_length"],
        1.0,
    )


@pytest.mark.parametrize("case", REFERENCE["monte_carlo"], ids=lambda case: f"T{case['steps']}-b{case['cycle_length']}")
def test_losses_of_jax_privacys_draws_are_jax_privacys(case):
    pair = _reference_pair(case)
    for side in ("P", "Q"):
        y = np.asarray(case[side]["y"]).T
        np.testing.assert_allclose(pair.loss(y), case[side]["loss"], rtol=0, atol=LOSS_ATOL)


@pytest.mark.parametrize("case", REFERENCE["monte_carlo"], ids=lambda case: f"T{case['steps']}-b{case['cycle_length']}")
def test_estimated_deltas_match_jax_privacys(case):
    samples = 100_000
    for side in ("P", "Q"):
        losses = mc.privacy_losses(
            case["c"],
            case["noise_multiplier"],
            case["steps"],
            cycle_length=case["cycle_length"],
            samples=samples,
            positive=side == "P",
            seed=3,
        )
        for ref in case[side]["deltas"]:
            terms = -np.expm1(np.minimum(ref["epsilon"] - losses, 0.0))
            ours, error = terms.mean(), terms.std(ddof=1) / math.sqrt(samples)
            assert abs(ours - ref["delta"]) <= STANDARD_ERRORS * math.hypot(error, ref["standard_error"]), (
                side,
                ref,
                ours,
            )


def _pld_delta(sigma, q, steps, epsilon):
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return accountant.get_delta(epsilon)


@pytest.mark.parametrize("sigma, q, steps", [(1.0, 0.1, 20), (0.8, 0.05, 60), (2.0, 0.5, 10)])
def test_dp_sgd_epsilon_holds_and_is_tight_against_pld(sigma, q, steps):
    """At the reported epsilon the exact delta is within the stated delta, and not far below the base delta."""
    r = mc.monte_carlo_epsilon(peg.dp.GaussianNoise(), sigma, steps, delta=1e-2, sampling_probability=q, seed=0)
    exact = _pld_delta(sigma, q, steps, r.epsilon)
    assert exact <= r.delta
    # Met at base_delta by an estimate of relative error about 1 / sqrt(samples * base_delta) = 0.2.
    assert exact >= 0.4 * r.base_delta, (r, exact)


def test_stated_delta_folds_the_draws_failure_probability():
    delta = 1e-3
    m = mc.samples_for(delta)
    assert mc.folded_delta(delta / 2, m) <= delta < mc.folded_delta(delta / 2, int(0.97 * m))
    beta = mc.base_delta_for(delta, m)
    assert 0.49 * delta <= beta < delta  # base_delta_for searches a grid of 1% steps
    assert mc.folded_delta(beta, m) <= delta
    # tau beta + 2 exp(-M KL(beta || tau beta)) at one tau: never below the minimum over tau.
    tau = 1.5
    kl = beta * math.log(1 / tau) + (1 - beta) * math.log((1 - beta) / (1 - tau * beta))
    assert mc.folded_delta(beta, m) <= tau * beta + 2 * math.exp(-m * kl)
    # K draws to choose from: K times the failure probability (a union bound), so more samples for the same delta.
    assert mc.folded_delta(beta, m, draws=3) <= tau * beta + 6 * math.exp(-m * kl)
    assert mc.folded_delta(beta, m) < mc.folded_delta(beta, m, draws=3)
    assert mc.samples_for(delta) < mc.samples_for(delta, draws=3) < 1.2 * mc.samples_for(delta)


@pytest.mark.parametrize(
    "mechanism, q",
    [
        (lambda: peg.dp.BandMF(4, 200, cycle_length=50), 0.5),
        (lambda: peg.dp.BandMF(4, 200, cycle_length=50), 1.0),
        (lambda: peg.dp.BLT(2, 200, cycle_length=50), 1.0),
        (lambda: peg.dp.BISR(bands=4, num_steps=200, cycle_length=50), 1.0),
        (lambda: peg.dp.BLT(2, 200, cycle_length=50), 0.5),
        (lambda: peg.dp.BISR(bands=4, num_steps=200, cycle_length=50), 0.5),
    ],
)
def test_a_random_part_amplifies_the_ledger_accounting(mechanism, q):
    """Few turns of many parts (4 of 50): the Monte-Carlo epsilon is well below the ledger's, which takes the part as known."""
    m, n = mechanism(), 50  # delta 1e-2 < 1 / n: 6,300 draws of each side
    ledger = compute_epsilon(n, q * n / 50, None, 2.0, 1e-2, steps=200, sampling_probability=q, mechanism=m)
    r = mc.monte_carlo_epsilon(m, 2.0, 200, delta=1e-2, sampling_probability=q, seed=0)
    assert r.epsilon < 0.8 * ledger, (r, ledger)


def test_refusals_name_the_argument():
    blt = peg.dp.BLT(2, 40, cycle_length=4)
    with pytest.raises(
        ValueError, match="noise_multiplier=0.001 is too small for Monte-Carlo accounting of a C longer"
    ):
        mc.monte_carlo_epsilon(blt, 1e-3, 40, delta=1e-2, sampling_probability=0.5, samples=7000)
    with pytest.raises(ValueError, match="leave cycle_length out"):
        mc.monte_carlo_epsilon(blt, 1.0, 40, delta=1e-2, cycle_length=8)
    with pytest.raises(ValueError, match="needs C >= 0"):
        mc.monte_carlo_epsilon([1.0, -0.5], 1.0, 10, delta=1e-2, cycle_length=2)
    with pytest.raises(ValueError, match=r"samples=100 are too few .* take at least 6300"):
        mc.monte_carlo_epsilon([1.0], 1.0, 10, delta=1e-2, samples=100)

    class Opaque(peg.dp.NoiseMechanism):
        def accounted_as(self, noise_multiplier, sampling_probability, steps):
            return noise_multiplier, sampling_probability, steps

    with pytest.raises(ValueError, match="states no Toeplitz coefficients"):
        mc.monte_carlo_epsilon(Opaque(name="opaque"), 1.0, 10, delta=1e-2)


def test_same_seed_same_epsilon_and_draws_differ_by_seed():
    a, b, c = (mc.monte_carlo_epsilon([1.0, 0.5], 1.0, 30, delta=1e-2, cycle_length=5, seed=s) for s in (4, 4, 5))
    assert a == b and a.epsilon != c.epsilon


@pytest.mark.parametrize("q, cycle", [(0.4, 3), (1.0, 3), (0.4, 2)])  # (0.4, 2): C outlasts the cycle, C x by FFT
def test_draws_of_p_have_the_mixtures_mean_and_q_is_unshifted_noise(q, cycle):
    """E_P y = (q / b) sum_s C 1_s (each turn of each part joins at rate q / b); E_Q y = 0; both of variance sigma^2."""
    c, steps, sigma, m = np.array([1.0, 0.5, 0.2]), 9, 0.7, 200_000
    pair = mc._Pair(c, sigma, steps, cycle, q)
    expected = (q / cycle) * _toeplitz(c, steps) @ np.ones(steps)
    for positive, mean in ((True, expected), (False, np.zeros(steps))):
        y = pair.draw(np.random.default_rng(2), m, positive)
        spread = y.std(axis=1, ddof=1)
        assert np.all(np.abs(y.mean(axis=1) - mean) <= STANDARD_ERRORS * spread / math.sqrt(m))
        if not positive:
            assert np.all(np.abs(spread - sigma) <= STANDARD_ERRORS * sigma / math.sqrt(2 * m))


def test_a_long_kernels_correlation_by_fft_is_the_shifted_dot_products():
    """``_correlation`` takes a kernel of more than 32 coefficients by FFT; row j is still <kernel shifted by j, y>."""
    rng = np.random.default_rng(4)
    kernel, y = 0.97 ** np.arange(90), rng.normal(size=(120, 5))
    expected = np.stack([_toeplitz(kernel, 120)[:, j] @ y for j in range(120)])
    # float64 FFTs of length about 256: rounding of a few 1e-16 of |kernel| |y| (about 50 here).
    np.testing.assert_allclose(mc._correlation(y, kernel), expected, rtol=0, atol=1e-12)


# -- DPModel.monte_carlo_epsilon: the ledger's run, where it meets restores, units, chunks and other samplers --

N_ROWS = 48
X_ROWS = np.random.default_rng(0).normal(size=(N_ROWS, 3)).astype("float32")
Y_ROWS = np.random.default_rng(1).normal(size=(N_ROWS, 2)).astype("float32")
SIGMA = 1.5


def _dp(mechanism, **kw):
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=kw.pop("sigma", SIGMA), mechanism=mechanism, **kw)
    dp.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return dp


def _cyclic(q, steps, first_step=0, **kw):
    return peg.dp.poisson_batches(
        X_ROWS, Y_ROWS, sampling_probability=q, cycle_length=4, steps=steps, seed=5, first_step=first_step, **kw
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "make, q, kw",
    [
        (lambda: peg.dp.BLT(buffers=2, num_steps=12, cycle_length=4), 1.0, {}),
        (lambda: peg.dp.BandMF(bands=2, num_steps=12, cycle_length=4), 0.5, {"physical_batch_size": 4}),
        (lambda: peg.dp.BLT(buffers=2, num_steps=12, cycle_length=4), 0.5, {}),  # its loss chained (exact here)
    ],
    ids=["blt", "bandmf-chunks", "blt-q<1"],
)
def test_a_dp_models_run_is_accounted_as_the_function_accounts_it_and_survives_a_restore(tmp_path, make, q, kw):
    dp = _dp(make(), **kw)
    assert dp.monte_carlo_epsilon(1e-3).epsilon == 0.0  # nothing spent yet
    dp.fit(_cyclic(q, 6), verbose=0)
    dp.save_weights(tmp_path / "run.weights.h5")
    restored = _dp(make(), **kw)
    restored.load_weights(tmp_path / "run.weights.h5")
    restored.fit(_cyclic(q, 6, first_step=6), verbose=0)  # a second fit, after the restore
    assert int(restored.dp_steps.numpy()) == 12
    got = restored.monte_carlo_epsilon(1e-3, seed=7)
    assert got == mc.monte_carlo_epsilon(make(), SIGMA, 12, delta=1e-3, sampling_probability=q, seed=7)
    assert got.epsilon < restored.epsilon(1e-3)


@pytest.mark.slow
def test_a_unit_level_run_is_accounted_over_its_units():
    units = np.arange(N_ROWS) // 3  # 16 units of 3 rows
    dp = _dp(peg.dp.BandMF(bands=2, num_steps=8, cycle_length=4), privacy_unit="unit")
    dp.fit(_cyclic(0.5, 8, unit_ids=units), verbose=0)
    got = dp.monte_carlo_epsilon(1e-2, seed=1)
    assert got == mc.monte_carlo_epsilon(dp.mechanism, SIGMA, 8, delta=1e-2, sampling_probability=0.5, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["two noise multipliers", "b-min-sep", "fixed-size batches"])
def test_a_ledger_that_is_not_one_poisson_run_is_refused(tmp_path, case):
    blt = lambda: peg.dp.BLT(buffers=1, num_steps=12, cycle_length=4)  # noqa: E731
    if case == "two noise multipliers":
        dp = _dp(blt())
        dp.fit(_cyclic(1.0, 4), verbose=0)
        dp.save_weights(tmp_path / "run.weights.h5")
        dp = _dp(blt(), sigma=2 * SIGMA)
        dp.load_weights(tmp_path / "run.weights.h5")
        dp.fit(_cyclic(1.0, 4, first_step=4), verbose=0)
        match = "ran at 2 settings"
    elif case == "b-min-sep":
        dp = _dp(blt())
        dp.fit(peg.dp.min_sep_batches(X_ROWS, Y_ROWS, sampling_probability=0.5, min_separation=4, steps=4), verbose=0)
        match = "b-min-sep sampled, not cyclic Poisson sampled"
    else:
        dp = _dp(peg.dp.GaussianNoise(), num_examples=N_ROWS, expected_batch_size=8)
        dp.train_on_batch(X_ROWS[:8], Y_ROWS[:8])
        match = "not all drawn by poisson_batches"
    with pytest.raises(ValueError, match=f"Monte-Carlo accounting needs a run of poisson_batches steps .*{match}"):
        dp.monte_carlo_epsilon(1e-2)


# --- calibration (monte_carlo_noise_multiplier)


def test_calibrated_dp_sgd_is_near_plds_least_sigma_and_its_certificate_holds():
    """DP-SGD, where PLD is exact: the certificate's (epsilon, delta) is true, and sigma is near PLD's least."""
    target, q, steps, delta = 2.0, 0.1, 20, 1e-2
    samples = mc.samples_for(delta, draws=3)
    beta = mc.base_delta_for(delta, samples, draws=3)
    least = noise_multiplier_for_epsilon(target, beta, 100, q * 100, None, steps=steps)  # delta < 1 / N
    for seed in (0, 1):
        r = mc.monte_carlo_noise_multiplier([1.0], target, steps, delta=delta, sampling_probability=q, seed=seed)
        c = r.certificate
        assert (c.samples, c.base_delta) == (samples, beta) and c.epsilon <= target and 1 <= r.certifications <= 3
        assert _pld_delta(r.noise_multiplier, q, steps, c.epsilon) <= c.delta
        # The pilot meets the target on an estimate of delta at base_delta from M / 4 draws (relative standard
        # error 1 / sqrt(M / 4 * base_delta) = 0.34); sigma moves by about 1 / (2 log(1 / delta)) = 0.09 of log
        # delta's error, so three standard errors (log 2) move it 7%; the certificate adds rtol and at most two
        # steps up.
        assert 0.93 * least <= r.noise_multiplier <= 1.15 * least, (seed, r, least)


def test_calibrated_blts_certificate_is_a_draw_at_its_sigma_and_near_the_target():
    """BLT on whole parts (no exact reference): the certificate is the draw it names, and sigma is not wasted."""
    blt, steps = peg.dp.BLT(2, 200, cycle_length=50), 200
    r = mc.monte_carlo_noise_multiplier(blt, 1.5, steps, delta=1e-2, seed=0)
    c = r.certificate
    coefficients, cycle = mc._coefficients_and_cycle(blt, steps, None)
    pair = mc._checked_pair(coefficients, r.noise_multiplier, steps, cycle, 1.0)
    assert mc._estimate(pair, c.samples, c.base_delta, 3, c.seed, False) == c
    assert c.base_delta == mc.base_delta_for(1e-2, c.samples, draws=3) and c.epsilon <= 1.5
    # An independent draw of 4x the samples at sigma: the same epsilon within the pilot's error (the test above).
    again = mc.monte_carlo_epsilon(blt, r.noise_multiplier, steps, delta=1e-2, samples=4 * c.samples, seed=99)
    assert 0.8 * 1.5 <= again.epsilon <= 1.05 * 1.5, (r, again)


def test_a_failed_certificate_moves_sigma_up_and_draws_afresh(monkeypatch):
    """A certificate above the target is never returned: sigma grows and the next draw has its own seed."""
    estimate, full = mc._estimate, []

    def recorded(pair, samples, beta, draws, seed, progress):
        r = estimate(pair, samples, beta, draws, seed, progress)
        if draws == 3:  # a certificate (the pilot passes draws=1)
            full.append((pair.sigma, seed))
            if len(full) == 1:  # the first reports too large an epsilon
                return dataclasses.replace(r, epsilon=2.4)
        return r

    monkeypatch.setattr(mc, "_estimate", recorded)
    r = mc.monte_carlo_noise_multiplier([1.0], 2.0, 20, delta=1e-2, sampling_probability=0.1, seed=0)
    assert r.certifications == 2 and len(full) == 2
    (first, first_seed), (second, second_seed) = full
    assert r.pilot_noise_multiplier == first < second == r.noise_multiplier and first_seed != second_seed
    assert r.certificate.seed == second_seed

    def failing(pair, samples, beta, draws, seed, progress):
        r = estimate(pair, samples, beta, draws, seed, progress)
        return dataclasses.replace(r, epsilon=9.0) if draws == 3 else r

    monkeypatch.setattr(mc, "_estimate", failing)
    with pytest.raises(ValueError, match="3 full draws of samples=7100 did not certify target_epsilon=2"):
        mc.monte_carlo_noise_multiplier([1.0], 2.0, 20, delta=1e-2, sampling_probability=0.1, seed=0)


def test_calibration_refusals_name_the_argument():
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="target_epsilon must be a finite number > 0"):
            mc.monte_carlo_noise_multiplier([1.0], bad, 10, delta=1e-2)
    with pytest.raises(TypeError, match="target_epsilon must be a number > 0; got str '2'"):
        mc.monte_carlo_noise_multiplier([1.0], "2", 10, delta=1e-2)
    with pytest.raises(ValueError, match=r"rtol must be in \(0, 0.5\)"):
        mc.monte_carlo_noise_multiplier([1.0], 1.0, 10, delta=1e-2, rtol=0.5)
    with pytest.raises(ValueError, match=r"samples=100 are too few .* take at least 7100"):
        mc.monte_carlo_noise_multiplier([1.0], 1.0, 10, delta=1e-2, samples=100)
