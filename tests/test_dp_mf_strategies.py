"""The maths of correlated-noise mechanisms (per_example_grads.dp.mf_strategies) against explicit matrices.

Every reference is built here in NumPy from the coefficients alone: the
explicit lower-triangular Toeplitz ``C``, its inverse by a triangular solve,
``A C^{-1}`` as a matrix product, and the sensitivity by enumerating every
participation pattern (plus a random search over contribution vectors, which
needs no assumption about which contributions are worst).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.linalg import solve_triangular, toeplitz

from per_example_grads.dp import mf_strategies as mf
from tolerances import EPS64, rounding_rtol


def _toeplitz(c, n):
    """The explicit ``n x n`` lower-triangular Toeplitz matrix, ``C[i, j] = c[i - j]`` (SciPy's ``toeplitz``)."""
    column = np.zeros(n)
    c = np.asarray(c, dtype=np.float64)[:n]
    column[: c.size] = c
    return toeplitz(column, np.zeros(n))


def _reference_inverse(c, n):
    """First column of ``C^{-1}``: a triangular solve against the first unit vector."""
    e0 = np.zeros(n)
    e0[0] = 1.0
    return solve_triangular(_toeplitz(c, n), e0, lower=True)


def _series_rtol(n):
    # Two float64 computations of C^{-1}'s coefficients: forward substitution takes n-term dot
    # products, the Newton iteration ceil(log2 n) + 1 doublings of n-term products (FFT products
    # err by a few roundings times log2(length) relative to the operands' norms, Higham 2002,
    # section 24.1). Both are within rounding_rtol(n) * (2 + log2 n) of the exact value relative
    # to sum_j |c_j| max_k |d_k| for these well-conditioned inverses (their entries are O(1) and
    # do not grow); 4x that covers both sides and the norm-versus-max-entry slack.
    return 4 * (2 + math.log2(n)) * rounding_rtol(n, EPS64)


# Coefficients of every kind the tests use: (name, coefficients for n, exact closed form applies).
BLT_THETA = np.array([0.95, 0.6, 0.2])
BLT_OMEGA = np.array([0.15, 0.2, 0.1])


def _cases(n):
    return [
        ("dpsgd", np.array([1.0])),
        ("banded_decreasing", np.array([0.7, 0.5, 0.4, 0.3]) / np.linalg.norm([0.7, 0.5, 0.4, 0.3])),
        ("sqrt_start", mf._banded_start(n, min(n, 5))),
        ("blt", mf.blt_coefficients(BLT_THETA, BLT_OMEGA, n)),
        ("blt_c1_above_c0", mf.blt_coefficients([0.5, 0.3], [0.9, 0.6], n)),
        ("mixed_signs", np.array([1.0, -0.6, 0.25, 0.1])),
    ]


# --------------------------------------------------------------------------- inverse_coefficients


@pytest.mark.parametrize("n", [1, 2, 7, 12, 300, 1500])
@pytest.mark.parametrize("case", range(6))
def test_inverse_coefficients_match_a_triangular_solve(case, n):
    name, c = _cases(n)[case]
    d = mf.inverse_coefficients(c, n)
    ref = _reference_inverse(c, n)
    assert d.shape == (n,) and d.dtype == np.float64
    scale = np.sum(np.abs(c[:n])) * np.max(np.abs(ref))
    np.testing.assert_allclose(d, ref, rtol=0, atol=_series_rtol(n) * scale, err_msg=name)


def test_inverse_coefficients_of_long_coefficients_use_only_the_first_n():
    c = mf.blt_coefficients(BLT_THETA, BLT_OMEGA, 50)
    np.testing.assert_array_equal(mf.inverse_coefficients(c, 10), mf.inverse_coefficients(c[:10], 10))


@pytest.mark.parametrize("n", [1, 9, 700])
def test_blt_inverse_closed_form_matches_a_triangular_solve(n):
    c = mf.blt_coefficients(BLT_THETA, BLT_OMEGA, n)
    ref = _reference_inverse(c, n)
    closed = mf._blt_inverse_coefficients(BLT_THETA, BLT_OMEGA, n)
    scale = np.sum(np.abs(c)) * np.max(np.abs(ref))
    np.testing.assert_allclose(closed, ref, rtol=0, atol=_series_rtol(n) * scale)


def test_blt_coefficients_follow_their_formula():
    theta, omega, n = np.array([0.9, 0.3]), np.array([0.2, 0.5]), 8
    expected = [1.0] + [sum(o * t ** (k - 1) for t, o in zip(theta, omega)) for k in range(1, n)]
    np.testing.assert_allclose(mf.blt_coefficients(theta, omega, n), expected, rtol=4 * EPS64 * n, atol=0)


# --------------------------------------------------------------------------- prefix_sum_error


@pytest.mark.parametrize("n", [1, 5, 12, 100])
@pytest.mark.parametrize("case", range(6))
def test_prefix_sum_error_is_the_frobenius_norm_of_A_C_inverse(case, n):
    name, c = _cases(n)[case]
    A = np.tril(np.ones((n, n)))
    expected = np.linalg.norm(A @ np.linalg.inv(_toeplitz(c, n)), "fro") / math.sqrt(n)
    # Both sides are sums of n^2 squares of n-term sums of O(1) entries.
    assert mf.prefix_sum_error(c, n) == pytest.approx(expected, rel=4 * _series_rtol(n) * n, abs=0), name


@pytest.mark.parametrize("n", [1, 2, 3, 10, 1000, 10_000])
def test_dpsgd_prefix_sum_error_is_sqrt_of_n_plus_one_over_two(n):
    assert mf.prefix_sum_error([1.0], n) == pytest.approx(math.sqrt((n + 1) / 2), rel=rounding_rtol(n, EPS64))


def test_prefix_sum_error_scales_inversely_with_the_coefficients():
    c = mf._banded_start(64, 4)
    assert mf.prefix_sum_error(3.0 * c, 64) == pytest.approx(mf.prefix_sum_error(c, 64) / 3.0, rel=1e-13)


# --------------------------------------------------------------------------- sensitivity


def _all_patterns(n, s, k):
    for size in range(1, k + 1):
        for pattern in itertools.combinations(range(n), size):
            if all(b - a >= s for a, b in zip(pattern, pattern[1:])):
                yield pattern


def _aligned_brute_force(c, n, s, k):
    """Largest ``||sum_i C[:, p_i]||`` over every pattern (the worst case when C^T C >= 0 there)."""
    C = _toeplitz(c, n)
    return max(np.linalg.norm(C[:, list(p)].sum(axis=1)) for p in _all_patterns(n, s, k))


def _random_search(c, n, s, k, rng, trials=400, dim=3):
    """Largest ``||sum_i C[:, p_i] g_i^T||_F`` over random patterns and contributions of norm <= 1."""
    C = _toeplitz(c, n)
    patterns = list(_all_patterns(n, s, k))
    best = 0.0
    for _ in range(trials):
        p = patterns[rng.integers(len(patterns))]
        g = rng.normal(size=(len(p), dim))
        g /= np.linalg.norm(g, axis=1, keepdims=True)
        g *= rng.uniform(0.5, 1.0, size=(len(p), 1)) if rng.random() < 0.3 else 1.0
        best = max(best, np.linalg.norm(C[:, list(p)] @ g, "fro"))
    return best


SCHEMAS = [(12, 1, 3), (12, 2, 4), (12, 3, 4), (12, 5, 3), (11, 4, 3), (9, 1, 9), (6, 2, 2), (12, 3, 1)]


@pytest.mark.parametrize("n, s, k", SCHEMAS)
@pytest.mark.parametrize("case", range(5))
def test_sensitivity_is_the_worst_participation_pattern(case, n, s, k):
    name, c = _cases(n)[case]
    C = _toeplitz(c, n)
    assert np.all(C.T @ C >= 0), "these coefficients have C^T C >= 0, so aligned contributions are worst"
    value = mf.sensitivity(c, n, min_separation=s, max_participations=k)
    # n-term sums of O(1) products on each side, then a square root.
    tol = 4 * n * rounding_rtol(n, EPS64)
    assert value == pytest.approx(_aligned_brute_force(c, n, s, k), rel=tol), name
    assert _random_search(c, n, s, k, np.random.default_rng(case)) <= value * (1 + tol), name


@pytest.mark.parametrize("n, s, k, earliest_is_worst", [(12, 1, 3, False), (10, 2, 4, True), (8, 1, 8, True)])
def test_sensitivity_enumerates_when_no_closed_form_applies(n, s, k, earliest_is_worst):
    # Non-negative but not non-increasing after c_1: the earliest pattern need not be the worst.
    c = np.array([1.0, 0.1, 0.8, 0.05, 0.6])
    value = mf.sensitivity(c, n, min_separation=s, max_participations=k)
    tol = 4 * n * rounding_rtol(n, EPS64)
    assert value == pytest.approx(_aligned_brute_force(c, n, s, k), rel=tol)
    assert _random_search(c, n, s, k, np.random.default_rng(1)) <= value * (1 + tol)
    earliest = np.linalg.norm(_toeplitz(c, n)[:, list(range(0, n, s))[:k]].sum(axis=1))
    # Where it is not, only the enumeration finds the worst pattern.
    assert (value > earliest * (1 + 1e-6)) == (not earliest_is_worst)


def test_sensitivity_with_signed_coefficients_shorter_than_the_separation_is_exact():
    c, n, s, k = np.array([1.0, -0.6, 0.25, 0.1]), 12, 4, 3
    value = mf.sensitivity(c, n, min_separation=s, max_participations=k)
    tol = 4 * n * rounding_rtol(n, EPS64)
    assert value == pytest.approx(_aligned_brute_force(c, n, s, k), rel=tol)
    assert _random_search(c, n, s, k, np.random.default_rng(2)) <= value * (1 + tol)


def test_sensitivity_refuses_when_aligned_contributions_are_not_worst():
    c, n, s, k = np.array([1.0, -0.6, 0.25, 0.1]), 8, 1, 2
    # Why it must refuse: opposite contributions at steps 0 and 1 beat every aligned pattern.
    assert _random_search(c, n, s, k, np.random.default_rng(3), trials=2000) > _aligned_brute_force(c, n, s, k)
    with pytest.raises(ValueError, match="not exact"):
        mf.sensitivity(c, n, min_separation=s, max_participations=k)


def test_sensitivity_refuses_too_many_patterns_to_enumerate():
    with pytest.raises(ValueError, match="too many to enumerate"):
        mf.sensitivity([1.0, 0.1, 0.8], 2000, min_separation=1, max_participations=10)


@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_banded_with_separation_at_least_bands_has_sensitivity_sqrt_k(k):
    b, n = 6, 100
    c = mf._banded_start(n, b)
    value = mf.sensitivity(c, n, min_separation=b, max_participations=k)
    assert value == pytest.approx(math.sqrt(k), rel=4 * rounding_rtol(n, EPS64))
    assert mf.sensitivity([1.0], n, min_separation=1, max_participations=k) == pytest.approx(math.sqrt(k))


def test_sensitivity_of_a_blt_at_scale_matches_the_explicit_earliest_pattern():
    # n = 2000, k = 40 at s = 50: the O(n) closed form against the explicit C u.
    theta, omega = np.array([0.99, 0.9, 0.5]), np.array([0.05, 0.1, 0.2])
    n, s, k = 2000, 50, 40
    c = mf.blt_coefficients(theta, omega, n)
    u = np.zeros(n)
    u[0 : k * s : s] = 1.0
    expected = np.linalg.norm(_toeplitz(c, n) @ u)
    value = mf.sensitivity(c, n, min_separation=s, max_participations=k)
    assert value == pytest.approx(expected, rel=4 * rounding_rtol(n, EPS64))


# --------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize(
    "coefficients, error, match",
    [
        ([], ValueError, "non-empty 1-D"),
        ([[1.0, 0.5]], ValueError, "non-empty 1-D"),
        ([1.0, np.nan], ValueError, "finite"),
        ([0.0, 1.0], ValueError, "c_0"),
        ([-1.0], ValueError, "c_0"),
        ([True, False], TypeError, "real numbers"),
        (np.array([1 + 0j]), TypeError, "real numbers"),
        (["1.0"], TypeError, "real numbers"),
    ],
)
def test_bad_coefficients_are_refused(coefficients, error, match):
    for call in (
        lambda: mf.inverse_coefficients(coefficients, 4),
        lambda: mf.prefix_sum_error(coefficients, 4),
        lambda: mf.sensitivity(coefficients, 4, min_separation=1, max_participations=1),
    ):
        with pytest.raises(error, match=match):
            call()


@pytest.mark.parametrize("n, error", [(0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_step_counts_are_refused(n, error):
    with pytest.raises(error, match="n must be a positive int"):
        mf.inverse_coefficients([1.0], n)
    with pytest.raises(error, match="num_steps must be a positive int"):
        mf.banded_coefficients(n, 1)
    with pytest.raises(error, match="num_steps must be a positive int"):
        mf.blt_parameters(n, 1, min_separation=1, max_participations=1)


def test_bad_schemas_are_refused():
    with pytest.raises(ValueError, match="min_separation must be a positive int"):
        mf.sensitivity([1.0], 10, min_separation=0, max_participations=1)
    with pytest.raises(ValueError, match="max_participations must be a positive int"):
        mf.sensitivity([1.0], 10, min_separation=1, max_participations=0)
    with pytest.raises(ValueError, match=r"max_participations=4 is not feasible in n=10 steps .* at most 3 fit"):
        mf.sensitivity([1.0], 10, min_separation=4, max_participations=4)
    assert mf.sensitivity([1.0], 10, min_separation=3, max_participations=4) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="not feasible"):
        mf.blt_parameters(10, 2, min_separation=5, max_participations=3)


def test_bad_bands_and_blt_parameters_are_refused():
    with pytest.raises(ValueError, match="bands must be at most num_steps=4"):
        mf.banded_coefficients(4, 5)
    with pytest.raises(ValueError, match="bands must be a positive int"):
        mf.banded_coefficients(4, 0)
    with pytest.raises(ValueError, match="buffers must be a positive int"):
        mf.blt_parameters(4, 0, min_separation=1, max_participations=1)
    with pytest.raises(ValueError, match=r"theta .* must lie in \(0, 1\)"):
        mf.blt_coefficients([1.0], [0.5], 4)
    with pytest.raises(ValueError, match=r"omega .* must be > 0"):
        mf.blt_coefficients([0.5], [0.0], 4)
    with pytest.raises(ValueError, match="same shape"):
        mf.blt_coefficients([0.5, 0.4], [0.5], 4)


# --------------------------------------------------------------------------- objectives' gradients


def _central_difference(f, x, h=1e-6):
    grad = np.zeros_like(x)
    for i in range(x.size):
        step = np.zeros_like(x)
        step[i] = h
        grad[i] = (f(x + step)[0] - f(x - step)[0]) / (2 * h)
    return grad


# A central difference of step h errs by h^2 / 6 times the third derivative plus about EPS64 |f| / h:
# with h = 1e-6 and these smooth log-objectives of size O(1) to O(10), both are below 1e-8; 1e-6
# absolute leaves room for the third derivatives and still fails on any wrong term of the gradient
# (its entries are O(0.1) to O(10)).
GRADIENT_ATOL = 1e-6


def test_banded_objective_is_the_log_error_squared_with_its_gradient():
    n = 50
    v = mf._banded_start(n, 6) + 0.05 * np.random.default_rng(0).normal(size=6)
    value, grad = mf._banded_objective(v, n)
    assert math.exp(value) == pytest.approx(mf.prefix_sum_error(v / np.linalg.norm(v), n) ** 2, rel=1e-12)
    np.testing.assert_allclose(grad, _central_difference(lambda v: mf._banded_objective(v, n), v), atol=GRADIENT_ATOL)


@pytest.mark.parametrize("s, k", [(60, 1), (7, 5), (1, 60)])
def test_blt_objective_is_the_log_merit_squared_with_its_gradient(s, k):
    n = 60
    x = mf._blt_unconstrained(*mf._blt_start(n, 3)) + 0.1 * np.random.default_rng(1).normal(size=6)
    value, grad = mf._blt_objective(x, n, s, k)
    theta, _, omega = mf._blt_from_unconstrained(x)
    c = mf.blt_coefficients(theta, omega, n)
    assert math.exp(value) == pytest.approx(_merit(c, n, s, k) ** 2, rel=1e-12)
    np.testing.assert_allclose(
        grad, _central_difference(lambda x: mf._blt_objective(x, n, s, k), x), atol=GRADIENT_ATOL
    )


# --------------------------------------------------------------------------- optimized strategies


def test_one_band_is_dpsgd_and_results_are_fresh_copies():
    c = mf.banded_coefficients(100, 1)
    np.testing.assert_array_equal(c, [1.0])
    c[0] = 7.0
    np.testing.assert_array_equal(mf.banded_coefficients(100, 1), [1.0])
    theta, omega = mf.blt_parameters(1, 2, min_separation=1, max_participations=1)
    theta[:] = 0.0
    assert np.all(mf.blt_parameters(1, 2, min_separation=1, max_participations=1)[0] > 0)


def _merit(c, n, s, k):
    return mf.sensitivity(c, n, min_separation=s, max_participations=k) * mf.prefix_sum_error(c, n)


def _dpsgd_merit(n, k):
    return math.sqrt(k * (n + 1) / 2)


# BandMF at n = 1000, participations every b steps (cyclic), as many as leave each one's column of C
# whole, so the sensitivity is sqrt(k) as for DP-SGD.
# The margins are below the measured ratios (2.68 at b = 8, 4.59 at b = 32) and above what the start
# (the truncated square root, 2.37 and 4.10) guarantees: the optimizer must have improved on it.
@pytest.mark.slow
@pytest.mark.parametrize("bands, margin", [(8, 2.5), (32, 4.3)])
def test_banded_strategy_beats_dpsgd_and_its_start(bands, margin):
    n = 1000
    k = (n - bands) // bands + 1
    c = mf.banded_coefficients(n, bands)
    assert c.shape == (bands,) and c[0] > 0
    assert np.linalg.norm(c) == pytest.approx(1.0, rel=1e-14)
    assert mf.sensitivity(c, n, min_separation=bands, max_participations=k) == pytest.approx(math.sqrt(k), rel=1e-12)
    start = mf._banded_start(n, bands)
    assert mf.prefix_sum_error(c, n) < 0.97 * mf.prefix_sum_error(start, n)
    assert _dpsgd_merit(n, k) / _merit(c, n, bands, k) > margin
    # A minimum on the unit sphere: no coordinate step (renormalized) lowers the error, to rounding
    # of the error itself plus the second-order term of a step of 1e-4.
    base = mf.prefix_sum_error(c, n)
    for j in range(bands):
        for step in (1e-4, -1e-4):
            v = c.copy()
            v[j] += step
            assert mf.prefix_sum_error(v / np.linalg.norm(v), n) > base * (1 - 1e-9)


# BLT at n = 1000: one participation (s = n) and four (s = n / 4). The margins are below the measured
# ratios (7.33 for d = 3, k = 1; 6.72 for d = 4, k = 4) and above the fixed starts' (6.99 and 6.33).
# The near-minimum check allows 1e-4 relative: L-BFGS stops within its iteration cap, not at machine
# precision, and buffers that nearly merge leave flat directions.
@pytest.mark.slow
@pytest.mark.parametrize("buffers, k, margin", [(3, 1, 7.1), (4, 4, 6.5)])
def test_blt_strategy_beats_dpsgd_and_its_start(buffers, k, margin):
    n = 1000
    s = n // k
    theta, omega = mf.blt_parameters(n, buffers, min_separation=s, max_participations=k)
    assert theta.shape == omega.shape == (buffers,)
    assert np.all((theta > 0) & (theta < 1)) and np.all(omega > 0) and np.all(np.diff(theta) <= 0)
    c = mf.blt_coefficients(theta, omega, n)
    start = mf.blt_coefficients(*mf._blt_start(n, buffers), n)
    assert _merit(c, n, s, k) < _merit(start, n, s, k)
    assert _dpsgd_merit(n, k) / _merit(c, n, s, k) > margin
    # Near a minimum: no small step of one parameter lowers the objective by more than 1e-4 relative.
    base = _merit(c, n, s, k)
    for j in range(2 * buffers):
        for step in (1e-3, -1e-3):
            t, o = theta.copy(), omega.copy()
            if j < buffers:
                t[j] = min(max(t[j] + step * t[j] * (1 - t[j]), 1e-12), 1 - 1e-12)
            else:
                o[j - buffers] *= math.exp(step)
            assert _merit(mf.blt_coefficients(t, o, n), n, s, k) > base * (1 - 1e-4)
