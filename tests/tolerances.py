"""Every numerical tolerance of the test suite, in one place, with its reason.

Most are about float32 rounding: two computations of one value that agree in
exact arithmetic (an engine and the one-example-at-a-time loop, a batch and
its chunks, TensorFlow and numpy) differ in float32 by an amount set by how
many rounded operations each performs, not by the machine. The machine
decides only which of the allowed differences occurs: TensorFlow's oneDNN CPU
kernels choose summation orders and blockings by processor (and by shape), so
a tolerance tuned until it passes on one machine can fail on another. Each
float32 tolerance below is therefore derived, never tuned, from:

- ``EPS32 = 2**-23``, float32's machine epsilon. A correctly rounded
  operation errs by at most ``u = EPS32 / 2`` relative to its exact result.
- A sum (or dot product) of ``n`` terms, in any order or blocking, errs by at
  most ``gamma(n - 1) = (n - 1) u / (1 - (n - 1) u) ~ n u`` relative to
  ``sum |terms|`` (Higham, *Accuracy and Stability of Numerical Algorithms*,
  2nd ed., 2002, sections 3.1 and 4.2). Two evaluations of it differ by at
  most twice that, ``n EPS32``. For long sums this worst case is very
  pessimistic: with rounding errors modelled as independent and of mean zero,
  the error exceeds ``lambda sqrt(n) u sum |terms|`` with probability at most
  ``2 n exp(-lambda^2 / 2)`` (Higham and Mary, "A new approach to
  probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019).
  ``rounding_rtol(n)`` takes the smaller of the two bounds, with
  ``LAMBDA = 7`` (a failure probability below ``5e-11 n`` per value).
- The bound is relative to ``sum |terms|``, not to the result. Where terms
  cancel (an entry that is 0 in exact arithmetic, a mean of gradients of both
  signs, a cosine near 0) the result's relative error is unbounded, so such
  comparisons also get an absolute tolerance: the same relative tolerance
  times the magnitude of the terms (``scale`` in the helpers of
  ``tests/helpers.py``), never a bare number.

A few tolerances are about something else (statistics, half precision,
float64 libraries, printed digits); they are at the end, with their reasons,
and their values are not derived from float32 rounding. Two kinds stay next
to their tests because the test's own parameters set them: the analytic
moments of tests/test_diagnostics.py::TestLinearRegression (Z standard errors
of estimators derived there) and the adaptive clip norm of
tests/test_distribute_mirrored.py (the 1e-4 noise on the clipped count it
configures). Values that must be equal because they are the same number
(a ratio stored and recomputed by the same division) are compared with ``==``.
"""

from __future__ import annotations

import math

import numpy as np

EPS32 = 2.0**-23  # float32 machine epsilon, 1.19e-7; the unit roundoff is EPS32 / 2
EPS64 = 2.0**-52  # float64 machine epsilon, 2.2e-16
LAMBDA = 7.0  # confidence of the probabilistic bound: P(exceeded) <= 2 n exp(-LAMBDA**2 / 2) = 4.6e-11 n


def rounding_rtol(n: int, eps: float = EPS32) -> float:
    """Largest difference between two evaluations of ``n`` rounded steps, relative to ``sum |terms|``.

    ``n`` counts the rounded operations on the longest path to the value (a
    sum of ``n`` terms counts ``n``). Worst case ``n eps`` (twice
    ``gamma(n) ~ n eps / 2``), or ``LAMBDA sqrt(n) eps`` (the probabilistic
    bound, twice), whichever is smaller.
    """
    n = max(int(n), 1)
    return min(n, LAMBDA * math.sqrt(n)) * eps


# A value from at most 8 correctly rounded float32 operations on each side and
# no long sum: a scaling by clip factors, a closed form such as 2 x (x W + b),
# a conversion between PerExampleSlices and dense tables of a few rows. 8 EPS32 = 9.5e-7.
ELEMENTWISE_RTOL = rounding_rtol(8)

# Per-example gradients through the test models (tests/model_zoo.py, the
# layer-wise CASES, the diagnostics MLP), however computed: an engine against
# the one-example loop, or against itself on other batch sizes. Counted along
# the longest path from the input through the forward pass and back to a
# weight, a sum of n terms counting n: the transformer block (Q/K/V
# projections 8, attention scores 4, softmax 6, values 6, output projection 8,
# two residual LayerNormalizations 2 x 3 x 8, feed-forward 8 + 16, pooling 6,
# head 8, cross-entropy 3: about 130 forward, as many back) is the longest;
# the Gram-form Conv2D (72-term patches, a 64-input head, each way) and the
# 5-step LSTM (7-input gates, 4 gates, 5 steps, each way) come next. With
# GRADIENT_PATH = 256 and errors adding along the path (first order; these
# small models with O(1) weights and tanh/relu/softmax amplify nothing),
# 112 EPS32 = 1.3e-5 (the probabilistic bound; the worst case would be 256 EPS32).
GRADIENT_PATH = 256
GRADIENT_RTOL = rounding_rtol(GRADIENT_PATH)


def norm_rtol(p: int, entry_rtol: float = GRADIENT_RTOL) -> float:
    """Two L2 norms of ``p`` entries whose entries agree to ``entry_rtol``.

    A norm is 1-Lipschitz, so it inherits its entries' error; its sum of ``p``
    non-negative squares adds ``rounding_rtol(p)``, which the square root
    halves, and the root itself ``EPS32`` (half on each side). Absolute part
    (norms of gradients that are 0 in exact arithmetic): ``entry_rtol scale sqrt(p)``,
    the norm of ``p`` entries each off by ``entry_rtol scale``.
    """
    return entry_rtol + rounding_rtol(p) / 2 + EPS32


def weighted_sum_rtol(n: int, term_rtol: float) -> float:
    """``sum_i w_i t_i`` over ``n`` terms that agree to ``term_rtol``, relative to ``sum_i |w_i t_i|``.

    One rounded product per term (``EPS32`` for the two sides) and a sum of ``n``.
    """
    return term_rtol + EPS32 + rounding_rtol(n)


def clipped_sum_rtol(p: int, n: int) -> float:
    """``sum_i c_i g_i`` with ``c_i = C / max(||g_i||, C)``: ``n`` examples of ``p`` entries each.

    ``g_i`` agrees to ``GRADIENT_RTOL``; ``c_i`` inherits the norm's
    ``norm_rtol(p)`` and one division (``EPS32``); then a weighted sum of ``n``.
    """
    return weighted_sum_rtol(n, GRADIENT_RTOL + norm_rtol(p) + EPS32)


def sgd_steps_atol(steps: int, lr: float, update_rtol: float, update_scale, weight_scale):
    """Weights of two runs after ``steps`` SGD steps whose updates agree to ``update_rtol``.

    Each step adds ``lr update_rtol update_scale`` (``update_scale``: the
    magnitude of an update's terms; for a clipped mean of ``n`` examples over
    ``divisor`` at most ``n C / divisor``, each clipped example having norm
    ``C``) and rounds the weights once on each side (``EPS32 |w|`` for the two,
    ``weight_scale`` bounding ``|w|`` over the run). To first order the steps'
    errors add: a few steps of a stable run (``lr ||H|| < 1``) do not amplify them.
    """
    return steps * (lr * update_rtol * update_scale + EPS32 * np.asarray(weight_scale))


# ---------------------------------------------------------------------------
# Statistics of per-example gradients (per_example_grads.diagnostics): the
# library accumulates float32 per-example gradients in float64 (whose own
# rounding, rounding_rtol(n, EPS64) < 1e-12 for these sizes, is negligible),
# so two computations of a statistic differ by what their float32 gradients
# differ by, propagated to first order. ``flat`` is ``[N, P]`` gradients
# (float64), ``err`` the bound on each entry's difference (an array that
# broadcasts against ``flat``: ``GRADIENT_RTOL * scale``, or a closed form).
# ---------------------------------------------------------------------------


def mean_atol(flat: np.ndarray, err) -> np.ndarray:
    """``[P]``: the mean over examples moves by at most the mean of the entries' errors."""
    return np.broadcast_to(err, flat.shape).mean(axis=0)


def variance_atol(flat: np.ndarray, err) -> np.ndarray:
    """``[P]``: ``d var_p / d g_ip = 2 (g_ip - m_p) / (N - 1)``, so ``2 sum_i |g_ip - m_p| err_ip / (N - 1)``."""
    err = np.broadcast_to(err, flat.shape)
    return 2 * np.sum(np.abs(flat - flat.mean(axis=0)) * err, axis=0) / (len(flat) - 1)


def gsnr_atol(flat: np.ndarray, err) -> float:
    """``mean_p m_p^2 / v_p``: ``(2 |m_p| dm_p + (m_p^2 / v_p) dv_p) / v_p`` averaged over ``p``."""
    m, v = flat.mean(axis=0), flat.var(axis=0, ddof=1)
    keep = v > 0
    dm, dv = mean_atol(flat, err)[keep], variance_atol(flat, err)[keep]
    m, v = m[keep], v[keep]
    return float(np.mean((2 * np.abs(m) * dm + m**2 / v * dv) / v))


def cosine_atol(flat: np.ndarray, err, reference: np.ndarray, reference_err) -> np.ndarray:
    """``[N]``: cosines of each ``g_i`` to ``r``, ``g_i . r / (||g_i|| ||r||)``.

    Moving ``g_i`` by ``err_i`` moves the numerator by at most ``||err_i|| ||r||``
    and the norm by ``||err_i||``, so the cosine by ``2 ||err_i|| / ||g_i||``; the
    same for ``r``. (The dot products and norms themselves are float64.)
    """
    err = np.broadcast_to(err, flat.shape)
    rel_g = np.linalg.norm(err, axis=1) / np.linalg.norm(flat, axis=1)
    rel_r = np.linalg.norm(np.broadcast_to(reference_err, reference.shape)) / np.linalg.norm(reference)
    return 2 * (rel_g + rel_r)


def noise_scale_rtol(flat: np.ndarray, err, batch_size: int) -> float:
    """McCandlish's ``B_simple = sum_b w_b tr_b / sum_b w_b g2_b``, batch by batch.

    Per batch ``small = mean ||g_i||^2`` moves by at most ``2 mean_i sum_p
    |g_ip| err_ip``, ``big = ||mean g||^2`` by ``2 sum_p |m_p| mean_i err_ip``;
    ``tr_b`` and ``g2_b`` are linear in them, and the ratio's relative error is
    the sum of its two sums' relative errors. ``g2_b`` cancels (``|G|^2`` is
    small next to ``||g||^2``), which this carries through.
    """
    err = np.broadcast_to(err, flat.shape)
    tr = g2 = dtr = dg2 = 0.0
    for s in range(0, len(flat), batch_size):
        g, e = flat[s : s + batch_size], err[s : s + batch_size]
        b = len(g)
        if b < 2:
            continue
        m = g.mean(axis=0)
        small, big = np.mean(np.sum(g**2, axis=1)), np.sum(m**2)
        d_small = 2 * np.mean(np.sum(np.abs(g) * e, axis=1))
        d_big = 2 * np.sum(np.abs(m) * e.mean(axis=0))
        tr += b * (small - big) / (1 - 1 / b)
        g2 += b * (b * big - small) / (b - 1)
        dtr += b * (d_small + d_big) / (1 - 1 / b)
        dg2 += b * (b * d_big + d_small) / (b - 1)
    return dtr / abs(tr) + dg2 / abs(g2)


# ---------------------------------------------------------------------------
# Tolerances that are not about float32 rounding. Their values are set by
# what they are about and must not be "fixed" by the rules above.
# ---------------------------------------------------------------------------

# Sampling tests (diagnostics against analytic moments, Poisson batch sizes):
# estimates are allowed Z standard errors (two-sided p = 5.7e-7 under a
# normal approximation), so a correct estimator fails about once in 1.7 million runs.
Z = 5.0
# The same for every one of many estimates at once (each of 50 examples' inclusion counts): 6 standard
# errors, p = 2e-9 each, so about 1e-7 for all 50.
Z_EACH = 6.0

# Mixed precision against float32: the layers compute in float16 (10 stored
# mantissa bits, eps 2**-10 = 9.8e-4) or bfloat16 (7 bits, eps 2**-7 = 7.8e-3)
# while the per-example gradients come back float32. These are about
# half-precision rounding, not float32's, and stay as they were: about 20
# float16 and 13 bfloat16 epsilons for the short path of a two-layer model.
MIXED_FLOAT16_RTOL = 2e-2
MIXED_BFLOAT16_RTOL = 1e-1

# DP accounting (float64, in the dp-accounting library): the library's epsilon
# against dp-accounting called directly on the same event runs the same
# computation, so they agree to rounding; 1e-12 (4500 EPS64) leaves room for
# an equivalent event built another way. Where the two sides compose the
# events differently (the library segment by segment, the test as one
# composed event), the accountant's float64 sums over RDP orders or PLD
# convolutions run in other orders: 1e-9.
ACCOUNTING_SAME_RTOL = 1e-12
ACCOUNTING_COMPOSED_RTOL = 1e-9
# A float64 closed form of a few operations evaluated two ways (adaptive
# clipping's noise multiplier): 1e-15, about 4.5 EPS64.
FLOAT64_CLOSED_FORM_RTOL = 1e-15
# Loss histories of two noiseless DP runs of a few steps (one device against
# MirroredStrategy or MultiWorkerMirroredStrategy): not derived. Their weights
# agree to sgd_steps_atol, but turning that into a loss bound needs the loss
# gradient along the run, which the tests do not have; kept as it was.
TRAJECTORY_LOSS_RTOL = 1e-5
# Numbers parsed back from text printed with 6 significant digits (pegrad
# epsilon's {:.6g}): half a unit in the sixth digit is at most 5e-6 relative.
PRINTED_RTOL = 1e-5
