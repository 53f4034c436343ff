"""The PLD accountant's memory and time, estimated before it runs (``per_example_grads.dp.accounting``'s bounds).

For releases ``(sigma, q, T)`` (each ``T`` Poisson-sampled Gaussian steps
at noise multiplier ``sigma`` and rate ``q``, composed in order),
``estimate`` follows what ``dp_accounting``'s ``PLDAccountant`` would
build, in the order it builds it:

* each step's probability mass functions (remove and add directions): the
  points of its grid are ``dp_accounting``'s connect-the-dots epsilon bounds
  of the Poisson-subsampled Gaussian at ``(q, sigma)`` divided by the grid's
  step (``1e-4``), read from ``dp_accounting`` without building anything;
* if those are affordable, the ``T``-fold self-composition: the window that
  ``dp_accounting``'s Chernoff bound keeps at tail mass ``1e-15`` (computed
  by ``dp_accounting`` on the very single-step distribution, built for it),
  and the FFT of that length; a grid of at most 1000 points first takes the
  big-integer power ``points ** T``, whose cost grows with ``T``;
* the composition with the earlier releases, and the epsilon search.

Memory and seconds per point are calibrated against ``dp_accounting``'s
peak resident memory and running time, rounded up. ``PLD_MAX_BYTES`` and
``PLD_MAX_SECONDS`` are the bounds past which the accounting module does
not run it (its "Bounded cost").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Iterable

import dp_accounting
import scipy.fft
from dp_accounting import pld

from per_example_grads._core.quiet import quiet_accounting

PLD_MAX_BYTES = 2**30  # estimated peak memory of one PLD epsilon
PLD_MAX_SECONDS = 20.0  # estimated time of one PLD epsilon

# Calibration of the estimate: peak resident memory and wall time of
# dp_accounting's PLDAccountant, per point of the arrays it builds, rounded up.
_BUILD_BYTES = 100.0  # per point of a single-step PMF being built (Python lists and dicts)
_BUILD_SECONDS = 6e-6  # per point of a single-step PMF (a scalar inverse privacy loss each)
_FFT_BYTES = 80.0  # per point of the longest FFT (complex input, its power, the inverse)
_OTHER_BYTES = 48.0  # per point of every other FFT held at the same time
_SUPPORT_SECONDS = 7e-7  # per point of every composed PMF (FFT, Python-level tail and epsilon scans)
_SPARSE_SECONDS = 1e-5  # per iteration of a one-point PMF's self-composition loop
_BIGNUM_SECONDS, _BIGNUM_BITS = 2.0, 9e6  # CPython's size ** T, for a T log2(size)-bit result

_SPARSE_MAX = 1000  # dp_accounting keeps a PMF of at most this many points as a dict (SparsePLDPmf)
_TAIL_MASS = 1e-15  # dp_accounting's tail_mass_truncation when it self-composes
_ADJACENCIES = (
    pld.privacy_loss_mechanism.AdjacencyType.REMOVE,
    pld.privacy_loss_mechanism.AdjacencyType.ADD,
)


@dataclasses.dataclass(frozen=True)
class Cost:
    """Estimated peak memory (bytes) and time (seconds) of one PLD epsilon.

    ``seconds`` includes ``estimate_seconds``, the estimate's own part (it
    builds the single-step PMFs too).
    """

    bytes: float
    seconds: float
    estimate_seconds: float = 0.0

    def fits(self) -> bool:
        return self.bytes <= PLD_MAX_BYTES and self.seconds <= PLD_MAX_SECONDS

    def __str__(self) -> str:
        return f"about {format_bytes(self.bytes)} and {format_seconds(self.seconds)}"


def bounds() -> str:
    """``"1 GiB / 20 s"``: the bounds, for messages."""
    return f"{format_bytes(PLD_MAX_BYTES)} / {format_seconds(PLD_MAX_SECONDS)}"


def estimate(releases: Iterable[tuple[float, float, int]], interval: float) -> Cost:
    """What ``PLDAccountant(value_discretization_interval=interval)`` would need for ``releases``.

    Follows what ``dp_accounting`` builds for each release ``(sigma, q, T)``:

    * one PMF per direction (remove, add; one for ``q = 1``, whose ``T``
      releases are one Gaussian of noise ``sigma / sqrt(T)``), on the grid of
      its connect-the-dots epsilon bounds divided by ``interval``: ``L``
      points, counted from the bounds alone (nothing is built if those
      points already cost too much);
    * its ``T``-fold self-composition: ``n`` points, the window that
      ``dp_accounting.pld.common.compute_self_convolve_bounds`` keeps on that
      very PMF (which this function builds, once per ``(sigma, q,
      interval)``), computed through an FFT of ``next_fast_len(max(n, L))``;
      a PMF of at most ``_SPARSE_MAX`` points first raises ``L ** T`` as a
      Python integer, whose cost grows with ``T log L``;
    * the composition with the releases before it, of at most the sum of
      their points, and the epsilon search over the result.

    ``seconds`` counts the single-step PMFs that this function builds twice.
    Either figure may be ``inf``.
    """
    grid = []  # sizes of the single-step PMFs the accountant builds
    estimated = 0  # points of those that this estimate builds too
    ffts = []  # lengths of the FFTs: self-compositions, then compositions with earlier segments
    chains = {adjacency: 0 for adjacency in _ADJACENCIES}  # points of the composition so far, per direction
    support, extra = 0, 0.0  # points of every composed PMF; seconds of the sparse paths

    def total() -> Cost:
        longest = max(ffts, default=0)
        return Cost(
            bytes=_BUILD_BYTES * max(grid, default=0) + _FFT_BYTES * longest + _OTHER_BYTES * (sum(ffts) - longest),
            seconds=_BUILD_SECONDS * (sum(grid) + estimated) + _SUPPORT_SECONDS * support + extra,
            estimate_seconds=_BUILD_SECONDS * estimated,
        )

    for sigma, q, count in releases:
        if sigma == 0 or count == 0:
            continue  # no grid: dp_accounting answers inf, or skips it
        if q == 1:  # one symmetric PMF, for both directions
            sigma, count = sigma / math.sqrt(count), 1
            sizes = [_grid_size(sigma, q, _ADJACENCIES[0], interval)] * 2
            grid.append(sizes[0])
        else:
            sizes = [_grid_size(sigma, q, adjacency, interval) for adjacency in _ADJACENCIES]
            grid += sizes
            estimated += sum(sizes) if count > 1 else 0
        if not total().fits():
            return total()  # before building anything
        pmfs = _single_step_probabilities(sigma, q, interval) if count > 1 else (None, None)
        for adjacency, size, probabilities in zip(_ADJACENCIES, sizes, pmfs):
            points, fft, seconds = _self_composition(size, probabilities, count)
            extra += seconds
            support += points
            ffts.append(fft)
            if chains[adjacency]:  # composed with the earlier releases (the first one, with the identity)
                support += chains[adjacency] + points
                ffts.append(chains[adjacency] + points)
            chains[adjacency] += points
    return total()


def _grid_size(sigma: float, q: float, adjacency: Any, interval: float) -> float:
    """Points of ``dp_accounting``'s connect-the-dots PMF of one sampled Gaussian step; ``inf`` if unbounded."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # sigma so small that the loss overflows
        loss = pld.privacy_loss_mechanism.GaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=adjacency)
        bounds = loss.connect_dots_bounds()
    upper, lower = bounds.epsilon_upper / interval, bounds.epsilon_lower / interval
    if not (math.isfinite(upper) and math.isfinite(lower)):
        return math.inf
    return math.ceil(upper) - math.floor(lower) + 1


@functools.lru_cache(maxsize=8)  # each a few MB: the steps of a run's few segments
def step_distribution(key: tuple, interval: float, relation) -> Any:
    """The PLD ``PLDAccountant._maybe_compose`` builds for one step, built once for this estimate and the accountant.

    ``key``: ``("poisson", sigma, q)``, ``("truncated", N, q, B, sigma)`` or
    ``("mixture", sigma, sensitivities, probabilities)`` (``accounting._step_key``).
    """
    build = pld.privacy_loss_distribution
    kind, *params = key
    with quiet_accounting():
        if kind == "poisson":
            sigma, q = params
            return build.from_gaussian_mechanism(
                standard_deviation=sigma,
                value_discretization_interval=interval,
                sampling_prob=q,
                neighboring_relation=relation,
            )
        if kind == "truncated":
            n, q, b, sigma = params
            return build.from_truncated_subsampled_gaussian_mechanism(
                dataset_size=n,
                sampling_probability=q,
                truncated_batch_size=b,
                noise_multiplier=sigma,
                value_discretization_interval=interval,
                neighboring_relation=relation,
            )
        std, sensitivities, probabilities = params
        return build.from_mixture_gaussian_mechanism(
            standard_deviation=std,
            sensitivities=list(sensitivities),
            sampling_probs=list(probabilities),
            value_discretization_interval=interval,
        )


@functools.lru_cache(maxsize=2)  # a ledger's next epsilon, one step later, reuses it
def _single_step_probabilities(sigma: float, q: float, interval: float) -> tuple[Any, ...]:
    """The remove and add PMFs' probabilities that ``PLDAccountant`` builds for one sampled Gaussian step.

    ``(None, None)`` if ``dp_accounting``'s private layout differs from the one
    read here; ``_self_composition`` then takes its worst case.
    """
    distribution = step_distribution(
        ("poisson", float(sigma), float(q)), interval, dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    try:
        pmfs = (distribution._pmf_remove, distribution._pmf_add)  # pylint: disable=protected-access
        return tuple(pmf.to_dense_pmf()._probs for pmf in pmfs)  # pylint: disable=protected-access
    except AttributeError:
        return (None, None)


def _self_composition(size: float, probabilities: Any, count: int) -> tuple[float, float, float]:
    """``(points kept, FFT length, seconds outside the FFT)`` of ``dp_accounting``'s ``count``-fold self-composition.

    Of a PMF of ``size`` points and ``probabilities`` (``None`` where
    ``count == 1`` or unknown: then the window is its widest).
    """
    if count == 1:
        return size, (size if size > _SPARSE_MAX else 0), 0.0
    seconds = 0.0
    if size <= _SPARSE_MAX:
        if size == 1:
            return 1, 0, _SPARSE_SECONDS * count  # one composition per step
        bits = count * math.log2(size)
        if bits <= math.log2(_SPARSE_MAX):
            return size**count, 0, 0.0  # a few dict compositions
        seconds = _BIGNUM_SECONDS * (bits / _BIGNUM_BITS) ** 1.585  # size ** count, by Karatsuba squaring
    if probabilities is None:
        points = (size - 1) * count + 1  # compute_self_convolve_bounds's starting window
    else:
        low, high = pld.common.compute_self_convolve_bounds(probabilities, count, _TAIL_MASS)
        points = high - low + 1
    longest = max(points, size)
    fft = scipy.fft.next_fast_len(int(longest)) if longest < 2**40 else longest
    return points, fft, seconds


def format_bytes(n: float) -> str:
    if not math.isfinite(n):
        return "unbounded memory"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 2**10:.3g} KiB"


def format_seconds(s: float) -> str:
    return "unbounded time" if not math.isfinite(s) else f"{s:.3g} s"
