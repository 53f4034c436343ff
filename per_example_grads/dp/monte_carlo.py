"""Monte-Carlo accounting of a matrix mechanism under cyclic sampling with random parts.

The sampling is ``poisson_batches(cycle_length=b, sampling_probability=q)``:
every example has one part, drawn uniformly and independently of the others,
and step ``t`` samples part ``t mod b`` at rate ``q`` (``q = 1``: the whole
part, "balls in bins"). The ledger's accounting (``NoiseMechanism.dp_event``)
takes the added example's part as known, the worst part; this module also
counts on its part being random, which is where correlated noise gains from
sampling (the amplification that BLT's ledger accounting forgoes entirely).

**The dominating pair.** For ``T`` steps of a mechanism whose ``C`` is
lower-triangular Toeplitz with non-negative coefficients ``c`` (``c_0``
first), at noise multiplier ``sigma`` and clip norm 1, the releases of
add/remove neighbours are dominated by the pair on ``R^T``

    P = E_{s, x} N(C x, sigma^2 I),        Q = N(0, sigma^2 I),

``s`` uniform on ``0 .. b-1`` (the example's part) and, given ``s``,
``x_j ~ Bernoulli(q)`` independently for ``j = s mod b``, ``x_j = 0``
otherwise (Choquette-Choo, Ganesh, Haque, Steinke, Thakurta 2025, "Near
exact privacy amplification for matrix mechanisms", arXiv 2410.06266; with
``C >= 0`` the worst case is every clipped gradient of the example pointing
the same way, which is what reduces the release to ``R^T``). The privacy
loss ``L = log dP/dQ`` is

    L(y) = log mean_s E_x exp((<C x, y> - |C x|^2 / 2) / sigma^2),

computed exactly here in two cases and bounded in a third:

* ``q = 1``: ``x = 1_s``, one mode ``m_s = C 1_s`` per part, any ``C``:
  ``L = logsumexp_s((<m_s, y> - |m_s|^2 / 2) / sigma^2) - log b``;
* ``C`` with at most ``b`` coefficients (BandMF with ``bands <= b``, DP-SGD):
  two participations' columns ``C e_j`` never overlap, so given ``s`` the
  expectation factorizes, ``L_s = sum_{j = s mod b} log(1 - q + q exp((<C e_j,
  y> - |C e_j|^2 / 2) / sigma^2))``, and ``L = logsumexp_s L_s - log b``.

* ``q < 1`` with ``C`` longer than the cycle (BLT, BISR, BandMF with
  ``bands > b``): given ``s``, the loss is a sum over ``2^k`` participation
  patterns of the ``k`` turns ``j_1 < .. < j_k``, ``L_s = log E_x exp(sum_i
  x_i a_i - sum_{i<l} x_i x_l G_il)`` with ``a_i = (<C e_{j_i}, y> - |C
  e_{j_i}|^2 / 2) / sigma^2`` and ``G_il = <C e_{j_i}, C e_{j_l}> / sigma^2
  >= 0`` (``C >= 0``), which fades as turns lie further apart. The terms of
  turns at most ``w`` apart are kept exactly, by a forward pass over the
  last ``w`` turns' pattern (``2^w`` states); each term of turns further
  apart lies in ``[-x_i R_i, 0]`` with ``R_i = sum_{l > i + w} G_il``
  (``x_l <= 1``), so dropping them bounds ``L`` from above, and charging
  ``x_i R_i`` instead bounds it from below. Draws of ``P`` take the upper
  bound, draws of ``Q`` the lower: each side's estimated delta then bounds
  its own from above (``delta_P`` grows with ``L``, ``delta_Q`` falls), so
  the accounting stays an upper bound. Both bounds lie within ``slack =
  max_s sum_i R_i`` nats of ``L``; ``w`` is the least (at most
  ``_MAX_WINDOW``) that brings ``slack`` under ``_LOSS_SLACK`` nats, and
  ``MonteCarloEpsilon.loss_slack`` reports it (0 where ``L`` is exact).
  The turns of a BLT at cycle ``b`` overlap as ``theta^b``, so the bound is
  tight for cycles of tens of steps and loose for ``b = 1``.

**From samples to epsilon.** ``delta_P(eps) = E_P (1 - e^(eps - L))_+`` and
``delta_Q(eps) = E_Q (1 - e^(eps + L))_+`` are estimated by means over ``M``
draws of each; the run is ``(eps, delta)``-DP when both are at most
``delta``. A mean of ``M`` draws in ``[0, 1]`` whose expectation is at least
``tau beta`` is at most ``beta`` with probability at most ``exp(-M KL(beta ||
tau beta))`` (Chernoff-Hoeffding; Chua et al. 2024, arXiv 2412.16802, Fact
4.2). ``epsilon`` reports the least ``eps`` at which both means are at most
``beta``. The means fall as ``eps`` grows, so a reported ``eps`` below the
least one that is truly ``(eps, tau beta)``-DP needs a mean just below that
one to pass: probability at most ``2 exp(-M KL(beta || tau beta))`` over both
directions. The result folds that failure probability into its ``delta =
tau beta + 2 exp(-M KL(beta || tau beta))``, choosing ``tau`` and the largest
``beta`` that keep it at the ``delta`` asked for. It is a statement about the
random draw of the accounting, not a deterministic bound (Schuchardt and
Kalinin 2026, arXiv 2601.21636, give sampling-free bounds for this pair).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import scipy.optimize
import scipy.signal
import scipy.special

from per_example_grads._core.arguments import (
    check_delta,
    check_noise_multiplier,
    check_number,
    check_positive_int,
    check_sampling_probability,
)

_CHUNK_FLOATS = 4_000_000  # y draws per chunk x steps: 32 MB of float64
_LOSS_SLACK = 1e-2  # nats: the chain's window grows until its loss bounds are this close to L (module docstring)
_MAX_WINDOW = 6  # turns kept exactly: 64 states a draw and part


@dataclasses.dataclass(frozen=True)
class MonteCarloEpsilon:
    """A run's ``(epsilon, delta)`` by Monte-Carlo accounting (module docstring).

    Attributes:
      epsilon: the least epsilon both estimated deltas met at ``base_delta``.
      delta: the run's delta: ``tau base_delta`` plus the probability that the
        draw reported too small an epsilon.
      base_delta: ``beta``, the bound both estimates met.
      samples: ``M``, draws of each of ``P`` and ``Q``.
      seed: the draws' seed.
      loss_slack: the most, in nats, by which the losses computed may lie off
        the pair's own (0 where they are exact; a ``C`` longer than the cycle
        at ``q < 1`` is bounded, module docstring). The epsilon is an upper
        bound either way.
    """

    epsilon: float
    delta: float
    base_delta: float
    samples: int
    seed: int | None
    loss_slack: float = 0.0


def _kl(a: float, b: np.ndarray) -> np.ndarray:
    """``KL(Bernoulli(a) || Bernoulli(b))``, elementwise in ``b``."""
    return scipy.special.rel_entr(a, b) + scipy.special.rel_entr(1 - a, 1 - b)


def folded_delta(base_delta: float, samples: int, draws: int = 1) -> float:
    """``min_tau tau beta + 2 K exp(-M KL(beta || tau beta))``: the delta a Monte-Carlo epsilon at ``beta`` states.

    ``draws``: ``K``, how many independent draws of ``M`` a result may have
    been chosen from (``monte_carlo_noise_multiplier``); a union bound.
    """
    taus = np.geomspace(1.0, 1.0 / base_delta, 4000)[1:]
    folded = taus * base_delta + 2.0 * draws * np.exp(-samples * _kl(base_delta, taus * base_delta))
    return float(min(folded.min(), 1.0))


def base_delta_for(delta: float, samples: int, draws: int = 1) -> float:
    """The largest ``beta`` (on a grid of 1% steps) whose ``folded_delta`` is at most ``delta``; ValueError if none."""
    for beta in delta * np.geomspace(1.0, 1e-3, 700)[1:]:
        if folded_delta(float(beta), samples, draws) <= delta:
            return float(beta)
    raise ValueError(
        f"samples={samples} are too few to state delta={delta:g} by Monte Carlo: take at least "
        f"{samples_for(delta, draws=draws)} (or leave samples=None)."
    )


def samples_for(delta: float, base_fraction: float = 0.5, draws: int = 1) -> int:
    """The least ``M`` (within 1%) at which ``beta = base_fraction * delta`` states ``delta``."""
    beta = base_fraction * delta

    def enough(m: int) -> bool:
        return folded_delta(beta, m, draws) <= delta

    high = max(int(1.0 / delta), 16)
    while not enough(high):
        high *= 2
    low = high // 2
    while high - low > max(1, low // 100):
        mid = (low + high) // 2
        low, high = (low, mid) if enough(mid) else (mid, high)
    return high


def _checked_coefficients(coefficients: Any, steps: int, cycle: int, q: float) -> np.ndarray:
    c = np.asarray(coefficients, np.float64).reshape(-1)[:steps]
    if c.size == 0 or not np.all(np.isfinite(c)):
        raise ValueError(f"coefficients must be a non-empty finite vector (c_0 first); got {coefficients!r}.")
    if np.any(c < 0):
        raise ValueError(
            "Monte-Carlo accounting needs C >= 0 (its dominating pair takes all of an example's clipped "
            f"gradients pointing one way); these coefficients have {int(np.sum(c < 0))} negative."
        )
    c = np.trim_zeros(c, "b")
    if c.size == 0:
        raise ValueError("coefficients are all zero: C would release nothing of the gradients.")
    return c


class _Pair:
    """The dominating pair of one run, its draws and their privacy losses (module docstring)."""

    def __init__(self, c: np.ndarray, sigma: float, steps: int, cycle: int, q: float):
        self.c, self.sigma, self.steps, self.cycle, self.q = c, sigma, steps, cycle, q
        self.banded = c.size <= cycle
        self.chained = q < 1.0 and not self.banded
        self.turns = -(-steps // cycle)
        self.column_norms = _tail_norms(c, steps, steps)  # |C e_j|^2: column j of C, cut at the last step
        self.slack = 0.0  # nats between the computed loss and L (module docstring)
        self.floats_per_draw = steps
        if q == 1.0:  # one mode per part (the draws of P; the loss too where C is longer than the cycle)
            first = np.zeros(steps)
            first[::cycle] = 1.0
            # m_0 = C 1_0, the mean under P of an example of part 0 that joins every turn; m_s is m_0 shifted by s.
            first_mode = scipy.signal.fftconvolve(first, c)[:steps] if c.size > 1 else c[0] * first
            self.mode_norms = _tail_norms(first_mode, cycle, steps)  # |m_s|^2
            self.modes = np.zeros((steps, cycle))  # m_s in column s (zero for a part whose turn comes after the end)
            for part in range(min(cycle, steps)):
                self.modes[part:, part] = first_mode[: steps - part]
        if self.chained:
            near, beyond = _overlaps(c, steps, cycle, _MAX_WINDOW)
            near, beyond = near / sigma**2, beyond / sigma**2
            for window in range(_MAX_WINDOW + 1):  # the least window whose bounds lie within _LOSS_SLACK of L
                far = beyond + near[window:].sum(0)  # R at each step: its overlaps with turns beyond the window
                self.slack = float(self._per_part(far).max())
                if self.slack <= _LOSS_SLACK:
                    break
            self.window, self.near, self.far = window, near[:window], far
            self.floats_per_draw = max(steps, 2 * 2**window * cycle)

    def _by_turn(self, per_step: np.ndarray, fill: float = 0.0) -> np.ndarray:
        """``[turns, cycle, ...]``: ``per_step`` (``[steps, ...]``), ``fill`` past the last step."""
        padded = np.full((self.turns * self.cycle, *per_step.shape[1:]), fill)
        padded[: self.steps] = per_step
        return padded.reshape(self.turns, self.cycle, *per_step.shape[1:])

    def _per_part(self, per_step: np.ndarray) -> np.ndarray:
        """``[cycle, ...]``: ``per_step`` (``[steps, ...]``) summed over each part's turns."""
        return self._by_turn(per_step).sum(0)

    def draw(self, rng: np.random.Generator, m: int, positive: bool) -> np.ndarray:
        """``[steps, m]`` draws of ``P`` (``positive``) or ``Q``."""
        y = rng.standard_normal((self.steps, m)) * self.sigma
        if not positive:
            return y
        shifts = rng.integers(self.cycle, size=m)
        if self.q == 1.0:
            return y + self.modes[:, shifts]
        turns = (np.arange(self.steps)[:, None] % self.cycle == shifts[None]) & (rng.random((self.steps, m)) < self.q)
        x = turns.astype(np.float64)
        if self.chained:  # C x by FFT: rounding of order 1e-16 |C x|
            return y + scipy.signal.fftconvolve(x, self.c[:, None], axes=0)[: self.steps]
        mean = self.c[0] * x
        for k in range(1, min(self.c.size, self.steps)):  # C x: c_k on the k-th subdiagonal (a short C)
            mean[k:] += self.c[k] * x[:-k]
        return y + mean

    def loss(self, y: np.ndarray, upper: bool = True) -> np.ndarray:
        """``[m]`` privacy losses ``log dP/dQ`` of the columns of ``y``; for a chained pair, its upper or lower bound."""
        s2 = self.sigma**2
        if self.q == 1.0 and not self.banded:
            llr = (self.modes.T @ y - 0.5 * self.mode_norms[:, None]) / s2
            return scipy.special.logsumexp(llr, axis=0) - math.log(self.cycle)
        joined = (_correlation(y, self.c) - 0.5 * self.column_norms[:, None]) / s2
        if self.chained:
            per_part = self._chain(joined if upper else joined - self.far[:, None])
        else:
            per_turn = joined if self.q == 1.0 else np.logaddexp(math.log1p(-self.q), math.log(self.q) + joined)
            per_part = self._per_part(per_turn)
        return scipy.special.logsumexp(per_part, axis=0) - math.log(self.cycle)

    def _chain(self, joined: np.ndarray) -> np.ndarray:
        """``[cycle, m]``: ``L_s`` with the terms of turns at most ``window`` apart exact (module docstring).

        A forward pass over turns in the linear domain: ``alpha[S, s, :]`` is
        the mass of the patterns so far whose last ``window`` turns are the
        bits of ``S`` (bit 0 the latest), over ``exp(scale[s, :])``.
        """
        b, w, m, q = self.cycle, self.window, joined.shape[1], self.q
        padded = self._by_turn(joined, -np.inf)  # a turn past the last step never joins
        stays = self._by_turn(np.full(self.steps, 1.0 - q), 1.0)
        states = 2**w
        bits = (np.arange(states)[:, None] >> np.arange(w)[None]) & 1  # [states, w]: bit d-1 is the turn d back
        alpha = np.zeros((states, b, m))
        alpha[0] = 1.0
        scale = np.zeros((b, m))
        for turn in range(self.turns):
            a = padded[turn]
            shift = np.maximum(a, 0.0)
            join = q * np.exp(a - shift)  # [b, m]
            stay = stays[turn][:, None] * np.exp(-shift)
            if w == 0:
                alpha = alpha * (stay + join)
            else:
                # overlaps[d - 1, s]: G between this turn of part s and its turn d back (none before the first).
                overlaps = np.zeros((w, b))
                for d in range(1, min(w, turn) + 1):
                    overlaps[d - 1] = self.near[d - 1, (turn - d) * b : (turn - d + 1) * b]
                kept = np.exp(-(bits @ overlaps))  # [states, b]: exp(-sum of G to the turns this state joined)
                old = alpha.reshape(2, states // 2, b, m)  # [oldest bit, the others, b, m]
                joined_mass = (old * kept.reshape(2, states // 2, b)[..., None]).sum(0) * join
                alpha = np.stack([(old[0] + old[1]) * stay, joined_mass], axis=1).reshape(states, b, m)
            norm = alpha.max(0)
            if not np.all(norm > 0):
                raise ValueError(
                    f"noise_multiplier={self.sigma:g} is too small for Monte-Carlo accounting of a C longer than "
                    "the cycle at sampling_probability < 1: the privacy loss underflows float64."
                )
            alpha = alpha / norm
            scale += shift + np.log(norm)
        return np.log(alpha.sum(0)) + scale


def _overlaps(c: np.ndarray, steps: int, cycle: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """``([window, steps], [steps])``: ``<C e_t, C e_{t + k cycle}>`` (cut at the last step) for ``k = 1 .. window``, and its sum over ``k > window``."""
    near, beyond = np.zeros((window, steps)), np.zeros(steps)
    t = np.arange(steps)
    for k in range(1, -(-steps // cycle)):
        lag = k * cycle
        if lag >= c.size:  # columns this far apart no longer overlap
            break
        sums = np.concatenate([[0.0], np.cumsum(c[lag:] * c[: c.size - lag])])
        overlap = sums[np.clip(steps - t - lag, 0, c.size - lag)]
        if k <= window:
            near[k - 1] = overlap
        else:
            beyond += overlap
    return near, beyond


def _tail_norms(kernel: np.ndarray, lags: int, steps: int) -> np.ndarray:
    """``[lags]``: ``|kernel shifted by s, cut at steps|^2`` for ``s = 0 .. lags-1`` (0 from ``s = steps`` on)."""
    squares = np.concatenate([[0.0], np.cumsum(kernel**2)])
    return squares[np.clip(steps - np.arange(lags), 0, kernel.size)]


def _correlation(y: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """``[steps, m]``: row ``j`` is ``<kernel shifted by j, y>``, cut at the last step."""
    if kernel.size > 32:  # by FFT: rounding of order 1e-16 |kernel| |y|
        return scipy.signal.fftconvolve(y, kernel[::-1, None], axes=0)[kernel.size - 1 : kernel.size - 1 + y.shape[0]]
    out = kernel[0] * y
    for k in range(1, min(kernel.size, y.shape[0])):
        out[:-k] += kernel[k] * y[k:]
    return out


def _checked_pair(
    coefficients: Any, noise_multiplier: float, steps: int, cycle_length: int, sampling_probability: float
) -> _Pair:
    """The dominating pair of a run, its arguments checked."""
    sigma = check_noise_multiplier(noise_multiplier)
    if sigma <= 0:
        raise ValueError("noise_multiplier must be > 0 for Monte-Carlo accounting.")
    steps = check_positive_int("steps", steps)
    cycle = check_positive_int("cycle_length", cycle_length)
    q = check_sampling_probability(sampling_probability)
    return _Pair(_checked_coefficients(coefficients, steps, cycle, q), sigma, steps, cycle, q)


def _losses(pair: _Pair, samples: int, positive: bool, seed: int | None, progress: bool) -> np.ndarray:
    """``privacy_losses`` of ``pair``: ``samples`` draws, in chunks of about ``_CHUNK_FLOATS`` floats."""
    rng = np.random.default_rng(seed)
    chunk = max(1, _CHUNK_FLOATS // pair.floats_per_draw)
    starts = range(0, samples, chunk)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="Monte-Carlo accounting", unit="chunk")
    out = np.empty(samples)
    for start in starts:
        m = min(chunk, samples - start)
        loss = pair.loss(pair.draw(rng, m, positive), upper=positive)  # each side's delta bounded from above
        out[start : start + m] = loss if positive else -loss
    return out


def privacy_losses(
    coefficients: Any,
    noise_multiplier: float,
    steps: int,
    *,
    cycle_length: int = 1,
    sampling_probability: float = 1.0,
    samples: int,
    positive: bool = True,
    seed: int | None = None,
    progress: bool = False,
) -> np.ndarray:
    """``float64 [samples]`` privacy losses of draws from the dominating pair (module docstring).

    ``positive``: ``L(y)`` for ``y ~ P`` (the example added); else ``-L(y)``
    for ``y ~ Q`` (the loss of ``Q`` against ``P``). Both have
    ``delta(eps) = mean((1 - e^(eps - loss))_+)``.
    """
    pair = _checked_pair(coefficients, noise_multiplier, steps, cycle_length, sampling_probability)
    return _losses(pair, check_positive_int("samples", samples), positive, seed, progress)


def _delta_estimate(losses: np.ndarray, epsilon: float) -> float:
    return float(np.mean(-np.expm1(np.minimum(epsilon - losses, 0.0))))


def epsilon_from_losses(positive: np.ndarray, negative: np.ndarray, base_delta: float) -> float:
    """The least ``eps >= 0`` (to 1e-6) at which both losses' estimated deltas are at most ``base_delta``."""

    def worst(eps: float) -> float:
        return max(_delta_estimate(positive, eps), _delta_estimate(negative, eps))

    if worst(0.0) <= base_delta:
        return 0.0
    low, high = 0.0, max(float(np.max(positive)), float(np.max(negative)), 1e-6)
    while high - low > 1e-6 * max(1.0, high):
        mid = 0.5 * (low + high)
        low, high = (low, mid) if worst(mid) <= base_delta else (mid, high)
    return high


def _coefficients_and_cycle(mechanism: Any, steps: int, cycle_length: int | None) -> tuple[Any, int]:
    """``(coefficients, cycle_length)`` of a ``NoiseMechanism`` (its own cycle) or of explicit coefficients."""
    if not hasattr(mechanism, "cycle_length"):
        return mechanism, 1 if cycle_length is None else cycle_length
    if cycle_length is not None and cycle_length != mechanism.cycle_length:
        raise ValueError(
            f"cycle_length={cycle_length} but the mechanism {mechanism.name!r} is built for cycle_length="
            f"{mechanism.cycle_length}: leave cycle_length out (the mechanism's is used)."
        )
    try:
        c = mechanism._coefficients_for(steps)
    except NotImplementedError:
        raise ValueError(
            f"the mechanism {mechanism.name!r} ({type(mechanism).__name__}) states no Toeplitz coefficients "
            "(NoiseMechanism.coefficients), so it cannot be accounted by Monte Carlo."
        ) from None
    return c, mechanism.cycle_length


def monte_carlo_epsilon(
    mechanism: Any,
    noise_multiplier: float,
    steps: int,
    *,
    delta: float,
    sampling_probability: float = 1.0,
    cycle_length: int | None = None,
    samples: int | None = None,
    seed: int | None = None,
    progress: bool = False,
) -> MonteCarloEpsilon:
    """Epsilon at ``delta`` of ``steps`` steps of a matrix mechanism under cyclic sampling with random parts.

    Args:
      mechanism: a ``NoiseMechanism`` (``GaussianNoise``, ``BandMF``,
        ``BLT``, ``BISR``: its ``C`` and its ``cycle_length``), or ``C``'s
        Toeplitz coefficients, ``c_0`` first (``[1.0]``: DP-SGD). ``C >= 0``.
      noise_multiplier: ``sigma`` (per clip norm).
      steps: ``T``.
      delta: the run's delta, Monte-Carlo failure included (module docstring).
      sampling_probability: ``q`` of ``poisson_batches``. Below 1, a ``C``
        longer than ``cycle_length`` (BLT, BISR) has its loss bounded, within
        the result's ``loss_slack`` (module docstring).
      cycle_length: ``b`` of ``poisson_batches``, for explicit coefficients
        (default 1); a mechanism's own otherwise.
      samples: ``M`` draws of each of ``P`` and ``Q``; by default the least at
        which ``base_delta = delta / 2`` states ``delta`` (``samples_for``:
        6,300 at ``delta = 1e-2``, 80,000 at ``1e-3``, 11.3 million at
        ``1e-5``). Time grows as ``M T``, ``M T b`` for ``C`` longer than
        ``b`` at ``q = 1``, ``M T 2^w`` at ``q < 1``: per 100,000 draws of
        1,000 steps on 2 CPU cores, about 5 s at ``q = 1``, 20 s for a
        banded ``C`` at ``q < 1``, 30-130 s for BLT(2) at ``q < 1`` (``w``
        up to 6).
      seed: of the draws (None: fresh entropy).
      progress: a tqdm bar over the draws.

    Example (DP-SGD at ``q = 0.1``; dp_accounting's PLD gives 1.57 at
    ``base_delta``, 1.32 at ``delta``):

      >>> r = monte_carlo_epsilon([1.0], 1.0, 20, delta=1e-2, sampling_probability=0.1, seed=0)
      >>> round(r.epsilon, 2), r.samples, round(r.base_delta, 5)
      (1.61, 6300, 0.00496)
    """
    delta = check_delta(delta)
    steps = check_positive_int("steps", steps)
    coefficients, cycle = _coefficients_and_cycle(mechanism, steps, cycle_length)
    samples = samples_for(delta) if samples is None else check_positive_int("samples", samples)
    beta = base_delta_for(delta, samples)
    pair = _checked_pair(coefficients, noise_multiplier, steps, cycle, sampling_probability)
    return _estimate(pair, samples, beta, 1, seed, progress)


def _seeds(seed: int | None, n: int) -> list[int]:
    return [int(s.generate_state(1)[0]) for s in np.random.SeedSequence(seed).spawn(n)]


def _estimate(
    pair: _Pair, samples: int, beta: float, draws: int, seed: int | None, progress: bool
) -> MonteCarloEpsilon:
    """One draw of ``samples`` of each side, and the epsilon it states at ``beta`` (one of ``draws`` draws)."""
    seed_p, seed_q = _seeds(seed, 2)
    positive = _losses(pair, samples, True, seed_p, progress)
    negative = _losses(pair, samples, False, seed_q, progress)
    return MonteCarloEpsilon(
        epsilon=epsilon_from_losses(positive, negative, beta),
        delta=folded_delta(beta, samples, draws),
        base_delta=beta,
        samples=samples,
        seed=seed,
        loss_slack=pair.slack,
    )


_CERTIFICATIONS = 3  # full draws monte_carlo_noise_multiplier may make; their union bound is in each result's delta


@dataclasses.dataclass(frozen=True)
class MonteCarloNoise:
    """A noise multiplier calibrated by Monte Carlo (``monte_carlo_noise_multiplier``).

    Attributes:
      noise_multiplier: ``sigma``.
      certificate: the full draw at ``sigma`` whose epsilon is at most the
        target; its ``delta`` holds over every draw the search could make.
      pilot_noise_multiplier: the first ``sigma`` certified: where the
        pilot's estimate met the target, times ``1 + rtol``.
      certifications: full draws made (the last one passed).
    """

    noise_multiplier: float
    certificate: MonteCarloEpsilon
    pilot_noise_multiplier: float
    certifications: int


def monte_carlo_noise_multiplier(
    mechanism: Any,
    target_epsilon: float,
    steps: int,
    *,
    delta: float,
    sampling_probability: float = 1.0,
    cycle_length: int | None = None,
    samples: int | None = None,
    seed: int | None = None,
    rtol: float = 0.01,
    progress: bool = False,
) -> MonteCarloNoise:
    """The noise multiplier whose Monte-Carlo epsilon at ``delta`` is at most ``target_epsilon``.

    Arguments as ``monte_carlo_epsilon``'s. Search and certification use
    independent draws:

    1. **Pilot.** On one fixed draw of ``samples // 4`` (so that the estimate
       is a continuous function of ``sigma``), Brent's method finds the
       ``sigma`` at which the estimated epsilon at ``base_delta`` is the
       target, to ``rtol`` (relative).
    2. **Certificate.** A fresh full draw at ``sigma (1 + rtol)``. If its
       epsilon is above the target, ``sigma`` grows by the ratio's power
       ``1 / slope`` (epsilon ~ ``sigma^-slope`` in the pilot) and ``1 +
       rtol``, and a fresh draw is made, at most 3 draws in all (ValueError
       after: take more ``samples``).

    Each draw is independent of the ``sigma`` it tests (that depends on the
    pilot and on earlier draws only), so the returned ``(epsilon, delta)``
    fails with probability at most the sum over the draws made: its
    ``base_delta`` is chosen for 3 draws (``folded_delta(..., draws=3)``),
    which costs a few percent more samples than one (``samples_for``'s
    default here is for 3). Cost: the pilot's 8-12 trials of ``M / 4``,
    then one full draw per certificate: 3-5 full draws in all.

    Example (DP-SGD at ``q = 0.1``, where dp_accounting's PLD gives ``sigma
    = 0.89`` for epsilon 2 at this ``base_delta``, 0.0050; the first
    certificate failed here):

      >>> r = monte_carlo_noise_multiplier([1.0], 2.0, 20, delta=1e-2, sampling_probability=0.1, seed=0)
      >>> round(r.noise_multiplier, 2), round(r.certificate.epsilon, 2), r.certifications
      (0.91, 1.91, 2)
    """
    delta = check_delta(delta)
    steps = check_positive_int("steps", steps)
    target_epsilon = check_number("target_epsilon", target_epsilon)
    if not check_number("rtol", rtol) < 0.5:
        raise ValueError(f"rtol must be in (0, 0.5), got {rtol!r}.")
    coefficients, cycle = _coefficients_and_cycle(mechanism, steps, cycle_length)
    draws = _CERTIFICATIONS
    samples = samples_for(delta, draws=draws) if samples is None else check_positive_int("samples", samples)
    beta = base_delta_for(delta, samples, draws)
    pilot_seed, *certificate_seeds = _seeds(seed, 1 + draws)
    pilot = max(samples // 4, 1)

    def pilot_excess(log_sigma: float) -> float:
        pair = _checked_pair(coefficients, math.exp(log_sigma), steps, cycle, sampling_probability)
        return _estimate(pair, pilot, beta, 1, pilot_seed, False).epsilon - target_epsilon

    step = math.log(2.0)  # bracket the target in log sigma by doubling or halving from sigma = 1
    low = high = 0.0
    if pilot_excess(0.0) > 0:
        while pilot_excess(high := high + step) > 0:
            if high > math.log(1e9):
                raise ValueError(f"target_epsilon={target_epsilon:g} is not met at noise_multiplier 1e9.")
        low = high - step
    else:
        while pilot_excess(low := low - step) <= 0:
            if low < math.log(1e-3):
                raise ValueError(f"target_epsilon={target_epsilon:g} is met at every noise_multiplier >= 1e-3.")
        high = low + step
    log_pilot = scipy.optimize.brentq(pilot_excess, low, high, xtol=rtol / 4)
    # epsilon ~ sigma^-slope near the target, from the pilot: how far a failed certificate moves sigma.
    above = target_epsilon + pilot_excess(log_pilot + math.log(1.1))
    slope = math.log(target_epsilon / above) / math.log(1.1) if 0 < above < target_epsilon else 1.0
    pilot_sigma = sigma = math.exp(log_pilot) * (1 + rtol)
    for made, certificate_seed in enumerate(certificate_seeds, 1):
        pair = _checked_pair(coefficients, sigma, steps, cycle, sampling_probability)
        certificate = _estimate(pair, samples, beta, draws, certificate_seed, progress)
        if certificate.epsilon <= target_epsilon:
            return MonteCarloNoise(sigma, certificate, pilot_sigma, made)
        sigma *= (1 + rtol) * (certificate.epsilon / target_epsilon) ** (1 / slope)
    raise ValueError(
        f"{draws} full draws of samples={samples} did not certify target_epsilon={target_epsilon:g} near the "
        f"pilot's noise_multiplier {pilot_sigma:.4g}: take more samples (the pilot uses samples // 4)."
    )
