"""Privacy auditing (issue #30, ``peg.dp.audit``): the estimators against hand computations, the canaries'
hook against the releases it reads, and audits that must catch a broken mechanism (noise off, clipping
off, noise halved) and must not accuse a correct one (DP-SGD, BandMF, BLT) over many seeds."""

from __future__ import annotations

import math
import os
from fractions import Fraction

import dp_accounting
import keras
import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

import per_example_grads as peg
from figure_checks import assert_report_ready
from per_example_grads.dp import audit
from per_example_grads.dp.aggregator import ClippedSum, DPAggregator
from tolerances import ACCOUNTING_COMPOSED_RTOL, Z, rounding_rtol

DELTA = 1e-5
# The estimators are float64 special functions (lgamma, betainc and its inverse, log_ndtr) of a few
# hundred operations: 1e-9 relative is thousands of float64 epsilons, far below any statistical meaning.
SPECIAL_RTOL = 1e-9


# ---------------------------------------------------------------------------
# The estimators, against exact arithmetic and closed forms
# ---------------------------------------------------------------------------


def _exact_tail(r: int, v: int, a: int, b: int) -> Fraction:
    """``P[Binomial(r, a / (a + b)) >= v]``, exactly."""
    return sum(
        (Fraction(math.comb(r, k) * a**k * b ** (r - k), (a + b) ** r) for k in range(max(v, 0), r + 1)), Fraction(0)
    )


def _exact_one_run_p_value(m: int, r: int, v: int, a: int, b: int, delta: Fraction) -> Fraction:
    """Steinke, Nasr and Jagielski's p-value with integers: ``beta + 2 m delta max_i P[v-i <= B < v] / i``."""
    beta = _exact_tail(r, v, a, b)
    if v == 0:
        return Fraction(1)
    alpha = max((_exact_tail(r, v - i, a, b) - beta) / i for i in range(1, v + 1))
    return min(Fraction(1), beta + 2 * m * delta * alpha)


@pytest.mark.parametrize(
    "m, r, v, a, b, delta",
    [
        (50, 20, 15, 3, 1, Fraction(1, 1024)),  # eps = log 3
        (200, 60, 50, 2, 1, Fraction(1, 4096)),  # eps = log 2
        (1000, 100, 90, 9, 1, Fraction(1, 2**17)),  # eps = log 9, delta ~ 7.6e-6
        (10, 10, 10, 1, 1, Fraction(0)),  # eps = 0, no delta: 2^-10
        (30, 12, 0, 5, 2, Fraction(1, 64)),  # nothing right: p = 1
    ],
)
def test_one_run_p_value_is_the_papers_formula_computed_with_integers(m, r, v, a, b, delta):
    want = float(_exact_one_run_p_value(m, r, v, a, b, delta))
    got = audit.one_run_p_value(m, r, v, epsilon=math.log(a / b), delta=float(delta))
    assert got == pytest.approx(want, rel=SPECIAL_RTOL)


@pytest.mark.parametrize("r, significance", [(100, 0.05), (1000, 0.01), (7, 0.2)])
def test_epsilon_one_run_of_perfect_guesses_without_delta_is_the_closed_form(r, significance):
    """``v = r``, ``delta = 0``: the p-value is ``p^r``, so the bound is ``logit(significance^(1/r))``."""
    p = significance ** (1 / r)
    want = math.log(p / (1 - p))
    assert audit.epsilon_one_run(10 * r, r, r, delta=0.0, significance=significance) == pytest.approx(
        want, rel=SPECIAL_RTOL
    )


@pytest.mark.parametrize("m, r, v", [(1000, 200, 160), (1000, 1000, 990), (5000, 2000, 1300)])
def test_epsilon_one_run_is_where_the_p_value_crosses_the_significance(m, r, v):
    """Every claim below the bound is rejected, the claim just above it is not; delta only lowers it."""
    eps = audit.epsilon_one_run(m, r, v, delta=DELTA, significance=0.05)
    assert eps > 0
    grid = np.linspace(0, eps, 9)
    assert max(audit.one_run_p_value(m, r, v, epsilon=float(e), delta=DELTA) for e in grid) <= 0.05
    assert audit.one_run_p_value(m, r, v, epsilon=eps * (1 + 1e-6) + 1e-9, delta=DELTA) > 0.05
    assert eps <= audit.epsilon_one_run(m, r, v, delta=0.0, significance=0.05)
    assert audit.epsilon_one_run(m, r, v, delta=1e-3, significance=0.05) < eps


def test_epsilon_one_run_is_zero_at_chance_and_its_counts_are_checked():
    assert audit.epsilon_one_run(1000, 100, 50, delta=DELTA) == 0.0  # half right: coin flips
    assert audit.epsilon_one_run(1000, 0, 0, delta=DELTA) == 0.0
    assert audit.epsilon_one_run(1000, 20, 12, delta=DELTA) == 0.0  # too few to reject anything
    with pytest.raises(ValueError, match="num_correct <= num_guesses <= num_canaries"):
        audit.epsilon_one_run(100, 10, 11, delta=DELTA)
    with pytest.raises(ValueError, match="num_canaries must be a non-negative integer"):
        audit.epsilon_one_run(10.5, 10, 10, delta=DELTA)
    with pytest.raises(ValueError, match=r"delta must be in \[0, 1\)"):
        audit.epsilon_one_run(100, 10, 10, delta=1.5)
    with pytest.raises(ValueError, match=r"significance must be in \(0, 1\)"):
        audit.epsilon_one_run(100, 10, 10, delta=DELTA, significance=0.0)


def _exact_cdf(n: int, k: int, p: float) -> Fraction:
    """``P[Binomial(n, p) <= k]`` exactly, at the float ``p`` itself."""
    p = Fraction(p)
    return sum((math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(k + 1)), Fraction(0))


@pytest.mark.parametrize("k, n", [(0, 20), (3, 20), (7, 30), (29, 30), (30, 30)])
def test_clopper_pearson_ends_have_exactly_half_the_significance_in_their_tails(k, n):
    low, high = audit.clopper_pearson(k, n, significance=0.1)
    if k < n:
        assert float(_exact_cdf(n, k, high)) == pytest.approx(0.05, rel=SPECIAL_RTOL)  # P[B <= k] at the upper end
    else:
        assert high == 1.0
    if k > 0:
        assert float(1 - _exact_cdf(n, k - 1, low)) == pytest.approx(
            0.05, rel=SPECIAL_RTOL
        )  # P[B >= k] at the lower end
    else:
        assert low == 0.0
    if k == 0:
        assert high == pytest.approx(1 - 0.05 ** (1 / n), rel=SPECIAL_RTOL)  # the "rule of three"'s exact form
    if k == n:
        assert low == pytest.approx(0.05 ** (1 / n), rel=SPECIAL_RTOL)


@pytest.mark.parametrize("mu", [0.3, 1.0, 2.5])
def test_epsilon_for_mu_is_the_gaussian_mechanisms_and_the_accountants(mu):
    """mu-GDP is the Gaussian mechanism of std 1/mu (dp_accounting), and T steps at q = 1 are sqrt(T)/sigma-GDP (PLD)."""
    eps = audit.epsilon_for_mu(mu, DELTA)
    assert eps == pytest.approx(dp_accounting.get_epsilon_gaussian(1 / mu, DELTA), rel=SPECIAL_RTOL)
    assert audit.gaussian_dp_delta(mu, eps) == pytest.approx(DELTA, rel=1e-6)
    assert audit.mu_for_epsilon(eps, DELTA) == pytest.approx(mu, rel=1e-9)
    steps, sigma = 9, 3 / mu
    accountant = peg.dp.PrivacyAccountant(sigma, 1.0)
    accountant.step(steps)
    # PLD's grid rounds pessimistically: its epsilon is the same or a hair larger.
    assert eps <= accountant.epsilon(DELTA) <= eps * (1 + 1e-6)
    assert audit.gaussian_dp_delta(mu, 0.0) == pytest.approx(2 * scipy.stats.norm.cdf(mu / 2) - 1, rel=SPECIAL_RTOL)


@pytest.mark.parametrize(
    "fp, fn, n_out, n_in", [(232, 209, 1033, 967), (3, 40, 500, 500), (0, 0, 1000, 1000), (500, 20, 500, 500)]
)
def test_gaussian_dp_and_clopper_pearson_bounds_equal_the_hand_computation(fp, fn, n_out, n_in):
    """Nasr et al.: Clopper-Pearson upper bounds at significance / 2 each, mu = Phi^-1(1 - FPR_hi) - Phi^-1(FNR_hi)."""
    upper = lambda k, n: 1.0 if k == n else scipy.stats.beta.ppf(1 - 0.025, k + 1, n - k)  # noqa: E731
    fpr, fnr = upper(fp, n_out), upper(fn, n_in)
    mu = max(0.0, scipy.stats.norm.isf(fpr) - scipy.stats.norm.ppf(fnr)) if fpr < 1 and fnr < 1 else 0.0
    got = audit.mu_gaussian_dp(fp, fn, num_out=n_out, num_in=n_in, significance=0.05)
    assert got == pytest.approx(mu, rel=SPECIAL_RTOL, abs=1e-12)
    eps = audit.epsilon_gaussian_dp(fp, fn, num_out=n_out, num_in=n_in, delta=DELTA)
    assert eps == pytest.approx(dp_accounting.get_epsilon_gaussian(1 / mu, DELTA) if mu > 0 else 0.0, rel=SPECIAL_RTOL)
    plain = max(0.0, math.log(max(1 - DELTA - fnr, 1e-300) / fpr), math.log(max(1 - DELTA - fpr, 1e-300) / fnr))
    got_plain = audit.epsilon_clopper_pearson(fp, fn, num_out=n_out, num_in=n_in, delta=DELTA)
    assert got_plain == pytest.approx(plain, rel=SPECIAL_RTOL, abs=1e-12)
    with pytest.raises(ValueError, match="false_positives <= num_out"):
        audit.mu_gaussian_dp(n_out + 1, fn, num_out=n_out, num_in=n_in)


# ---------------------------------------------------------------------------
# The auditor: guesses and thresholds on top of the estimators
# ---------------------------------------------------------------------------


def test_one_run_auditor_takes_the_best_guess_pair_each_at_significance_over_their_number():
    rng = np.random.default_rng(0)
    ins, outs = rng.normal(1.0, 1.0, 480), rng.normal(0.0, 1.0, 520)
    auditor = audit.CanaryScoreAuditor(ins, outs)
    pairs = auditor.guess_pairs()
    assert len(pairs) == 13 and (5, 5) in pairs and (10, 0) in pairs and (500, 500) in pairs
    scores = np.concatenate([ins, outs])
    labels = np.concatenate([np.ones(480, bool), np.zeros(520, bool)])
    ranked = labels[np.argsort(-scores)]
    by_hand = []
    for k_in, k_out in pairs:
        correct = int(ranked[:k_in].sum() + (~ranked[len(ranked) - k_out :]).sum())
        by_hand.append(audit.epsilon_one_run(1000, k_in + k_out, correct, delta=DELTA, significance=0.05 / 13))
    bound = auditor.one_run(delta=DELTA)
    assert bound.epsilon == max(by_hand) and bound.hypotheses == 13
    single = auditor.one_run(delta=DELTA, guesses=(100, 100))
    correct = int(ranked[:100].sum() + (~ranked[-100:]).sum())
    assert (single.num_guesses, single.num_correct, single.hypotheses) == (200, correct, 1)
    assert single.epsilon == audit.epsilon_one_run(1000, 200, correct, delta=DELTA, significance=0.05)
    with pytest.raises(ValueError, match="guesses must be"):
        auditor.one_run(delta=DELTA, guesses=(600, 600))


def test_threshold_test_counts_a_given_threshold_on_all_canaries_and_a_chosen_one_on_the_other_half():
    rng = np.random.default_rng(1)
    ins, outs = rng.normal(1.5, 1.0, 700), rng.normal(0.0, 1.0, 700)
    auditor = audit.CanaryScoreAuditor(ins, outs)
    given = auditor.threshold_test(delta=DELTA, threshold=0.75)
    fp, fn = int((outs >= 0.75).sum()), int((ins < 0.75).sum())
    assert (given.false_positives, given.false_negatives, given.num_out, given.num_in, given.selected_on) == (
        fp,
        fn,
        700,
        700,
        0,
    )
    assert given.mu == audit.mu_gaussian_dp(fp, fn, num_out=700, num_in=700)
    assert given.epsilon == audit.epsilon_for_mu(given.mu, DELTA)
    chosen = auditor.threshold_test(delta=DELTA, seed=3)
    assert chosen.selected_on + chosen.num_in + chosen.num_out == 1400
    assert chosen.threshold in set(np.concatenate([ins, outs]).tolist())
    # the true mu is 1.5: the 95% lower bound is below it and not far
    assert 0.8 < chosen.mu < 1.5 and 0.8 < given.mu < 1.5


# ---------------------------------------------------------------------------
# The hook: what the canaries add to a release, and what their scores read
# ---------------------------------------------------------------------------


def _zero_sum(size: int) -> ClippedSum:
    return ClippedSum([tf.zeros([size])], tf.zeros([0]), tf.zeros([0]))


@pytest.mark.parametrize("directions", ["coordinates", "random"])
def test_canaries_add_c_times_their_direction_before_the_noise_and_nothing_else(directions):
    """Same seed with and without canaries: the releases differ by exactly the joined canaries' C u_j / D."""
    shapes, clip, divisor = [(7, 5), (5,)], 0.7, 4.0
    variables = [tf.Variable(tf.zeros(s)) for s in shapes]
    data = [tf.constant(np.random.default_rng(2).normal(size=s), tf.float32) for s in shapes]
    plain = DPAggregator(l2_norm_clip=clip, noise_multiplier=1.3, seed=11)
    audited = DPAggregator(l2_norm_clip=clip, noise_multiplier=1.3, seed=11)
    canaries = audit.GradientCanaries(20, directions=directions, seed=4).attach(audited, variables)
    clipped = ClippedSum(data, tf.zeros([0]), tf.zeros([0]))
    joined_before = np.zeros(20, np.int64)
    for _ in range(3):
        want = plain.release(clipped, divisor, sampling_probability=0.6)
        got = audited.release(clipped, divisor, sampling_probability=0.6)
        joined = canaries.joined - joined_before
        joined_before = canaries.joined
        diff = np.concatenate([(g - w).numpy().ravel() for g, w in zip(got, want)]) * divisor
        expect = clip * joined @ canaries.vectors()
        scale = np.abs(np.concatenate([w.numpy().ravel() for w in want])).max() * divisor + clip
        assert np.allclose(diff, expect, rtol=0, atol=rounding_rtol(24) * scale)
    assert set(np.flatnonzero(canaries.joined)) <= set(np.flatnonzero(canaries.included))
    canaries.detach()
    assert audited.canaries is None
    # detached, the releases are the plain ones again, to the bit
    np.testing.assert_array_equal(
        audited.release(clipped, divisor)[0].numpy(), plain.release(clipped, divisor)[0].numpy()
    )


def test_scores_without_noise_are_the_fraction_of_turns_joined_and_follow_the_cycle():
    """sigma = 0, cycle 2 (BandMF with two bands), q = 0.5: a canary's turns are the steps of its part."""
    m, steps = 40, 10
    w = tf.Variable(tf.zeros([64]))
    aggregator = DPAggregator(
        l2_norm_clip=1.0, noise_multiplier=0.0, seed=0, mechanism=peg.dp.BandMF(bands=2, num_steps=steps)
    )
    aggregator.attach([w])
    canaries = audit.GradientCanaries(m, seed=9).attach(aggregator, [w])
    data = ClippedSum([tf.constant(np.linspace(-3, 3, 64), tf.float32)], tf.zeros([0]), tf.zeros([0]))
    for _ in range(steps):
        aggregator.release(data, 2.0, sampling_probability=0.5)
    assert np.array_equal(canaries.turns, np.full(m, steps // 2))  # every other step
    assert np.array_equal(np.bincount(canaries.parts), [m // 2, m // 2])
    joined = canaries.joined
    assert np.all(joined[~canaries.included] == 0) and np.all(joined <= steps // 2) and joined.sum() > 0
    in_scores, out_scores = canaries.scores()
    # BandMF's C^-1 of zero draws is zero noise; the release carries the data, which is subtracted.
    atol = rounding_rtol(8) * 3 * 2 / (steps // 2)
    np.testing.assert_allclose(in_scores, joined[canaries.included] / (steps // 2), rtol=0, atol=atol)
    np.testing.assert_allclose(out_scores, 0.0, rtol=0, atol=atol)
    assert canaries.threshold == pytest.approx(0.25)


def test_canaries_are_sampled_like_examples_at_rate_q():
    m, steps, q = 1000, 30, 0.3
    w = tf.Variable(tf.zeros([m]))
    aggregator = DPAggregator(l2_norm_clip=1.0, noise_multiplier=1.0, seed=0)
    canaries = audit.GradientCanaries(m, seed=2).attach(aggregator, [w])
    for _ in range(steps):
        aggregator.release(_zero_sum(m), 1.0, sampling_probability=q)
    n_in = int(canaries.included.sum())
    assert abs(n_in - m / 2) <= Z * math.sqrt(m / 4)  # each included with probability 1/2
    rate = canaries.joined[canaries.included].sum() / (n_in * steps)
    assert abs(rate - q) <= Z * math.sqrt(q * (1 - q) / (n_in * steps))


def test_canaries_refuse_what_they_cannot_audit():
    w = tf.Variable(tf.zeros([10]))
    aggregator = DPAggregator(l2_norm_clip=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="11 canaries need as many parameters"):
        audit.GradientCanaries(11).attach(aggregator, [w])
    with pytest.raises(ValueError, match="num_canaries must be an integer >= 2"):
        audit.GradientCanaries(1)
    with pytest.raises(ValueError, match="directions must be"):
        audit.GradientCanaries(5, directions="diagonal")
    canaries = audit.GradientCanaries(5).attach(aggregator, [w])
    with pytest.raises(ValueError, match="has canaries already"):
        audit.GradientCanaries(5).attach(aggregator, [w])
    canaries.detach()
    units = peg.keras.DPModel(
        keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), noise_multiplier=1.0, privacy_unit="unit"
    )
    units.compile(optimizer="sgd", loss="mse")
    x4, y4 = np.zeros((4, 2)), np.zeros(4)
    with pytest.raises(ValueError, match=r"privacy_unit='unit': give audit\(\.\.\., unit_ids=\.\.\.\)"):
        audit.audit(units, x4, y4, canaries=canaries, sampling_probability=1.0, delta=DELTA)
    inputs = audit.InputCanaries(np.ones((2, 2), "float32"), np.zeros(2, "float32"))
    with pytest.raises(ValueError, match="audit: input canaries cannot be combined with privacy_unit='unit'"):
        audit.audit(units, x4, y4, canaries=inputs, sampling_probability=1.0, delta=DELTA, unit_ids=np.arange(4))
    examples = _regression_dp_model(2, 1, 1.0)
    with pytest.raises(ValueError, match="unit_ids needs a DPModel\\(privacy_unit='unit'\\)"):
        audit.audit(examples, x4, y4, canaries=canaries, sampling_probability=1.0, delta=DELTA, unit_ids=np.arange(4))
    with pytest.raises(TypeError, match="must be a peg.keras.DPModel"):
        audit.audit(
            keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]),
            np.zeros((4, 2)),
            np.zeros(4),
            canaries=canaries,
            sampling_probability=1.0,
            delta=DELTA,
        )


# ---------------------------------------------------------------------------
# Statistical validity over seeds, through the aggregator (the fast path of the real mechanism)
# ---------------------------------------------------------------------------

RUNS = 24
# A valid level-0.05 bound exceeds the claim in at most Binomial(RUNS, 0.05) runs (fewer: the bounds are
# conservative); more than MAX_EXCEEDANCES has probability below 1e-3: evidence of an invalid estimator.
MAX_EXCEEDANCES = int(scipy.stats.binom.isf(1e-3, RUNS, 0.05))
M, STEPS = 1000, 8


def _blt():
    return peg.dp.BLT(buffers=2, num_steps=STEPS, cycle_length=2, theta=[0.6, 0.2], omega=[0.3, 0.1])


MECHANISMS = {  # name -> (mechanism factory, sampling probability, noise multiplier, Gaussian-DP valid here)
    "dp-sgd, q = 1": (lambda: None, 1.0, 2.0, True),
    "dp-sgd, Poisson q = 0.5": (lambda: None, 0.5, 1.0, False),
    "bandmf, q = 1": (lambda: peg.dp.BandMF(bands=2, num_steps=STEPS), 1.0, 1.5, True),
    "blt, q = 1": (_blt, 1.0, 1.5, True),
    "bisr, q = 1": (lambda: peg.dp.BISR(bands=3, num_steps=STEPS, cycle_length=2), 1.0, 1.5, True),
}


def _sum_score_mu(mechanism, sigma: float, steps: int) -> float:
    """The Gaussian-DP mu of the canaries' score at q = 1: ``k / (sigma ||1_P C^-1||)``, the smallest over the parts.

    The score sums a canary's turns ``P`` (``k`` of them) of the release, whose noise is ``C^-1 z``: its mean
    gap is ``k C`` and its std ``sigma C ||1_P C^-1||``. For DP-SGD that is the claim's ``sqrt(k) / sigma``;
    for a correlated mechanism it is at most that (the claim covers every statistic), often less.
    """
    mechanism = mechanism or peg.dp.GaussianNoise()
    c = np.asarray(mechanism.coefficients, np.float64)[:steps]
    matrix = sum(ck * np.eye(steps, k=-k) for k, ck in enumerate(c))
    inverse = np.linalg.inv(matrix)
    cycle = mechanism.cycle_length
    return min(
        len(turns) / (sigma * np.linalg.norm(np.isin(np.arange(steps), turns).astype(float) @ inverse))
        for turns in (np.arange(part, steps, cycle) for part in range(cycle))
    )


def _claim(mechanism, sigma: float, q: float, steps: int) -> float:
    mechanism = mechanism or peg.dp.GaussianNoise()
    s, q, k = mechanism.accounted_as(sigma, q, steps)
    accountant = peg.dp.PrivacyAccountant(s, q)
    accountant.step(k)
    return accountant.epsilon(DELTA)


def _audits(name: str, runs: int, *, actual_sigma_factor: float = 1.0):
    """``runs`` audits of ``STEPS`` releases of zero data with ``M`` canaries, one aggregator per mechanism.

    Between runs the mechanism's noise buffers are zeroed (a fresh run's state) and the noise key moves on
    with the step counter; each run has its own canaries. Returns the claim, the mu the scores can reach
    (q = 1), and the bounds of every run.
    """
    factory, q, sigma, gdp_valid = MECHANISMS[name]
    mechanism = factory()
    claim = _claim(mechanism, sigma, q, STEPS)
    reachable = _sum_score_mu(mechanism, sigma, STEPS) if gdp_valid else None
    w = tf.Variable(tf.zeros([M]))
    aggregator = DPAggregator(
        l2_norm_clip=1.0, noise_multiplier=sigma * actual_sigma_factor, seed=123, mechanism=mechanism
    )
    aggregator.attach([w])
    results = []
    for run in range(runs):
        for v in aggregator.mechanism.non_trainable_variables:
            if v.name.startswith("noise_buffer"):
                v.assign(tf.zeros_like(v))
        canaries = audit.GradientCanaries(M, seed=1000 + run).attach(aggregator, [w])
        for _ in range(STEPS):
            aggregator.release(_zero_sum(M), 1.0, sampling_probability=q)
        canaries.detach()
        auditor = audit.CanaryScoreAuditor(*canaries.scores())
        one_run = auditor.one_run(delta=DELTA, guesses=(M // 10, M // 10)).epsilon
        gdp = auditor.threshold_test(delta=DELTA, threshold=canaries.threshold).epsilon if gdp_valid else None
        results.append((one_run, gdp))
    return claim, reachable, results


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_a_correct_mechanism_is_not_accused_over_many_seeds(name):
    claim, reachable, results = _audits(name, RUNS)
    one_run = np.array([r[0] for r in results])
    assert np.sum(one_run > claim) <= MAX_EXCEEDANCES, (claim, one_run)
    if MECHANISMS[name][3]:
        gdp = np.array([r[1] for r in results])
        assert np.sum(gdp > claim) <= MAX_EXCEEDANCES, (claim, gdp)
        # and it is not valid by being blind: the Gaussian-DP bound reaches most of what its score can
        # (for DP-SGD, the claim itself)
        assert audit.epsilon_for_mu(reachable, DELTA) <= claim * (1 + 1e-6)
        assert np.median(gdp) >= 0.6 * audit.epsilon_for_mu(reachable, DELTA), (claim, reachable, gdp)
        if name.startswith("dp-sgd"):
            assert audit.epsilon_for_mu(reachable, DELTA) == pytest.approx(claim, rel=1e-6)


@pytest.mark.slow
def test_the_same_audit_accuses_dp_sgd_with_half_the_noise_it_claims():
    claim, _, results = _audits("dp-sgd, q = 1", 10, actual_sigma_factor=0.5)
    gdp = np.array([r[1] for r in results])
    assert np.all(gdp > 1.3 * claim), (claim, gdp)


@pytest.mark.slow
def test_the_same_audit_accuses_bisr_with_half_the_noise_it_claims():
    # Its sum score reaches mu of about 0.54 of the claim's epsilon (5.9 of 10.9) with the claimed noise,
    # so halved noise lands just above the claim: the audit's verdict is the runs' median.
    claim, _, results = _audits("bisr, q = 1", 10, actual_sigma_factor=0.5)
    gdp = np.array([r[1] for r in results])
    assert np.median(gdp) > claim, (claim, gdp)


# ---------------------------------------------------------------------------
# End to end: DPModel.fit with canaries
# ---------------------------------------------------------------------------


def _regression_dp_model(inputs: int, outputs: int, sigma: float, **kwargs):
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(outputs, use_bias=kwargs.pop("use_bias", True))])
    dp_model = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=sigma, seed=0, **kwargs)
    dp_model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return dp_model


@pytest.mark.slow
def test_white_box_dirac_canaries_at_q_1_reach_most_of_the_accountants_epsilon(tmp_path):
    """DP-SGD, every example at every step: Gaussian DP's bound is within a stated fraction of the claim, and the PNG says so."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 44)).astype("float32"), rng.normal(size=(16, 48)).astype("float32")
    dp_model = _regression_dp_model(44, 48, 2.0)
    png = tmp_path / "audit.png"
    figures = []
    report = audit.audit(
        dp_model,
        x,
        y,
        canaries=audit.GradientCanaries(2000, seed=3),
        sampling_probability=1.0,
        steps=10,
        delta=DELTA,
        png=png,
        title="a 44-48 linear map",
    )
    assert report.steps == 10 and report.num_canaries == 2000
    claim = report.epsilon_accountant
    assert claim == pytest.approx(audit.epsilon_for_mu(math.sqrt(10) / 2.0, DELTA), rel=1e-6)
    assert 0.6 * claim <= report.epsilon_gaussian_dp <= claim
    assert 0 < report.epsilon_one_run <= claim and not report.violated
    assert dp_model.aggregator.canaries is None  # detached after the run
    assert png.stat().st_size > 10_000
    figures.append(report.figure())
    assert_report_ready(
        figures[0],
        title_has=["Privacy audit of a 44-48 linear map", "2000 gradient canaries", f"ε (accountant) = {claim:.2f}"],
        legend_has=["included", "left out", "Gaussian DP", "one-run"],
        panels=2,
    )
    assert "accountant (the claim)" in report.summary() and "no violation" in report.summary()


@pytest.mark.slow
def test_noise_off_is_caught_through_fit_with_poisson_sampling_and_physical_chunks(monkeypatch):
    """A DPModel claiming sigma = 1 (epsilon about 2) that adds no noise: the one-run bound is far above the claim."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(200, 44)).astype("float32"), rng.normal(size=(200, 48)).astype("float32")
    dp_model = _regression_dp_model(44, 48, 1.0, physical_batch_size=4)
    monkeypatch.setattr(dp_model.aggregator, "_gradient_noise_multiplier", 0.0)  # the bug: the ledger still says 1
    report = audit.audit(
        dp_model, x, y, canaries=audit.GradientCanaries(2000, seed=5), sampling_probability=0.05, steps=20, delta=DELTA
    )
    assert report.epsilon_accountant == pytest.approx(_claim(None, 1.0, 0.05, 20), rel=ACCOUNTING_COMPOSED_RTOL)
    assert report.epsilon_accountant < 2.5
    assert report.epsilon_one_run > 3.0 and report.epsilon_one_run > 1.5 * report.epsilon_accountant
    assert report.violated and "EXCEEDS THE CLAIM" in report.summary()


@pytest.mark.slow
def test_a_trained_model_is_audited_against_the_epsilon_of_its_audited_steps(monkeypatch):
    """The claim was the epsilon of every step the model took: noise off in the audit was certified after training."""
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(200, 44)).astype("float32"), rng.normal(size=(200, 48)).astype("float32")
    dp_model = _regression_dp_model(44, 48, 1.0)
    dp_model.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.05, steps=1000, seed=0), verbose=0)
    monkeypatch.setattr(dp_model.aggregator, "_gradient_noise_multiplier", 0.0)  # the bug: the ledger still says 1
    report = audit.audit(
        dp_model, x, y, canaries=audit.GradientCanaries(2000, seed=5), sampling_probability=0.05, steps=20, delta=DELTA
    )
    assert report.steps == 20
    assert report.epsilon_accountant == pytest.approx(_claim(None, 1.0, 0.05, 20), rel=ACCOUNTING_COMPOSED_RTOL)
    assert report.violated and "EXCEEDS THE CLAIM" in report.summary()
    # What it was compared with before: the whole run's epsilon, above the one valid bound here (so "no
    # violation"; the Gaussian-DP bound does not count at q < 1).
    assert not report.gaussian_dp_exact and report.epsilon_one_run < dp_model.epsilon(DELTA)


# Unit-level runs to audit: (data seed, q, the mechanism's maker (None: DP-SGD), DPModel options).
_UNIT_RUNS = {
    "dp-sgd": (2, 0.05, None, {}),
    # Where unit-level audits meet correlated noise and chunks: canaries take their part's turns.
    "bandmf-chunks": (4, 0.1, lambda: peg.dp.BandMF(bands=2, num_steps=20), {"physical_batch_size": 8}),
}


@pytest.mark.slow
@pytest.mark.parametrize("noise", ["claimed", "off"])
@pytest.mark.parametrize("run", list(_UNIT_RUNS))
def test_a_unit_level_model_is_audited_per_unit(run, noise, monkeypatch):
    """Units of 3 rows: each canary is one unit's clipped contribution, the claim the per-unit epsilon (#54).

    With the claimed noise no bound exceeds the claim; with none (the ledger still says sigma = 1) the
    one-run bound is far above it. Before, a unit-level model could not be audited at all. BandMF(2) runs on
    cyclic batches of units, clipped in physical chunks of 8 rows (its claim: 10 participations at q = 0.1).
    """
    seed, q, make, options = _UNIT_RUNS[run]
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(240, 44)).astype("float32"), rng.normal(size=(240, 48)).astype("float32")
    mechanism = None if make is None else make()
    dp_model = _regression_dp_model(44, 48, 1.0, privacy_unit="unit", mechanism=mechanism, **options)
    if noise == "off":
        monkeypatch.setattr(dp_model.aggregator, "_gradient_noise_multiplier", 0.0)
    report = audit.audit(
        dp_model,
        x,
        y,
        canaries=audit.GradientCanaries(2000, seed=7),
        sampling_probability=q,
        steps=20,
        delta=DELTA,
        unit_ids=np.repeat(np.arange(80), 3),
    )
    assert report.steps == 20 == int(dp_model.dp_steps.numpy())
    assert dp_model.num_examples == 80  # accounted per unit
    claim = _claim(None if make is None else make(), 1.0, q, 20)
    assert report.epsilon_accountant == pytest.approx(claim, rel=ACCOUNTING_COMPOSED_RTOL)
    if noise == "claimed":
        assert not report.violated and report.epsilon_one_run <= report.epsilon_accountant
    else:
        assert report.violated and report.epsilon_one_run > 1.5 * report.epsilon_accountant


@pytest.mark.slow
def test_an_audit_of_a_trained_cyclic_model_keeps_its_partition_and_claims_its_audited_steps():
    """BandMF after a cyclic fit: the audit's batches take the run's partition, the claim is its own steps' epsilon."""
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(64, 44)).astype("float32"), rng.normal(size=(64, 48)).astype("float32")
    dp_model = _regression_dp_model(44, 48, 1.0, mechanism=peg.dp.BandMF(bands=2, num_steps=40))
    trained = peg.dp.poisson_batches(x, y, sampling_probability=0.5, cycle_length=2, steps=20)  # seed=None
    dp_model.fit(trained, verbose=0)
    report = audit.audit(
        dp_model, x, y, canaries=audit.GradientCanaries(2000, seed=5), sampling_probability=0.5, steps=8, delta=DELTA
    )
    np.testing.assert_array_equal(dp_model.aggregator.partition.numpy(), trained.pegrad_sampling.partition)
    assert int(dp_model.dp_steps.numpy()) == 28 and report.steps == 8
    claim = _claim(peg.dp.BandMF(bands=2, num_steps=40), 1.0, 0.5, 8)  # 4 participations at q = 0.5
    assert report.epsilon_accountant == pytest.approx(claim, rel=ACCOUNTING_COMPOSED_RTOL)
    assert not report.violated
    # Input canaries add rows to a run whose N (and partition) were fixed by its data: refused, naming N.
    canaries = audit.InputCanaries(np.ones((4, 44), "float32"), np.zeros((4, 48), "float32"))
    with pytest.raises(ValueError, match="num_examples=64, but the poisson_batches dataset samples from 68"):
        audit.audit(dp_model, x, y, canaries=canaries, sampling_probability=0.5, steps=2, delta=DELTA)


def _memorization_data(m: int, rng):
    """Real examples in the first 8 inputs; canary j is 10 e_(8+j) with target 10 (it moves only its own weight)."""
    x = np.zeros((200, 8 + m), np.float32)
    x[:, :8] = rng.normal(size=(200, 8))
    y = (x[:, :8] @ rng.normal(size=(8, 1))).astype("float32")
    x_canaries = np.zeros((m, 8 + m), np.float32)
    x_canaries[np.arange(m), 8 + np.arange(m)] = 10.0
    return x, y, audit.InputCanaries(x_canaries, np.full((m, 1), 10.0, np.float32), seed=7)


@pytest.mark.slow
@pytest.mark.parametrize("clipping", ["on", "off"])
def test_input_canaries_catch_clipping_off_and_do_not_accuse_clipping_on(clipping, monkeypatch):
    """Black box: canaries are training rows scored by their loss; without clipping, each moves its weight 200x more."""
    from per_example_grads.dp import aggregator as aggregator_module

    m = 2000
    x, y, canaries = _memorization_data(m, np.random.default_rng(2))
    if clipping == "off":  # the bug: per-example gradients summed unclipped, noise still sigma * C
        clipped_sums = aggregator_module.clipped_sums_and_predictions
        monkeypatch.setattr(
            aggregator_module,
            "clipped_sums_and_predictions",
            lambda *a, **k: clipped_sums(*a, **{**k, "l2_norm_clip": 1e9}),
        )
    dp_model = _regression_dp_model(8 + m, 1, 1.0, use_bias=False)
    report = audit.audit(dp_model, x, y, canaries=canaries, sampling_probability=0.05, steps=20, delta=DELTA)
    assert report.kind == "input" and dp_model.num_examples == 200 + m
    assert report.epsilon_accountant == pytest.approx(_claim(None, 1.0, 0.05, 20), rel=ACCOUNTING_COMPOSED_RTOL)
    if clipping == "on":
        assert report.epsilon_one_run <= report.epsilon_accountant
    else:
        assert report.epsilon_one_run > 3.0 and report.violated


# ---------------------------------------------------------------------------
# pegrad audit
# ---------------------------------------------------------------------------


def test_pegrad_audit_help_answers_without_tensorflow():
    from test_cli import assert_no_tensorflow_lines, run_pegrad

    proc, _ = run_pegrad("audit", "--help")
    assert proc.returncode == 0 and "usage: pegrad audit" in proc.stdout, proc.stderr
    assert_no_tensorflow_lines(proc)
    proc, _ = run_pegrad("audit", "--significance", "1.5")
    assert proc.returncode == 2 and "pegrad audit: error: argument --significance" in proc.stderr


@pytest.mark.slow
@pytest.mark.slow
def test_pegrad_audit_with_input_canaries_runs_as_the_readme_writes_it(tmp_path, capsys):
    # Its default of 1,000 canaries was refused for input canaries (a third of the digits: 479).
    import json

    from per_example_grads.apps import cli

    out = tmp_path / "audit"
    assert cli.main(["audit", "--canaries", "input", "--fast", "--out", str(out)]) == 0
    numbers = json.loads((out / "audit.json").read_text())
    assert numbers["num_canaries"] == 479 and numbers["kind"] == "input"


def test_pegrad_audit_writes_its_figure_and_numbers(tmp_path, capsys):
    import json

    from per_example_grads.apps import cli

    out = tmp_path / "audit"
    assert cli.main(["audit", "--full-batch", "--epochs", "2", "--num-canaries", "500", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "accountant (the claim)" in printed and "one-run lower bound (95%)" in printed
    numbers = json.loads((out / "audit.json").read_text())
    assert numbers["epsilon_accountant"] == pytest.approx(4.0, rel=1e-3)
    assert numbers["num_canaries"] == 500 and numbers["epsilon_one_run"] <= numbers["epsilon_accountant"]
    assert (out / "audit.png").stat().st_size > 10_000
    assert sorted(os.listdir(out)) == ["audit.json", "audit.png"]
    assert (
        cli.main(["audit", "--num-canaries", "5000", "--out", str(tmp_path / "x")]) == 2
    )  # more than 4,810 parameters
