"""What a PLD accountant would allocate for an event, estimated before it is built.

``dp_accounting``'s PLD accountant discretizes each Gaussian mechanism's
privacy loss on a grid of step ``interval`` (``1e-4`` by default), truncating
tails of mass below ``e^-50``: for noise multiplier ``sigma`` the loss spans
about ``2 sqrt(2 * 50) / sigma`` (Poisson subsampling only narrows it), so one
step's probability mass function has about

    L_1 = 20 / (sigma * interval)

entries. ``T`` self-compositions are one FFT over the window that
``dp_accounting`` keeps (a Chernoff bound at tail mass ``1e-15``). For a loss
of standard deviation ``s`` per step that window is about ``2 k sqrt(T) s``
wide, ``k = sqrt(2 ln(2 / 1e-15)) ~ 8.4``, and never more than ``T L_1``:

    L_T = SAFETY * min(T L_1, 2 k sqrt(T) s / interval + L_1)

``s`` is computed by quadrature of the Poisson-subsampled Gaussian's privacy
loss (both directions, the larger kept). ``SAFETY`` covers the skew of that
loss, which a Gaussian tail underestimates. The FFT holds a few complex
arrays of ``L_T / SAFETY`` entries or so.

The accounting module asks this before every PLD computation. Past
``MAX_PLD_POINTS`` it uses the RDP accountant instead, whose epsilon is never
below PLD's (a valid, looser upper bound), and warns. This module imports no
TensorFlow.
"""

from __future__ import annotations

import functools
import math

import dp_accounting
import numpy as np

MAX_PLD_POINTS = 2**24  # with SAFETY, the FFT's arrays stay below about 1 GB
SAFETY = 2.5
_WINDOW = 2 * math.sqrt(2 * math.log(2 / 1e-15))  # two Chernoff half-widths at dp_accounting's tail mass


def pld_points(event: dp_accounting.DpEvent, interval: float = 1e-4) -> float:
    """The estimated grid (entries) the PLD accountant builds for ``event``; ``inf`` if unknown.

    Handles the events the accounting module builds (compositions of
    self-composed, possibly Poisson-sampled, Gaussian mechanisms); any other
    event counts as unbounded, so the caller takes the RDP path.
    """
    if isinstance(event, dp_accounting.NoOpDpEvent):
        return 0.0
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return sum((pld_points(e, interval) for e in event.events), 0.0)
    count, inner = 1, event
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        count, inner = event.count, event.event
    q = 1.0
    if isinstance(inner, dp_accounting.PoissonSampledDpEvent):
        q, inner = inner.sampling_probability, inner.event
    if not isinstance(inner, dp_accounting.GaussianDpEvent):
        return math.inf
    sigma = inner.noise_multiplier
    if sigma == 0 or q == 0 or count == 0:
        return 0.0  # no grid: dp_accounting answers inf (or 0) at once
    single = 20.0 / (sigma * interval)
    window = _WINDOW * math.sqrt(count) * privacy_loss_std(sigma, q) / interval + single
    return SAFETY * min(count * single, window)


@functools.lru_cache(maxsize=256)
def privacy_loss_std(sigma: float, q: float) -> float:
    """The standard deviation of one step's privacy loss, the larger of its remove and add directions.

    With ``N_0 = N(0, sigma^2)``, ``N_1 = N(1, sigma^2)`` and the mixture
    ``M = (1 - q) N_0 + q N_1``: the loss ``log(M / N_0)`` under ``M``
    (removing an example) and ``log(N_0 / M)`` under ``N_0`` (adding one),
    integrated on a grid of 20,001 points over ``[-14 sigma, 1 + 14 sigma]``.
    """
    x = np.linspace(-14 * sigma, 1 + 14 * sigma, 20_001)
    log_ratio = (2 * x - 1) / (2 * sigma**2)  # log N_1(x) / N_0(x)
    log_stay = math.log1p(-q) if q < 1 else -np.inf
    loss = np.logaddexp(log_stay, math.log(q) + log_ratio)  # log M(x) / N_0(x)
    log_n0 = -(x**2) / (2 * sigma**2)
    stds = []
    for log_density in (log_n0 + loss, log_n0):  # M, then N_0 (the add direction's loss is -loss)
        w = np.exp(log_density - log_density.max())
        w /= w.sum()
        mean = float(np.dot(w, loss))
        stds.append(math.sqrt(max(float(np.dot(w, (loss - mean) ** 2)), 0.0)))
    return max(stds)
