"""The estimators of a privacy audit: functions of counts, so anyone can check them.

An audit trains with ``m`` canaries, each included independently with
probability 1/2, then guesses from the trained model (or the released
gradients) which were included. These functions turn the counts into lower
bounds on epsilon at a stated significance: if the training really were
``(epsilon, delta)``-DP, counts as good as these would occur with probability
at most ``significance``, so the claim is rejected. A lower bound is evidence
against a claim, never a proof of privacy.

- ``epsilon_one_run`` (Steinke, Nasr and Jagielski 2023, "Privacy Auditing
  with One (1) Training Run", with its delta term): ``num_correct`` right
  among ``num_guesses`` guesses about ``num_canaries`` canaries of *one* run.
  Valid for any mechanism and any scores; the scores may depend on each other.
- ``mu_gaussian_dp`` / ``epsilon_gaussian_dp`` (Nasr et al. 2023, "Tight
  Auditing of Differentially Private Machine Learning"): Clopper-Pearson
  upper bounds on the false positive and false negative rates of one
  threshold test, the smallest ``mu`` of ``mu``-Gaussian DP they rule out,
  converted to ``(epsilon, delta)``. It treats the canaries as independent
  trials and assumes the trade-off curve is Gaussian's: exact for Dirac
  gradient canaries under the Gaussian mechanism at ``q = 1`` (DP-SGD, and
  BandMF and BLT taken whole), an approximation elsewhere.
- ``epsilon_clopper_pearson``: the same rates against ``(epsilon, delta)``-DP
  directly (``FNR >= 1 - delta - e^eps FPR``), no Gaussian assumption.
- ``clopper_pearson``: the exact binomial confidence interval underneath.

The statistics are tensorflow-probability's distributions (``Binomial`` for
the one-run tails, ``Beta`` for Clopper-Pearson, ``Normal`` for Gaussian DP),
in float64; the searches over epsilon are bisections here.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

_GRID = 64  # points on which the one-run p-value is evaluated before the bisection
_BISECTIONS = 40  # halvings of one grid cell (width <= 0.3): to about 1e-12


def _tfp():
    import tensorflow_probability as tfp  # loads TensorFlow: imported on first use

    return tfp


def _tf():
    import tensorflow as tf

    return tf


def _count(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer; got {value!r}.")
    return int(value)


def _probability(name: str, value, *, closed_low: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number; got {type(value).__name__} {value!r}.")
    value = float(value)
    low_ok = value >= 0 if closed_low else value > 0
    if not (low_ok and value < 1):
        interval = "[0, 1)" if closed_low else "(0, 1)"
        raise ValueError(f"{name} must be in {interval}; got {value!r}.")
    return value


def check_delta(delta) -> float:
    """``delta`` as a float in ``[0, 1)``, or a ``ValueError`` naming it."""
    return _probability("delta", delta, closed_low=True)


def check_significance(significance) -> float:
    """``significance`` as a float in ``(0, 1)``, or a ``ValueError`` naming it."""
    return _probability("significance", significance, closed_low=False)


def _one_run_counts(num_canaries, num_guesses, num_correct) -> tuple[int, int, int]:
    m = _count("num_canaries", num_canaries)
    r = _count("num_guesses", num_guesses)
    v = _count("num_correct", num_correct)
    if not v <= r <= m:
        raise ValueError(
            f"need num_correct <= num_guesses <= num_canaries; got num_correct={v}, num_guesses={r}, num_canaries={m}."
        )
    return m, r, v


# --------------------------------------------------------------------------
# One run (Steinke, Nasr, Jagielski 2023)
# --------------------------------------------------------------------------


_compiled: dict = {}


def _graph(name: str, build):
    """A ``tf.function`` made once per process by ``build()`` (TensorFlow-probability's Python is slow eagerly)."""
    if name not in _compiled:
        _compiled[name] = _tf().function(build(), reduce_retracing=True)
    return _compiled[name]


def _one_run_graph():
    tf, tfd = _tf(), _tfp().distributions

    def p_values(m, r, v, epsilons, delta):
        p = tf.sigmoid(epsilons)[:, None]  # e^eps / (1 + e^eps): randomized response's accuracy
        binomial = tfd.Binomial(total_count=r, probs=p, validate_args=False)
        beta = binomial.survival_function(tf.cast(v, tf.float64) - 1.0)[:, 0]  # P[Binomial(r, p) >= v]
        below = tf.range(tf.cast(v, tf.float64) - 1.0, -1.0, -1.0, dtype=tf.float64)  # v-1, v-2, ..., 0
        # column i-1: P[v - i <= Binomial(r, p) < v], i = 1..v
        window = tf.cumsum(binomial.prob(below[None, :]), axis=1)
        alpha = tf.reduce_max(window / tf.range(1.0, tf.cast(v, tf.float64) + 1.0, dtype=tf.float64)[None, :], axis=1)
        return tf.minimum(beta + 2.0 * m * delta * alpha, 1.0)

    return p_values


def _one_run_p_values(m: int, r: int, v: int, epsilons: np.ndarray, delta: float) -> np.ndarray:
    """``[len(epsilons)]`` p-values of ``v`` correct of ``r`` guesses under ``(eps, delta)``-DP, ``m`` canaries."""
    tf = _tf()
    epsilons = np.asarray(epsilons, np.float64)
    if v == 0:
        return np.ones_like(epsilons)
    f64 = lambda x: tf.constant(x, tf.float64)  # noqa: E731
    values = _graph("one_run", _one_run_graph)(f64(m), f64(r), tf.constant(v, tf.int32), f64(epsilons), f64(delta))
    return values.numpy()


def one_run_p_value(num_canaries: int, num_guesses: int, num_correct: int, *, epsilon: float, delta: float) -> float:
    """The p-value of ``num_correct`` correct guesses if training were ``(epsilon, delta)``-DP.

    Steinke, Nasr and Jagielski (2023): ``m = num_canaries`` canaries, each
    included independently with probability 1/2; an auditor guesses
    ``r = num_guesses`` of them (in or out, abstaining on the rest) from the
    output of one run, ``v = num_correct`` rightly. Under ``(epsilon,
    delta)``-DP, with ``p = e^eps / (1 + e^eps)``,

        P[at least v correct] <= beta + 2 m delta alpha,
        beta  = P[Binomial(r, p) >= v],
        alpha = max_{1 <= i <= v} P[v - i <= Binomial(r, p) < v] / i,

    which is returned (capped at 1). With ``delta = 0`` it is ``beta``: the
    guesses are no better than ``r`` coin flips that land right with
    probability ``p``.

    Examples:
      >>> round(one_run_p_value(100, 10, 10, epsilon=0.0, delta=0.0), 6)   # 10 of 10 at eps = 0: 2^-10
      0.000977

    Raises:
      ValueError: counts that are not non-negative integers with
        ``num_correct <= num_guesses <= num_canaries``, ``epsilon < 0`` or
        ``delta`` outside ``[0, 1)``.
    """
    m, r, v = _one_run_counts(num_canaries, num_guesses, num_correct)
    delta = check_delta(delta)
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not epsilon >= 0 or math.isinf(epsilon):
        raise ValueError(f"epsilon must be a finite number >= 0; got {epsilon!r}.")
    return float(_one_run_p_values(m, r, v, np.array([epsilon]), delta)[0])


def epsilon_one_run(
    num_canaries: int, num_guesses: int, num_correct: int, *, delta: float, significance: float = 0.05
) -> float:
    """The largest epsilon at which the ``(epsilon, delta)`` claim is rejected by these counts; 0 when none.

    The claim ``(epsilon, delta)``-DP is rejected at level ``significance``
    when ``one_run_p_value(...) <= significance``. Any claim with a smaller
    epsilon is stronger, hence also false when this one is; the bound is the
    smallest epsilon whose p-value exceeds ``significance`` (searched on a
    grid of 64 points between 0 and an epsilon where ``p^r`` alone exceeds
    it, then by bisection to about 1e-12), so that every claim below it is
    rejected. If the training was ``(epsilon*, delta)``-DP, the bound exceeds
    ``epsilon*`` with probability at most ``significance``.

    Examples:
      >>> round(epsilon_one_run(1000, 100, 100, delta=0.0), 4)   # 100 of 100: logit(0.05 ** (1 / 100))
      3.493

    Raises:
      ValueError: as ``one_run_p_value``, or ``significance`` outside ``(0, 1)``.
    """
    m, r, v = _one_run_counts(num_canaries, num_guesses, num_correct)
    delta = check_delta(delta)
    alpha = check_significance(significance)
    if v == 0 or _one_run_p_values(m, r, v, np.zeros(1), delta)[0] > alpha:
        return 0.0  # not even eps = 0 is rejected
    # At eps_hi, P[Binomial(r, p) = r] = p^r > alpha alone: the p-value there exceeds alpha.
    log_p = math.log(alpha) / r  # log of the p with p^r = alpha
    high = log_p - math.log(-math.expm1(log_p)) + 1.0  # logit(p) + 1
    tf = _tf()
    f64 = lambda x: tf.constant(x, tf.float64)  # noqa: E731
    search = _graph("one_run_search", _one_run_search_graph)
    return float(search(f64(m), f64(r), tf.constant(v, tf.int32), f64(delta), f64(alpha), f64(high)).numpy())


def _one_run_search_graph():
    tf = _tf()
    p_values = _one_run_graph()

    def search(m, r, v, delta, alpha, high):
        grid = tf.linspace(tf.constant(0.0, tf.float64), high, _GRID + 1)
        above = p_values(m, r, v, grid, delta) > alpha  # [0] is False (checked before), [-1] True
        first = tf.maximum(tf.argmax(tf.cast(above, tf.int32)), 1)

        def bisect(i, lo, hi):
            middle = 0.5 * (lo + hi)
            rejected = p_values(m, r, v, middle[None], delta)[0] <= alpha
            return i + 1, tf.where(rejected, middle, lo), tf.where(rejected, hi, middle)

        _, lo, _ = tf.while_loop(
            lambda i, lo, hi: i < _BISECTIONS, bisect, (tf.constant(0), grid[first - 1], grid[first])
        )
        return lo

    return search


# --------------------------------------------------------------------------
# Clopper-Pearson
# --------------------------------------------------------------------------


def _clopper_pearson_graph():
    tf, tfd = _tf(), _tfp().distributions

    def upper(k, n, level):
        full = k >= n
        a = tf.where(full, tf.ones_like(k), k + 1.0)
        b = tf.where(full, tf.ones_like(k), n - k)
        # P[Binomial(n, p) <= k] = 1 - I_p(k + 1, n - k): the bound is the (1 - level) quantile of Beta(k + 1, n - k).
        return tf.where(full, tf.ones_like(k), tfd.Beta(a, b).quantile(1.0 - level))

    return upper


def _clopper_pearson_upper(successes: np.ndarray, trials: int, level: float) -> np.ndarray:
    """``[k]`` upper bounds ``p`` with ``P[Binomial(trials, p) <= k] = level`` (1 where ``k = trials``)."""
    tf = _tf()
    k = tf.constant(np.asarray(successes, np.float64).reshape(-1), tf.float64)
    f64 = lambda x: tf.constant(float(x), tf.float64)  # noqa: E731
    return _graph("clopper_pearson", _clopper_pearson_graph)(k, f64(trials), f64(level)).numpy()


def clopper_pearson(successes: int, trials: int, *, significance: float = 0.05) -> tuple[float, float]:
    """The exact (Clopper-Pearson) two-sided interval ``(low, high)`` for a binomial rate, at ``1 - significance``.

    ``low`` is the ``significance / 2`` quantile of ``Beta(k, n - k + 1)`` (0
    when ``k = 0``) and ``high`` the ``1 - significance / 2`` quantile of
    ``Beta(k + 1, n - k)`` (1 when ``k = n``): the rates at which ``k`` or
    more (fewer) successes of ``n`` have probability exactly ``significance /
    2``. Each end fails with probability at most ``significance / 2``.

    Examples:
      >>> low, high = clopper_pearson(0, 100)
      >>> low, round(high, 6), round(1 - 0.025 ** (1 / 100), 6)   # k = 0: 1 - (significance/2)^(1/n)
      (0.0, 0.036217, 0.036217)

    Raises:
      ValueError: ``successes`` or ``trials`` not non-negative integers,
        ``successes > trials``, ``trials == 0``, or ``significance`` outside ``(0, 1)``.
    """
    k, n = _count("successes", successes), _count("trials", trials)
    if n == 0 or k > n:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1; got successes={k}, trials={n}.")
    alpha = check_significance(significance)
    high = float(_clopper_pearson_upper(np.array([k]), n, alpha / 2)[0])
    low = 1.0 - float(_clopper_pearson_upper(np.array([n - k]), n, alpha / 2)[0])  # by symmetry in k <-> n - k
    return max(0.0, low), high


# --------------------------------------------------------------------------
# Gaussian DP (Nasr et al. 2023) and plain (epsilon, delta)
# --------------------------------------------------------------------------


def _rate_counts(false_positives, false_negatives, num_out, num_in) -> tuple[int, int, int, int]:
    fp, fn = _count("false_positives", false_positives), _count("false_negatives", false_negatives)
    n_out, n_in = _count("num_out", num_out), _count("num_in", num_in)
    if fp > n_out or fn > n_in:
        raise ValueError(
            f"need false_positives <= num_out and false_negatives <= num_in; got false_positives={fp}, "
            f"num_out={n_out}, false_negatives={fn}, num_in={n_in}."
        )
    return fp, fn, n_out, n_in


def _rate_bounds(fp: np.ndarray, fn: np.ndarray, n_out: int, n_in: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Upper confidence bounds on the false positive and false negative rates, each at ``alpha / 2``."""
    fpr = _clopper_pearson_upper(fp, n_out, alpha / 2) if n_out else np.ones_like(fp, np.float64)
    fnr = _clopper_pearson_upper(fn, n_in, alpha / 2) if n_in else np.ones_like(fn, np.float64)
    return fpr, fnr


def _quantile_graph():
    tf, tfd = _tf(), _tfp().distributions
    return lambda p: tfd.Normal(tf.constant(0.0, tf.float64), tf.constant(1.0, tf.float64)).quantile(p)


def _mu_from_rates(fpr: np.ndarray, fnr: np.ndarray) -> np.ndarray:
    """``Phi^-1(1 - FPR) - Phi^-1(FNR)``, at least 0: the smallest ``mu`` a test with these rates rules out."""
    tf = _tf()
    quantile = _graph("normal_quantile", _quantile_graph)
    inside = lambda r: tf.constant(np.clip(np.asarray(r, np.float64).reshape(-1), 1e-300, 1.0 - 1e-16))  # noqa: E731
    mu = -quantile(inside(fpr)).numpy() - quantile(inside(fnr)).numpy()
    useless = (np.asarray(fpr).reshape(-1) >= 1.0) | (np.asarray(fnr).reshape(-1) >= 1.0)
    return np.where(useless, 0.0, np.maximum(mu, 0.0))


def mu_gaussian_dp(
    false_positives: int, false_negatives: int, *, num_out: int, num_in: int, significance: float = 0.05
) -> float:
    """A lower bound on ``mu`` of ``mu``-Gaussian DP from one threshold test; 0 when nothing is ruled out.

    A test that calls a canary "in" when its score is at least a threshold
    has, on the ``num_out`` canaries left out, ``false_positives`` "in" calls,
    and on the ``num_in`` included ones ``false_negatives`` "out" calls. Under
    ``mu``-GDP every test has ``FNR >= Phi(Phi^-1(1 - FPR) - mu)``, i.e.
    ``mu >= Phi^-1(1 - FPR) - Phi^-1(FNR)``. With ``FPR_hi`` and ``FNR_hi``
    the one-sided Clopper-Pearson upper bounds at ``significance / 2`` each
    (both hold with probability at least ``1 - significance``):

        mu_lo = Phi^-1(1 - FPR_hi) - Phi^-1(FNR_hi)

    The canaries are treated as independent trials of one test.

    Examples:
      >>> round(mu_gaussian_dp(0, 0, num_out=1000, num_in=1000), 4)   # perfect separation: 2 Phi^-1(1 - 0.025^(1/1000))
      5.3598

    Raises:
      ValueError: counts not non-negative integers, more false positives
        (negatives) than canaries out (in), or ``significance`` outside ``(0, 1)``.
    """
    fp, fn, n_out, n_in = _rate_counts(false_positives, false_negatives, num_out, num_in)
    alpha = check_significance(significance)
    fpr, fnr = _rate_bounds(np.array([fp]), np.array([fn]), n_out, n_in, alpha)
    return float(_mu_from_rates(fpr, fnr)[0])


def gaussian_dp_delta(mu: float, epsilon: float) -> float:
    """``delta(epsilon)`` of ``mu``-Gaussian DP: ``Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``.

    Dong, Roth and Su (2019), Corollary 2.13; computed in the log domain.

    Examples:
      >>> round(gaussian_dp_delta(1.0, 0.0), 6)   # eps = 0: the total variation Phi(mu/2) - Phi(-mu/2)
      0.382925
    """
    if isinstance(mu, bool) or not isinstance(mu, numbers.Real) or not math.isfinite(mu) or mu < 0:
        raise ValueError(f"mu must be a finite number >= 0; got {mu!r}.")
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not math.isfinite(epsilon) or epsilon < 0:
        raise ValueError(f"epsilon must be a finite number >= 0; got {epsilon!r}.")
    if mu == 0:
        return 0.0
    return float(np.exp(_log_gdp_delta(np.array([float(mu)]), np.array([float(epsilon)]))[0]))


def _log_gdp_delta_graph():
    tf, tfd = _tf(), _tfp().distributions

    def log_delta(mu, eps):
        normal = tfd.Normal(tf.constant(0.0, tf.float64), tf.constant(1.0, tf.float64))
        mu = tf.maximum(mu, 1e-300)
        a = normal.log_cdf(-eps / mu + mu / 2)
        b = eps + normal.log_cdf(-eps / mu - mu / 2)
        return a + tf.math.log1p(-tf.exp(tf.minimum(b - a, 0.0)))  # -inf where delta is 0

    return log_delta


def _log_gdp_delta(mu: np.ndarray, epsilon: np.ndarray) -> np.ndarray:
    """``log delta_mu(eps)`` elementwise (``-inf`` where it is 0)."""
    tf = _tf()
    mu, eps = np.broadcast_arrays(np.asarray(mu, np.float64), np.asarray(epsilon, np.float64))
    out = _graph("gdp_delta", _log_gdp_delta_graph)(tf.constant(mu, tf.float64), tf.constant(eps, tf.float64))
    return out.numpy()


def epsilon_for_mu(mu: float, delta: float) -> float:
    """The epsilon of ``mu``-Gaussian DP at ``delta``: the ``eps >= 0`` with ``gaussian_dp_delta(mu, eps) = delta``.

    0 when ``mu <= 0`` or ``delta`` already covers ``eps = 0``. The same as
    ``dp_accounting.get_epsilon_gaussian(1 / mu, delta)`` (the Gaussian
    mechanism of sensitivity 1 and std ``1 / mu`` is exactly ``mu``-GDP);
    100 bisections (the upper end is returned, so the epsilon is never under-stated).

    Examples:
      >>> round(epsilon_for_mu(1.0, 1e-5), 4)
      4.3772

    Raises:
      ValueError: ``mu`` negative or not finite, ``delta`` outside ``(0, 1)``.
    """
    if isinstance(mu, bool) or not isinstance(mu, numbers.Real) or not math.isfinite(mu) or mu < 0:
        raise ValueError(f"mu must be a finite number >= 0; got {mu!r}.")
    delta = _probability("delta", delta, closed_low=False)
    mu = float(mu)
    if mu == 0 or _log_gdp_delta(np.array([mu]), np.zeros(1))[0] <= math.log(delta):
        return 0.0
    tf = _tf()
    return float(
        _graph("epsilon_for_mu", _epsilon_for_mu_graph)(
            tf.constant(mu, tf.float64), tf.constant(delta, tf.float64)
        ).numpy()
    )


def _epsilon_for_mu_graph():
    tf, tfd = _tf(), _tfp().distributions
    log_delta = _log_gdp_delta_graph()

    def solve(mu, delta):
        z = -tfd.Normal(tf.constant(0.0, tf.float64), tf.constant(1.0, tf.float64)).quantile(delta)  # Phi(-z) = delta
        target = tf.math.log(delta)

        def bisect(i, lo, hi):
            middle = 0.5 * (lo + hi)
            above = log_delta(mu, middle) > target  # delta_mu decreases in eps: the root is further up
            return i + 1, tf.where(above, middle, lo), tf.where(above, hi, middle)

        # delta_mu(hi) <= Phi(-hi / mu + mu / 2) = delta at hi = mu (mu / 2 + z)
        start = (tf.constant(0), tf.constant(0.0, tf.float64), mu * (mu / 2 + z))
        _, _, hi = tf.while_loop(lambda i, lo, hi: i < 100, bisect, start)
        return hi

    return solve


def mu_for_epsilon(epsilon: float, delta: float) -> float:
    """The ``mu`` whose Gaussian DP has ``(epsilon, delta)``: the inverse of ``epsilon_for_mu`` in ``mu``.

    Useful to draw an accountant's claim as a Gaussian trade-off curve (for
    DP-SGD at ``q = 1`` with ``T`` steps it is ``sqrt(T) / sigma``).

    Examples:
      >>> round(mu_for_epsilon(epsilon_for_mu(1.5, 1e-5), 1e-5), 6)
      1.5
    """
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not math.isfinite(epsilon) or epsilon < 0:
        raise ValueError(f"epsilon must be a finite number >= 0; got {epsilon!r}.")
    delta = _probability("delta", delta, closed_low=False)
    target = math.log(delta)
    lo, hi = 0.0, 1.0
    while _log_gdp_delta(np.array([hi]), np.array([float(epsilon)]))[0] < target:
        lo, hi = hi, 2 * hi  # delta_mu(eps) grows with mu
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:
            break
        middle = 0.5 * (lo + hi)
        if _log_gdp_delta(np.array([middle]), np.array([float(epsilon)]))[0] < target:
            lo = middle
        else:
            hi = middle
    return 0.5 * (lo + hi)


def epsilon_gaussian_dp(
    false_positives: int,
    false_negatives: int,
    *,
    num_out: int,
    num_in: int,
    delta: float,
    significance: float = 0.05,
) -> float:
    """The epsilon at ``delta`` of the Gaussian DP that one threshold test rules out: ``epsilon_for_mu(mu_gaussian_dp(...), delta)``.

    Nasr et al. (2023). A lower bound on the training's epsilon only if its
    trade-off curve is Gaussian (see the module docstring): a mechanism that
    is not ``mu``-GDP may still be ``(epsilon_for_mu(mu), delta)``-DP.

    Examples:
      >>> round(epsilon_gaussian_dp(0, 0, num_out=1000, num_in=1000, delta=1e-5), 3)
      36.489

    Raises:
      ValueError: as ``mu_gaussian_dp``, or ``delta`` outside ``(0, 1)``.
    """
    delta = _probability("delta", delta, closed_low=False)
    mu = mu_gaussian_dp(false_positives, false_negatives, num_out=num_out, num_in=num_in, significance=significance)
    return epsilon_for_mu(mu, delta)


def _epsilon_from_rates(fpr: np.ndarray, fnr: np.ndarray, delta: float) -> np.ndarray:
    """``max(log((1 - delta - FNR) / FPR), log((1 - delta - FPR) / FNR), 0)`` elementwise."""
    with np.errstate(divide="ignore", invalid="ignore"):
        forward = np.log(np.maximum(1.0 - delta - fnr, 0.0)) - np.log(fpr)
        backward = np.log(np.maximum(1.0 - delta - fpr, 0.0)) - np.log(fnr)
    out = np.maximum(np.nan_to_num(forward, nan=0.0, neginf=0.0), np.nan_to_num(backward, nan=0.0, neginf=0.0))
    return np.maximum(out, 0.0)


def epsilon_clopper_pearson(
    false_positives: int,
    false_negatives: int,
    *,
    num_out: int,
    num_in: int,
    delta: float,
    significance: float = 0.05,
) -> float:
    """The epsilon one threshold test rules out against ``(epsilon, delta)``-DP itself, no Gaussian assumption.

    Under ``(epsilon, delta)``-DP every test has ``FPR + e^eps FNR >= 1 -
    delta`` and ``FNR + e^eps FPR >= 1 - delta`` (Kairouz, Oh and Viswanath
    2015); with the Clopper-Pearson upper bounds ``FPR_hi``, ``FNR_hi`` (at
    ``significance / 2`` each):

        eps_lo = max(log((1 - delta - FNR_hi) / FPR_hi), log((1 - delta - FPR_hi) / FNR_hi), 0)

    Looser than ``epsilon_gaussian_dp`` at a given test, but it assumes
    nothing about the shape of the trade-off curve.

    Examples:
      >>> round(epsilon_clopper_pearson(0, 0, num_out=1000, num_in=1000, delta=1e-5), 4)   # log((1 - d - FNR_hi) / FPR_hi)
      5.6006

    Raises:
      ValueError: as ``epsilon_gaussian_dp``.
    """
    fp, fn, n_out, n_in = _rate_counts(false_positives, false_negatives, num_out, num_in)
    alpha = check_significance(significance)
    delta = check_delta(delta)
    fpr, fnr = _rate_bounds(np.array([fp]), np.array([fn]), n_out, n_in, alpha)
    return float(_epsilon_from_rates(fpr, fnr, delta)[0])


def threshold_counts(in_scores, out_scores, thresholds) -> tuple[np.ndarray, np.ndarray]:
    """``(false_positives, false_negatives)`` of the tests "in when ``score >= tau``", one per threshold ``tau``."""
    tau = np.asarray(thresholds, np.float64)
    ins, outs = np.sort(np.asarray(in_scores, np.float64)), np.sort(np.asarray(out_scores, np.float64))
    fn = np.searchsorted(ins, tau, side="left")  # included canaries below tau: called "out"
    fp = len(outs) - np.searchsorted(outs, tau, side="left")  # left-out canaries at or above tau: called "in"
    return fp.astype(np.int64), fn.astype(np.int64)


def threshold_mus(fp: np.ndarray, fn: np.ndarray, *, num_out: int, num_in: int, significance: float) -> np.ndarray:
    """``mu_gaussian_dp`` of many tests at once: ``[k]`` lower bounds from ``[k]`` counts (each at ``significance``)."""
    alpha = check_significance(significance)
    fpr, fnr = _rate_bounds(np.asarray(fp), np.asarray(fn), int(num_out), int(num_in), alpha)
    return _mu_from_rates(fpr, fnr)
