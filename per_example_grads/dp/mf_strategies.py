"""The mathematics of correlated-noise (matrix factorization) mechanisms.

Pure functions of NumPy arrays, in float64: Toeplitz inverses, the error and
the sensitivity of a factorization, and the optimized strategies of BandMF and
BLT. The noise mechanisms in ``per_example_grads.dp`` call them; nothing here
draws noise or touches a model.

Notation
--------
A run has ``n`` steps. ``G`` is the ``n x P`` matrix whose row ``t`` is the
(clipped, summed) gradient of step ``t``; ``A`` is the ``n x n``
lower-triangular all-ones matrix, so ``A G`` are the prefix sums a model
trajectory depends on. A *strategy* is a lower-triangular Toeplitz matrix
``C`` given by its coefficients ``c = (c_0, c_1, ...)``, ``C[i, j] = c_{i-j}``
for ``i >= j`` (zero past the coefficients' length). The mechanism releases
``C G + Z`` with ``Z`` i.i.d. Gaussian, so the optimizer sees
``G + C^{-1} Z``: the noise of step ``t`` is a fixed combination of the draws
of steps ``0..t``. DP-SGD is ``c = [1]`` (``C = I``).

Lower-triangular Toeplitz matrices are truncated power series: ``C`` is
``c(z) = sum_k c_k z^k`` modulo ``z^n``, products of such matrices are
products of series, and ``C^{-1}`` is Toeplitz with the coefficients of
``1 / c(z)`` (``inverse_coefficients``). In this language:

- error (``prefix_sum_error``): ``||A C^{-1}||_F / sqrt(n)``, the
  root-mean-square over the ``n`` prefix sums of the noise they get per unit
  of noise in ``Z``. ``A C^{-1}`` is Toeplitz with coefficients
  ``e_k = d_0 + ... + d_k`` (``d`` those of ``C^{-1}``) and its diagonal
  ``k`` has ``n - k`` entries, so the error is
  ``sqrt(sum_k (n - k) e_k**2 / n)``; for DP-SGD ``sqrt((n + 1) / 2)``.
- sensitivity (``sensitivity``): how far ``C G`` moves when one example is
  added or removed, under a participation schema; the noise multiplier of
  the whole release is the noise standard deviation over it.
- the figure of merit of a strategy is ``sensitivity * prefix_sum_error``
  (at equal privacy the noise scales with the sensitivity): lower is better,
  and DP-SGD's is ``sqrt(k (n + 1) / 2)`` for ``k`` participations.

The two strategy families
-------------------------
- BandMF (Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu 2023,
  "(Amplified) Banded Matrix Factorization: A unified approach to private
  training"): ``b`` coefficients, every column of ``C`` of norm at most 1
  (``||c||_2 = 1``); generating the noise needs the last ``b - 1`` noise
  vectors. ``banded_coefficients`` minimizes the error for the planned
  ``n``.
- BLT, buffered linear Toeplitz (Dvijotham, McMahan, Pillutla, Steinke,
  Thakurta 2024, "Efficient and Near-Optimal Noise Generation for Streaming
  Differential Privacy"; McMahan, Pillutla, Steinke et al. 2024 on
  optimizing BLTs for multiple participations): ``c_0 = 1`` and
  ``c_k = sum_i omega_i theta_i**(k - 1)`` for ``k >= 1``, that is
  ``c(z) = 1 + z omega^T (I - z Theta)^{-1} 1`` with ``Theta = diag(theta)``;
  ``d`` buffers of state, any number of steps. Its inverse is again of that
  form: ``1 / c(z) = 1 - z omega^T (I - z (Theta - 1 omega^T))^{-1} 1``, so
  ``C^{-1}`` has coefficients ``1`` and
  ``-omega^T (Theta - 1 omega^T)^(k - 1) 1`` for ``k >= 1``. (Proof: with
  ``R = (I - z Theta)^{-1}`` and ``q = z omega^T R 1``, so ``c = 1 + q``,
  Sherman-Morrison on ``I - z (Theta - 1 omega^T) = R^{-1} + z 1 omega^T``
  gives ``z omega^T (I - z (Theta - 1 omega^T))^{-1} 1 = q / (1 + q)``, and
  ``1 - q / (1 + q) = 1 / c``.) ``C^{-1}`` is itself a BLT whose decays are
  the eigenvalues of ``Theta - 1 omega^T`` (real for distinct ``theta``: one
  below the smallest ``theta_i``, one between each two consecutive ones).
  ``blt_parameters`` minimizes ``(sensitivity * error)**2``.

Both optimizations run once per argument tuple, in float64, with
TensorFlow Probability's L-BFGS (``lbfgs_minimize`` on TFP's NumPy
substrate, imported only then), on objectives evaluated in NumPy with their
gradients in closed form, and are cached. Every series operation is
``O(n log n)`` (power-series inversion by Newton iteration with FFT
products), so an optimization for ``n = 10,000`` takes seconds, not minutes.
The other functions need NumPy only.

Example (BandMF with 8 bands against DP-SGD, participations every 8 steps):
  >>> import numpy as np
  >>> n, b = 64, 8
  >>> c = banded_coefficients(n, b)
  >>> c.shape, round(float(np.linalg.norm(c)), 12), bool(c[0] > 0)
  ((8,), 1.0, True)
  >>> k = (n - b) // b + 1  # every participation's column of C is whole: sensitivity sqrt(k)
  >>> round(sensitivity(c, n, min_separation=b, max_participations=k) ** 2, 9)
  8.0
  >>> dpsgd = sensitivity([1.0], n, min_separation=b, max_participations=k) * prefix_sum_error([1.0], n)
  >>> band = sensitivity(c, n, min_separation=b, max_participations=k) * prefix_sum_error(c, n)
  >>> bool(band < dpsgd / 2)
  True
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from per_example_grads._core.arguments import check_positive_int

__all__ = [
    "banded_coefficients",
    "blt_coefficients",
    "blt_parameters",
    "inverse_coefficients",
    "prefix_sum_error",
    "sensitivity",
]

# At most this many participation patterns are enumerated when no closed form
# gives the worst one (``sensitivity``); past it the function refuses.
_MAX_ENUMERATED_PATTERNS = 200_000
# ... and the explicit C^T C it needs is at most this many steps on a side.
_MAX_ENUMERATED_STEPS = 1024
# L-BFGS settings (float64, on the log of the objective): stop when its change
# is below _F_RTOL (relative) or its gradient's largest entry below _GRAD_TOL,
# or after _MAX_ITERATIONS iterations. The cap bounds the time: BandMF
# converges in a few dozen iterations; BLTs with many buffers can crawl
# towards merging two of them, at gains far below what the choice of a
# strategy depends on.
_F_RTOL = 1e-12
_GRAD_TOL = 1e-10
_MAX_ITERATIONS = 100


# ----------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------


def _float_vector(name: str, value: Any) -> np.ndarray:
    """``value`` as a new 1-D finite float64 array, non-empty; real numbers only."""
    array = np.asarray(value)
    if array.dtype == np.bool_ or not (
        np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)
    ):
        raise TypeError(f"{name} must be a 1-D array of real numbers; got dtype {array.dtype}.")
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array; got shape {array.shape}.")
    array = np.array(array, dtype=np.float64)
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite; got {array!r}.")
    return array


def _check_coefficients(coefficients: Any) -> np.ndarray:
    c = _float_vector("coefficients", coefficients)
    if not c[0] > 0:
        raise ValueError(f"coefficients[0] (c_0, the diagonal of C) must be > 0 so that C is invertible; got {c[0]!r}.")
    return c


def _check_schema(n: int, min_separation: Any, max_participations: Any) -> tuple[int, int]:
    s = check_positive_int("min_separation", min_separation)
    k = check_positive_int("max_participations", max_participations)
    most = (n - 1) // s + 1
    if k > most:
        raise ValueError(
            f"max_participations={k} is not feasible in n={n} steps at min_separation={s}: "
            f"{k} participations need (k - 1) * s + 1 = {(k - 1) * s + 1} steps; at most {most} fit."
        )
    return s, k


def _check_blt(theta: Any, omega: Any) -> tuple[np.ndarray, np.ndarray]:
    theta = _float_vector("theta", theta)
    omega = _float_vector("omega", omega)
    if theta.shape != omega.shape:
        raise ValueError(f"theta and omega must have the same shape [d]; got {theta.shape} and {omega.shape}.")
    if not np.all((theta > 0) & (theta < 1)):
        raise ValueError(f"theta (the buffers' decays) must lie in (0, 1); got {theta!r}.")
    if not np.all(omega > 0):
        raise ValueError(f"omega (the buffers' output scales) must be > 0; got {omega!r}.")
    return theta, omega


# ----------------------------------------------------------------------------
# Series (lower-triangular Toeplitz) arithmetic in NumPy
# ----------------------------------------------------------------------------


def _product(a: np.ndarray, b: np.ndarray, size: int) -> np.ndarray:
    """The first ``size`` coefficients of the series product ``a * b`` (zero-padded)."""
    a, b = a[:size], b[:size]
    if a.size * b.size <= 1 << 18:  # direct: cheap, and exact zeros stay zero
        out = np.convolve(a, b)[:size]
    else:
        length = 1 << (a.size + b.size - 2).bit_length()
        out = np.fft.irfft(np.fft.rfft(a, length) * np.fft.rfft(b, length), length)[:size]
    if out.size < size:
        out = np.concatenate([out, np.zeros(size - out.size)])
    return out


def _series_inverse(c: np.ndarray, n: int) -> np.ndarray:
    """First ``n`` coefficients of ``1 / c(z)`` by Newton iteration (``c[0] != 0``).

    If ``c d = 1 + z^m h (mod z^{2m})`` for the first ``m`` coefficients ``d``
    of the inverse, the next ``m`` are ``-(d h mod z^m)``: the known ones are
    never recomputed (so their rounding does not grow), and each doubling
    costs two products.
    """
    d = np.array([1.0 / c[0]])
    m = 1
    while m < n:
        m2 = min(2 * m, n)
        h = _product(c, d, m2)[m:m2]
        d = np.concatenate([d, -_product(d, h, m2 - m)])
        m = m2
    return d


def inverse_coefficients(coefficients: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` Toeplitz coefficients of ``C^{-1}``, float64 ``[n]``.

    ``C`` is the ``n x n`` lower-triangular Toeplitz matrix of
    ``coefficients`` (``C[i, j] = c_{i-j}``, zero past their length, those past
    ``n`` unused). ``C^{-1}`` is lower-triangular Toeplitz too, its
    coefficients those of the power series ``1 / c(z)``; they are computed by
    Newton iteration with FFT products in ``O(n log n)``, each within a few
    float64 roundings of the largest magnitudes involved (``sum_j |c_j|``
    times the largest ``|d_k|``).

    Args:
      coefficients: 1-D real array-like ``[L]``, finite, ``c_0 > 0``.
      n: the number of steps (positive int).

    Raises:
      TypeError, ValueError: naming the argument that is not as above.

    Examples:
      >>> inverse_coefficients([1.0, -1.0], 4)  # C = I - shift; its inverse is A
      array([1., 1., 1., 1.])
      >>> inverse_coefficients([1.0, 0.5], 4)  # 1 / (1 + z / 2)
      array([ 1.   , -0.5  ,  0.25 , -0.125])
    """
    c = _check_coefficients(coefficients)
    n = check_positive_int("n", n)
    return _series_inverse(c[:n], n) + 0.0  # + 0.0: no negative zeros


def _prefix_error(d: np.ndarray) -> float:
    n = d.size
    e = np.cumsum(d)
    return math.sqrt(float(np.dot(np.arange(n, 0, -1, dtype=np.float64), e * e)) / n)


def prefix_sum_error(coefficients: np.ndarray, n: int) -> float:
    """``||A C^{-1}||_F / sqrt(n)``: the RMS noise of the ``n`` prefix sums per unit noise.

    ``A`` is the ``n x n`` lower-triangular all-ones matrix, ``C`` the
    lower-triangular Toeplitz matrix of ``coefficients``. ``A C^{-1}`` is
    Toeplitz with coefficients ``e_k = d_0 + ... + d_k``
    (``d = inverse_coefficients(coefficients, n)``), diagonal ``k`` having
    ``n - k`` entries, so the value is ``sqrt(sum_k (n - k) e_k**2 / n)``.
    It scales as ``1 / s`` when the coefficients are scaled by ``s``: compare
    strategies by ``sensitivity * prefix_sum_error``.

    Args:
      coefficients: 1-D real array-like, finite, ``c_0 > 0``.
      n: the number of steps (positive int).

    Examples:
      >>> prefix_sum_error([1.0], 3)  # DP-SGD: sqrt((n + 1) / 2)
      1.4142135623730951
      >>> prefix_sum_error(np.ones(5), 5)  # C = A: exact prefix sums, error 1
      1.0
    """
    c = _check_coefficients(coefficients)
    n = check_positive_int("n", n)
    return _prefix_error(_series_inverse(c[:n], n))


# ----------------------------------------------------------------------------
# Sensitivity
# ----------------------------------------------------------------------------


def _earliest_pattern_response(c: np.ndarray, n: int, s: int, k: int) -> np.ndarray:
    """``C u`` for ``u`` the indicator of steps ``0, s, ..., (k - 1) s`` (those ``< n``), ``[n]``.

    With ``t = a s + r`` (``0 <= r < s``), ``(C u)_t = sum_{j = max(0, a-k+1)}^{a} c_{j s + r}``:
    a running sum down the columns of ``c`` folded into rows of ``s``.
    """
    blocks = -(-n // s)
    folded = np.zeros(blocks * s)
    folded[: min(c.size, n)] = c[:n]
    sums = np.cumsum(folded.reshape(blocks, s), axis=0)
    if k < blocks:
        sums[k:] = sums[k:] - sums[:-k].copy()
    return sums.reshape(-1)[:n]


def _pattern_count(n: int, s: int, k: int) -> int:
    """The number of non-empty participation patterns: at most ``k`` steps in ``[0, n)``, gaps ``>= s``."""
    # ways[j][t]: patterns of exactly j steps whose first step is t.
    ways = [1] * n
    total = n
    for _ in range(1, k):
        suffix = [0] * (n + 1)
        for t in range(n - 1, -1, -1):
            suffix[t] = suffix[t + 1] + ways[t]
        ways = [suffix[t + s] if t + s < n else 0 for t in range(n)]
        total += sum(ways)
        if total > _MAX_ENUMERATED_PATTERNS:
            break
    return total


def _patterns(n: int, s: int, k: int):
    """Every non-empty participation pattern, as a tuple of steps."""

    def extend(prefix: tuple, start: int):
        for t in range(start, n):
            pattern = prefix + (t,)
            yield pattern
            if len(pattern) < k:
                yield from extend(pattern, t + s)

    yield from extend((), 0)


def _enumerated_sensitivity(c: np.ndarray, n: int, s: int, k: int) -> float:
    """The worst case over every pattern, for a ``C^T C`` with no negative entry where patterns reach."""
    count = _pattern_count(n, s, k)
    if n > _MAX_ENUMERATED_STEPS or count > _MAX_ENUMERATED_PATTERNS:
        raise ValueError(
            "sensitivity has no closed form for these coefficients (it needs them non-negative and "
            "non-increasing from c_1 on, or no longer than min_separation, or max_participations=1), "
            f"and the {'more than ' if count > _MAX_ENUMERATED_PATTERNS else ''}{count} participation "
            f"patterns of n={n}, min_separation={s}, max_participations={k} are too many to enumerate "
            f"(at most {_MAX_ENUMERATED_PATTERNS} patterns and {_MAX_ENUMERATED_STEPS} steps)."
        )
    C = _toeplitz(c, n)
    gram = C.T @ C
    steps = np.arange(n)
    reachable = np.abs(steps[:, None] - steps[None, :]) >= s
    scale = float(np.max(np.abs(gram)))
    if np.any(gram[reachable] < -1e-12 * scale):
        raise ValueError(
            "sensitivity is not exact for these coefficients: C^T C has negative entries between "
            f"steps at least min_separation={s} apart, so contributions in different directions "
            "can be worse than aligned ones (the worst case is then a semidefinite program, not "
            "computed here)."
        )
    # Negligible negative entries (rounding of exact zeros) are taken as their absolute value:
    # an upper bound that differs from the exact value by at most 1e-12 relative.
    gram = np.abs(gram)
    best = 0.0
    batch = []
    for pattern in _patterns(n, s, k):
        batch.append(pattern)
        if len(batch) == 4096:
            best = max(best, _max_quadratic(gram, batch, n))
            batch = []
    if batch:
        best = max(best, _max_quadratic(gram, batch, n))
    return math.sqrt(best)


def _max_quadratic(gram: np.ndarray, patterns: list, n: int) -> float:
    u = np.zeros((len(patterns), n))
    for row, pattern in enumerate(patterns):
        u[row, list(pattern)] = 1.0
    return float(np.max(np.einsum("pi,ij,pj->p", u, gram, u)))


def _toeplitz(c: np.ndarray, n: int) -> np.ndarray:
    """The explicit ``n x n`` lower-triangular Toeplitz matrix of ``c``."""
    padded = np.zeros(n)
    padded[: min(c.size, n)] = c[:n]
    lag = np.subtract.outer(np.arange(n), np.arange(n))
    return np.where(lag >= 0, padded[np.clip(lag, 0, n - 1)], 0.0)


def sensitivity(coefficients: np.ndarray, n: int, *, min_separation: int, max_participations: int) -> float:
    """L2 sensitivity of ``C G`` to adding or removing one example, worst case over its participations.

    The example participates in at most ``k = max_participations`` of the
    ``n`` steps, any two at least ``s = min_separation`` steps apart; at step
    ``p_i`` it adds a vector ``g_i`` of norm ``<= 1`` to row ``p_i`` of ``G``
    (its clipped gradient, clip norm 1). ``C G`` then moves by
    ``sum_i C[:, p_i] g_i^T``, whose squared Frobenius norm is
    ``sum_{i,j} M[p_i, p_j] <g_i, g_j>`` with ``M = C^T C``. The value returned
    is the largest norm over every pattern ``p`` and every such ``g``
    (replace-one neighbours, one example's contributions swapped for
    another's, move it by up to twice that).

    How it is computed, and why it is exact:

    1. Aligned contributions are worst where ``M[p_i, p_j] >= 0``: then
       ``sum M <g_i, g_j> <= sum M |<g_i, g_j>| <= sum M``, with equality for
       ``g_i`` all one unit vector; so the squared sensitivity is the largest
       ``1^T M[p, p] 1 = ||C u_p||^2`` over patterns, ``u_p`` the indicator of
       ``p``.
    2. Closed form (``O(n)``): the earliest pattern ``0, s, ..., (k - 1) s``
       is worst when the coefficients are non-negative and non-increasing from
       ``c_1`` on (``c_0`` may be anything positive; every BLT is such). Proof:
       for ``i <= j``, ``M[i, j] = r(j - i, n - j)`` with
       ``r(delta, L) = sum_{m < L} c_m c_{m + delta}``, which is ``>= 0``,
       non-decreasing in ``L`` (terms are ``>= 0``) and non-increasing in
       ``delta >= 1`` (``c_{m + delta}`` is, as ``m + delta >= 1``). Take any
       pattern ``p_1 < ... < p_j`` (``j <= k``) and ``q_i = (i - 1) s``. Then
       ``q_i <= p_i`` and ``q_j - q_i = (j - i) s <= p_j - p_i``, so every
       term ``M[q_i, q_j] >= M[p_i, p_j]``; the remaining steps of ``q`` (up to
       ``k``, all within ``n`` by feasibility) only add terms ``>= 0``.
       The earliest pattern is also worst, whatever the signs, when
       ``len(coefficients) <= s`` (then ``M[p_i, p_j] = 0`` for ``i != j``
       and the diagonal ``M[t, t] = sum_{m < n - t} c_m^2`` does not increase
       with ``t``) and when ``k = 1`` (one column, the first is the longest).
    3. Otherwise, on small problems (at most 200,000 patterns and 1024
       steps), every pattern is enumerated, after checking that ``M`` has no
       negative entry between steps ``>= s`` apart (else point 1 fails).
    4. Anything else raises ``ValueError`` rather than give a number that is
       not the worst case.

    Args:
      coefficients: 1-D real array-like, finite, ``c_0 > 0`` (those past
        ``n`` unused).
      n: the number of steps (positive int).
      min_separation: the least number of steps between two participations
        (positive int; 1 allows every step).
      max_participations: the most participations of one example (positive
        int, at most ``(n - 1) // min_separation + 1``).

    Raises:
      TypeError, ValueError: an argument is not as above (the message names
        it), or point 4.

    Examples:
      >>> sensitivity([1.0], 10, min_separation=3, max_participations=4)  # DP-SGD: sqrt(k)
      2.0
      >>> # Two bands, consecutive steps allowed: columns 0 and 1 overlap on one row.
      >>> round(sensitivity([0.8, 0.6], 4, min_separation=1, max_participations=2) ** 2, 12)
      2.96
    """
    c = _check_coefficients(coefficients)
    n = check_positive_int("n", n)
    s, k = _check_schema(n, min_separation, max_participations)
    c = c[:n]
    tail = c[1:]
    closed_form = k == 1 or c.size <= s or (np.all(tail >= 0) and np.all(np.diff(tail) <= 0))
    if closed_form:
        return float(np.linalg.norm(_earliest_pattern_response(c, n, s, k)))
    return _enumerated_sensitivity(c, n, s, k)


# ----------------------------------------------------------------------------
# Objectives with their gradients, and the optimizer
# ----------------------------------------------------------------------------


def _error_and_gradient(c: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """``E = prefix_sum_error(c, n)**2`` and ``dE/dc`` ``[len(c)]`` (``len(c) <= n``).

    With ``d = 1 / c(z)``, ``e = cumsum(d)`` and ``w_k = (n - k) / n``,
    ``E = sum_k w_k e_k**2``, so ``dE/dd_j = g_j = sum_{k >= j} 2 w_k e_k``; a
    change ``dc`` changes ``d`` by ``-d^2 dc`` (as series), so
    ``dE/dc_m = -sum_t g_{t+m} (d^2)_t``: one more product and one
    correlation, each an FFT product.
    """
    d = _series_inverse(c, n)
    e = np.cumsum(d)
    weights = np.arange(n, 0, -1, dtype=np.float64) / n
    value = float(np.dot(weights, e * e))
    g = np.cumsum((2.0 * weights * e)[::-1])  # g reversed: g[::-1][j] = g_j
    correlation = _product(g, _product(d, d, n), n)[::-1]
    return value, -correlation[: c.size]


def _earliest_sensitivity_and_gradient(c: np.ndarray, n: int, s: int, k: int) -> tuple[float, np.ndarray]:
    """``S = ||C u||^2`` for the earliest pattern ``u`` (``_earliest_pattern_response``) and ``dS/dc`` ``[n]``.

    ``dS/dc_m = 2 sum_i (C u)_{i s + m}`` over the pattern's steps ``i s < n - m``:
    with ``m = a s + r``, a sum of ``k`` rows of ``C u`` folded into rows of ``s``.
    """
    y = _earliest_pattern_response(c, n, s, k)
    blocks = -(-n // s)
    folded = np.zeros(blocks * s)
    folded[:n] = y
    tails = np.cumsum(folded.reshape(blocks, s)[::-1], axis=0)[::-1]  # rows a.. summed
    if k < blocks:
        tails[:-k] = tails[:-k] - tails[k:].copy()
    return float(np.dot(y, y)), 2.0 * tails.reshape(-1)[: c.size]


def _banded_objective(v: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """``log`` of ``prefix_sum_error(v / ||v||, n)**2 = ||v||^2 E(v)`` and its gradient."""
    error, grad = _error_and_gradient(v, n)
    norm2 = float(np.dot(v, v))
    return math.log(norm2 * error), 2.0 * v / norm2 + grad / error


def _blt_from_unconstrained(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(theta, log theta, omega)`` of ``x = [logits of theta, softplus^-1 of omega]``, stably."""
    logits, raw = np.split(x, 2)
    log_theta = -np.logaddexp(0.0, -logits)
    return np.exp(log_theta), log_theta, np.logaddexp(0.0, raw)


def _blt_unconstrained(theta: np.ndarray, omega: np.ndarray) -> np.ndarray:
    return np.concatenate([np.log(theta) - np.log1p(-theta), omega + np.log(-np.expm1(-omega))])


def _blt_objective(x: np.ndarray, n: int, s: int, k: int) -> tuple[float, np.ndarray]:
    """``log((sensitivity * error)^2)`` of the BLT of unconstrained ``x`` and its gradient.

    With ``P[j, i] = theta_i**j`` (``j < n - 1``), ``c_{j+1} = (P omega)_j``,
    so ``dc_{j+1}/domega_i = P[j, i]`` and
    ``dc_{j+1}/dtheta_i = omega_i j theta_i**(j-1)``; then the chain rule
    through the sigmoid and the softplus.
    """
    theta, log_theta, omega = _blt_from_unconstrained(x)
    logits, raw = np.split(x, 2)
    j = np.arange(n - 1, dtype=np.float64)
    powers = np.exp(j[:, None] * log_theta[None, :])  # [n - 1, d]
    c = np.concatenate([[1.0], powers @ omega])
    sens, grad_sens = _earliest_sensitivity_and_gradient(c, n, s, k)
    error, grad_error = _error_and_gradient(c, n)
    value = math.log(sens * error)
    grad_c = (grad_sens / sens + grad_error / error)[1:]  # c_0 = 1 is fixed
    grad_omega = grad_c @ powers
    grad_theta = omega * ((grad_c[1:] * j[1:]) @ powers[:-1]) if n > 2 else np.zeros_like(theta)
    one_minus_theta = np.exp(-np.logaddexp(0.0, logits))  # sigmoid(-logits), exact near theta = 1
    sigmoid_raw = np.exp(-np.logaddexp(0.0, -raw))  # d softplus / d raw
    return value, np.concatenate([grad_theta * theta * one_minus_theta, grad_omega * sigmoid_raw])


def _minimize(objective, start: np.ndarray) -> tuple[np.ndarray, float]:
    """L-BFGS from ``start`` on ``objective(x) -> (value, gradient)``: the position and its value.

    TensorFlow Probability's ``lbfgs_minimize`` (with its Hager-Zhang line
    search) on its NumPy substrate: the same algorithm as
    ``tfp.optimizer.lbfgs_minimize``, without building or running a
    TensorFlow graph of the optimization (building it takes far longer than
    the optimization itself). The objective is evaluated in float64 NumPy; a
    non-finite value (a step into a region where ``C^{-1}`` overflows) reads
    as ``+inf``, which the line search backs off from. The position returned
    is never worse than ``start``.
    """
    from tensorflow_probability.substrates import numpy as tfp_numpy  # noqa: PLC0415

    def batched(x):  # the substrate wants a batch axis: [1, D] -> ([1], [1, D])
        with np.errstate(all="ignore"):
            try:
                value, gradient = objective(x[0])
            except (FloatingPointError, ValueError, OverflowError, ZeroDivisionError):
                value, gradient = math.inf, np.zeros_like(x[0])
        if not (math.isfinite(value) and np.all(np.isfinite(gradient))):
            value, gradient = math.inf, np.zeros_like(x[0])
        return np.array([value], dtype=np.float64), np.asarray(gradient, dtype=np.float64)[None, :]

    start = np.asarray(start, dtype=np.float64)
    f0 = float(batched(start[None, :])[0][0])
    result = tfp_numpy.optimizer.lbfgs_minimize(
        batched,
        initial_position=start[None, :],
        tolerance=_GRAD_TOL,
        f_relative_tolerance=_F_RTOL,
        max_iterations=_MAX_ITERATIONS,
    )
    value = float(np.asarray(result.objective_value).reshape(-1)[0])
    if not (math.isfinite(value) and value <= f0):
        return start.copy(), f0
    return np.asarray(result.position, dtype=np.float64)[0], value


# ----------------------------------------------------------------------------
# BandMF
# ----------------------------------------------------------------------------


def _sqrt_series(length: int) -> np.ndarray:
    """The first ``length`` coefficients of ``(1 - z)^(-1/2)``: ``a_0 = 1``, ``a_k = a_{k-1} (2k - 1) / (2k)``."""
    k = np.arange(1, length, dtype=np.float64)
    return np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k))])


def _banded_start(num_steps: int, bands: int) -> np.ndarray:
    """The square root of the prefix-sum series, truncated to ``bands`` and normalized."""
    a = _sqrt_series(bands)
    return a / np.linalg.norm(a)


@functools.lru_cache(maxsize=64)
def _banded(num_steps: int, bands: int) -> tuple[float, ...]:
    start = _banded_start(num_steps, bands)
    if bands == 1:
        return (1.0,)
    v, _ = _minimize(lambda v: _banded_objective(v, num_steps), start)
    c = v / np.linalg.norm(v)
    if c[0] < 0:
        c = -c
    return tuple(float(x) for x in c)


def banded_coefficients(num_steps: int, bands: int) -> np.ndarray:
    """BandMF's strategy: the ``bands`` coefficients of ``C`` minimizing ``prefix_sum_error(c, num_steps)``.

    Minimized over ``c`` with ``||c||_2 = 1`` (so every column of ``C`` has
    norm at most 1, exactly 1 for the first ``num_steps - bands + 1``) and
    ``c_0 > 0``. Parametrized as ``c = v / ||v||`` and minimized by L-BFGS in
    float64, from the first ``bands`` coefficients of ``(1 - z)^(-1/2)``
    normalized (the square root of the prefix-sum series, a near-optimal
    Toeplitz factor); the result is never worse than that start. Under
    participations at least ``bands`` steps apart the columns of ``C`` they
    touch do not overlap, so the sensitivity is at most
    ``sqrt(max_participations)``, as for DP-SGD (equal when the last
    participation can be ``bands`` or more steps before the end), and only
    the error differs.
    Computed once per ``(num_steps, bands)`` and cached; a new array is
    returned each call.

    Args:
      num_steps: ``n``, the planned number of steps (positive int).
      bands: ``b``, the number of coefficients, ``1 <= b <= num_steps``.

    Returns:
      float64 ``[bands]``, ``c_0 > 0``, unit L2 norm; ``[1.0]`` for one band.

    Raises:
      TypeError, ValueError: an argument not as above (the message names it).

    Examples:
      >>> banded_coefficients(100, 1)
      array([1.])
      >>> c = banded_coefficients(64, 8)  # cached: the module's example computed it
      >>> round(prefix_sum_error(c, 64), 2), round(prefix_sum_error([1.0], 64), 2)
      (2.66, 5.7)
    """
    num_steps = check_positive_int("num_steps", num_steps)
    bands = check_positive_int("bands", bands)
    if bands > num_steps:
        raise ValueError(f"bands must be at most num_steps={num_steps}; got bands={bands}.")
    return np.array(_banded(num_steps, bands), dtype=np.float64)


# ----------------------------------------------------------------------------
# BLT
# ----------------------------------------------------------------------------


def _blt_start(num_steps: int, buffers: int) -> tuple[np.ndarray, np.ndarray]:
    """A spread of decays and output scales whose coefficients follow ``(1 - z)^(-1/2)``.

    ``a_k ~ 1 / sqrt(pi k) = (1 / pi) int_0^inf exp(-lam k) lam^(-1/2) dlam``; the
    integral is discretized on ``buffers`` rates ``lam_i`` spaced evenly in
    ``log`` between about ``1 / num_steps`` and 1, ``theta_i = exp(-lam_i)``
    and ``omega_i`` the quadrature weight (``lam_i^(1/2) dlog / pi`` times
    ``exp(-lam_i)``, the ``k - 1`` offset), then all ``omega`` scaled so that
    ``c_1 = sum omega = 1/2 = a_1``.
    """
    low, high = math.log(1.0 / max(num_steps, 2)), 0.0
    if buffers == 1:
        log_lam = np.array([0.5 * (low + high)])
        step = high - low
    else:
        log_lam = np.linspace(low, high, buffers)
        step = (high - low) / (buffers - 1)
    lam = np.exp(log_lam)
    theta = np.exp(-lam)
    omega = np.sqrt(lam) * step / math.pi * theta
    omega *= 0.5 / omega.sum()
    return theta, omega


@functools.lru_cache(maxsize=64)
def _blt(num_steps: int, buffers: int, s: int, k: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    theta, omega = _blt_start(num_steps, buffers)
    if num_steps > 1:
        x, _ = _minimize(lambda x: _blt_objective(x, num_steps, s, k), _blt_unconstrained(theta, omega))
        theta, _, omega = _blt_from_unconstrained(x)
    order = np.argsort(-theta, kind="stable")
    theta, omega = theta[order], omega[order]
    # Decays that saturated in float64 (1.0 or 0.0) are brought back inside (0, 1).
    theta = np.clip(theta, np.finfo(np.float64).tiny, np.nextafter(1.0, 0.0))
    omega = np.maximum(omega, np.finfo(np.float64).tiny)
    return tuple(float(x) for x in theta), tuple(float(x) for x in omega)


def blt_parameters(
    num_steps: int, buffers: int, *, min_separation: int, max_participations: int
) -> tuple[np.ndarray, np.ndarray]:
    """BLT's strategy: ``(theta, omega)``, float64 ``[buffers]`` each, minimizing ``(sensitivity * error)^2``.

    The strategy ``C`` has ``c_0 = 1`` and ``c_k = sum_i omega_i
    theta_i**(k - 1)`` (``blt_coefficients``), ``theta`` in ``(0, 1)`` (the
    buffers' decays, sorted decreasing) and ``omega > 0`` (their output
    scales). Minimized is ``sensitivity(c, n, min_separation=s,
    max_participations=k)**2 * prefix_sum_error(c, n)**2`` for
    ``n = num_steps``, over ``theta = sigmoid(.)``, ``omega = softplus(.)``,
    by L-BFGS in float64 from decays spread evenly in log rate between about
    ``1 / n`` and 1 with output scales that make ``c_k`` follow
    ``(1 - z)^(-1/2)``; the result is never worse than that start. Every
    such ``C`` has non-negative coefficients that do not increase from
    ``c_1`` on, so its sensitivity is the closed form of ``sensitivity``
    (the earliest pattern). The noise ``C^{-1} Z`` needs
    ``buffers`` vectors of state. Computed once per argument tuple and
    cached; new arrays are returned each call.

    Args:
      num_steps: ``n``, the planned number of steps (positive int).
      buffers: ``d``, the number of buffers (positive int; 1 to 6 is usual).
      min_separation: ``s``, see ``sensitivity``.
      max_participations: ``k``, see ``sensitivity``.

    Raises:
      TypeError, ValueError: an argument not as above (the message names it).

    Examples:
      >>> n = 64  # one participation: DP-SGD's sensitivity * error is sqrt((n + 1) / 2)
      >>> theta, omega = blt_parameters(n, 2, min_separation=n, max_participations=1)
      >>> theta.shape, bool(np.all((0 < theta) & (theta < 1))), bool(np.all(omega > 0))
      ((2,), True, True)
      >>> c = blt_coefficients(theta, omega, n)
      >>> merit = sensitivity(c, n, min_separation=n, max_participations=1) * prefix_sum_error(c, n)
      >>> bool(merit < prefix_sum_error([1.0], n) / 2)
      True
    """
    num_steps = check_positive_int("num_steps", num_steps)
    buffers = check_positive_int("buffers", buffers)
    s, k = _check_schema(num_steps, min_separation, max_participations)
    theta, omega = _blt(num_steps, buffers, num_steps if k == 1 else s, k)  # s is moot for k = 1
    return np.array(theta, dtype=np.float64), np.array(omega, dtype=np.float64)


def blt_coefficients(theta: np.ndarray, omega: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` coefficients of the BLT strategy: ``c_0 = 1``, ``c_k = sum_i omega_i theta_i**(k - 1)``.

    Args:
      theta: float ``[d]``, each in ``(0, 1)``.
      omega: float ``[d]``, each ``> 0``.
      n: the number of coefficients (positive int).

    Returns:
      float64 ``[n]``.

    Raises:
      TypeError, ValueError: naming the argument that is not as above.

    Examples:
      >>> blt_coefficients([0.5], [0.25], 5)
      array([1.     , 0.25   , 0.125  , 0.0625 , 0.03125])
    """
    theta, omega = _check_blt(theta, omega)
    n = check_positive_int("n", n)
    powers = theta[None, :] ** np.arange(n - 1, dtype=np.float64)[:, None]  # [n-1, d]
    return np.concatenate([[1.0], powers @ omega])


def _blt_inverse_coefficients(theta: np.ndarray, omega: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` coefficients of ``C^{-1}`` for a BLT, from its closed form, float64 ``[n]``.

    ``1`` and ``-omega^T (Theta - 1 omega^T)^(k - 1) 1`` for ``k >= 1``
    (itself a BLT of decays the eigenvalues of ``Theta - 1 omega^T``), by
    Krylov doubling: ``O(n d^2)``.
    """
    theta, omega = _check_blt(theta, omega)
    n = check_positive_int("n", n)
    transition = np.diag(theta) - np.outer(np.ones_like(theta), omega)
    krylov = np.ones((theta.size, 1))
    power = transition
    while krylov.shape[1] < n - 1:
        krylov = np.concatenate([krylov, power @ krylov], axis=1)
        power = power @ power
    return np.concatenate([[1.0], -(omega @ krylov[:, : n - 1])])
