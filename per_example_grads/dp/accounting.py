"""Privacy accounting for DP-SGD, through Google's ``dp_accounting`` package.

What is accounted
-----------------
Example-level differential privacy under the add/remove-one neighbouring
relation (two datasets are neighbours when one is the other plus one
example), for the whole *sequence* of noisy gradient steps: every
intermediate noisy gradient, hence every intermediate model, may be
published. One DP-SGD step is a sampled Gaussian mechanism:

    g = sum_{i in batch} clip_C(g_i) + N(0, (sigma * C)^2 I)

Adding or removing one example moves the clipped sum by at most ``C``, so
the step is a Gaussian mechanism with noise multiplier ``sigma`` (noise
standard deviation divided by sensitivity) run on the batch. With Poisson
sampling every example joins each batch independently with probability
``q`` (the expected batch size is ``q * N``), which is the sampling the
guarantee is proved for. ``T`` steps are the ``T``-fold composition

    PoissonSampled(q, Gaussian(sigma)) composed T times

and ``dp_accounting`` turns that event into an (epsilon, delta) guarantee,
with one of two accountants:

* ``"pld"`` (default): privacy loss distributions, composed numerically with
  a pessimistic discretization; the tightest of the two (a valid upper bound).
* ``"rdp"``: Renyi DP over a fixed grid of orders, converted to
  (epsilon, delta); a looser but quick upper bound.

This module builds the events and asks ``dp_accounting``; it does no
accountant mathematics itself beyond estimating the PLD accountant's cost.
Everything else computed from the private data is *not* accounted here:
hyperparameter tuning on it, training-set metrics or losses, the fraction of
clipped examples, normalization statistics, or several examples belonging to
one user (user-level privacy).

Bounded cost
------------
The PLD accountant's memory and time grow as sigma shrinks (each step's
privacy-loss grid widens, roughly as ``1 / sigma^2``) and as the number of
steps grows (so does the support of their composition); the RDP
accountant's do neither. Before every PLD epsilon this module asks
``per_example_grads.dp.pld_cost`` what ``dp_accounting`` would build (its
docstring says how that is estimated). An estimate past ``PLD_MAX_BYTES``
(1 GiB) or ``PLD_MAX_SECONDS`` (20 s) is past the bounds:

* ``compute_epsilon`` and ``PrivacyAccountant.epsilon`` return the RDP
  accountant's epsilon of the same event with a ``UserWarning`` giving the
  estimate. RDP's epsilon is an upper bound too, looser than PLD's, so this
  over-reports, never under-reports. Where RDP answers 0 for a run with
  steps (its numerics fail at extreme parameters), ``ValueError`` instead.
* ``noise_multiplier_for_epsilon(..., accountant="pld")`` raises
  ``ValueError`` (with the RDP accountant's answer) rather than calibrate
  with a mixture of accountants, also when its PLD evaluations together
  would pass ``SEARCH_MAX_SECONDS`` (30 s).
* More than ``MAX_STEPS`` (``1e18``) steps, from ``steps`` or ``epochs``, are
  refused with ``ValueError``.

Shuffled batches (``sampling="shuffle"``)
------------------------------------------
``tf.data``'s ``shuffle(...).batch(B)`` gives fixed-size batches that
partition each epoch. That is not Poisson sampling, and neither accountant
gives a proven, tight bound for it. With ``sampling="shuffle"`` this module
computes the widespread *heuristic*: the same numbers as for Poisson sampling
with ``q = B / N``, and it emits a ``UserWarning`` saying so. The true
epsilon of shuffled DP-SGD can be noticeably larger than that number (Chua et
al., "How Private are DP-SGD Implementations?", ICML 2024). Sample batches
with Poisson sampling when the guarantee has to hold.

Adaptive clipping
-----------------
Adaptive clipping (Andrew, Thakkar, McMahan and Ramaswamy, "Differentially
Private Learning with Adaptive Clipping", NeurIPS 2021) publishes a second
noisy quantity per step, the count of unclipped examples in the *same*
batch, with noise std ``sigma_b``. Both releases must be accounted. Two
Gaussian mechanisms on the same batch with noise multipliers ``s_1`` and
``s_2`` are exactly one Gaussian mechanism with noise multiplier
``(s_1^-2 + s_2^-2)^-1/2`` (stack both outputs, each divided by its own
noise std). When the counted indicators are centred, ``1[||g_i|| <= C] -
1/2``, the count has sensitivity 1/2 and noise multiplier ``2 sigma_b``;
the paper's Theorem 1 then spends a total budget ``sigma`` by giving the
gradient

    sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2),

see ``adaptive_clipping_noise_multiplier``. Account such a run either with
the total ``sigma`` (``PrivacyAccountant(sigma, q)``), or with the parts
(``PrivacyAccountant(sigma_grad, q, extra_noise_multipliers=[2 * sigma_b])``);
both give the same epsilon. With *uncentred* indicators the count has
sensitivity 1, its noise multiplier is ``sigma_b``, and ``2 sigma_b`` above
would under-report epsilon.

Example::

    from per_example_grads.dp.accounting import (
        PrivacyAccountant, compute_epsilon, noise_multiplier_for_epsilon)

    eps = compute_epsilon(60_000, 256, 60, noise_multiplier=1.1, delta=1e-5)
    sigma = noise_multiplier_for_epsilon(3.0, 1e-5, 60_000, 256, 60)

    accountant = PrivacyAccountant(1.1, 256 / 60_000)
    accountant.step(100)                   # after 100 DP-SGD steps
    print(accountant.epsilon(1e-5))
    state = accountant.get_state()         # json.dumps-able, store with the model
    accountant = PrivacyAccountant.from_state(state)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import numbers
import warnings
from fractions import Fraction
from typing import Any, Callable, Iterable, Mapping

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp
from dp_accounting.dp_event import MixtureOfGaussiansDpEvent  # not exported at dp_accounting's top level

from per_example_grads._core.arguments import (
    check_choice,
    check_count,
    check_delta,
    check_noise_multiplier,
    check_positive_int,
    check_real,
    check_sampling_probability,
)
from per_example_grads._core.quiet import quiet_accounting
from per_example_grads.dp import pld_cost
from per_example_grads.dp.pld_cost import PLD_MAX_BYTES, PLD_MAX_SECONDS  # noqa: F401  (the bounds, named here too)

ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")


class AccountantFallbackWarning(UserWarning):
    """The PLD accountant was past its cost bounds, so the RDP accountant answered: a valid, looser bound.

    Its own class so that a caller (``pegrad epsilon``) can tell which
    accountant gave the epsilon it reports.
    """


SAMPLINGS: tuple[str, ...] = ("poisson", "shuffle")

SEARCH_MAX_SECONDS = 30.0  # estimated time of all PLD epsilons of one noise_multiplier_for_epsilon
MAX_STEPS = 10**18  # steps (or releases) in one call or segment: far beyond any run, within int64
_FINE_INTERVAL = 1e-4  # dp_accounting's default PLD grid step
_RELATION = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
_COARSE_INTERVAL = 1e-3  # noise_multiplier_for_epsilon's first search

_STATE_VERSION = 1
_STEP = "step"  # a DP-SGD step: counts towards ``PrivacyAccountant.steps``
_RELEASE = "release"  # any other Gaussian release (``compose_gaussian``)
_EVENT = "event"  # any other ``dp_accounting`` event (``record_event``), composed as it is

SHUFFLE_WARNING = (
    "sampling='shuffle': epsilon is computed as if every batch were Poisson-"
    "sampled with the same sampling probability q = batch_size / num_examples. "
    "This is common practice but not a proven bound for fixed-size batches "
    "from a shuffled dataset; the true epsilon can be larger (Chua et al., "
    "ICML 2024). Use Poisson sampling for a guarantee that holds."
)


# --------------------------------------------------------------------------
# The accountant of a training run.
# --------------------------------------------------------------------------


def sampled_gaussian_event(noise_multiplier: float, sampling_probability: float, count: int) -> dp_accounting.DpEvent:
    """``count`` Gaussian mechanisms of ``noise_multiplier``, each on a Poisson sample at ``sampling_probability``.

    ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), count)``, without the
    sampling at ``q = 1`` (the whole dataset): the event of ``count`` DP-SGD
    steps, and what a ``NoiseMechanism``'s ``accounted_as`` triple stands for.
    """
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sampling_probability != 1.0:
        gaussian = dp_accounting.PoissonSampledDpEvent(sampling_probability, gaussian)
    return dp_accounting.SelfComposedDpEvent(gaussian, count)


def truncated_poisson_event(
    noise_multiplier: float, sampling_probability: float, truncated_batch_size: int, dataset_size: int, count: int
) -> dp_accounting.DpEvent:
    """``count`` DP-SGD steps on truncated Poisson samples: Poisson at ``q`` from ``N``, cut to ``B`` at random.

    ``SelfComposed(TruncatedSubsampledGaussian(N, q, B, sigma), count)``,
    dp_accounting's event for truncated Poisson sampling (arXiv 2508.15089, as
    dp_accounting cites it; the sampling of ``per_example_grads.dp.truncated``), which its
    PLD accountant composes and its RDP accountant does not. Where RDP
    answers (``accountant="rdp"``, or PLD past its cost bounds), each step is
    accounted by ``truncated_dominating_event`` instead.
    """
    event = dp_accounting.TruncatedSubsampledGaussianDpEvent(
        dataset_size=check_positive_int("dataset_size", dataset_size),
        sampling_probability=check_sampling_probability(sampling_probability),
        truncated_batch_size=check_positive_int("truncated_batch_size", truncated_batch_size),
        noise_multiplier=check_noise_multiplier(noise_multiplier),
    )
    return dp_accounting.SelfComposedDpEvent(event, count)


def truncated_dominating_event(event: dp_accounting.TruncatedSubsampledGaussianDpEvent) -> dp_accounting.DpEvent:
    """A Poisson-sampled Gaussian that dominates a truncated one: ``PoissonSampled(q, Gaussian(sigma / 2))``.

    Why: couple the runs on two neighbouring datasets (``D`` and ``D + z``)
    on every other example's draw and on the uniformly random order of which
    truncation keeps the first ``B``. ``z`` joins with probability ``q``;
    when it does not, both runs keep the same examples; when it does, the
    kept sets differ by ``z`` and at most one example it displaced, so the
    clipped sums differ by at most ``2C``. Conditioned on the coupled draws
    the pair is ``N(s, sigma^2 C^2)`` against ``(1 - q) N(s) + q N(s + v)``
    with ``|v| <= 2C``, the Poisson-sampled Gaussian of sensitivity ``2C``;
    the hockey-stick divergence is jointly convex, so the mixture over the
    draws is no worse. Looser than the truncated event (sensitivity 2 only
    when truncation happens), it is what the RDP accountant accounts, and
    how the ledger merges a truncated step with another release
    (``per_example_grads.dp.ledger``).
    """
    half = dp_accounting.GaussianDpEvent(event.noise_multiplier / 2.0)
    return (
        dp_accounting.PoissonSampledDpEvent(event.sampling_probability, half)
        if event.sampling_probability < 1
        else half
    )


def user_level_dominating_event(event: Any) -> dp_accounting.DpEvent:
    """A Poisson-sampled Gaussian that dominates ``user_level_event``'s mixture: ``PoissonSampled(q', Gaussian(sigma / k))``.

    ``q' = 1 - (1 - q)^k``, the chance that any of the user's ``k`` rows
    joins. Why: the mixture is ``P = sum_j P(J = j) N(j, sigma^2)`` against
    ``Q = N(0, sigma^2)`` (units of ``C``); the dominating pair is ``P' =
    (1 - q') N(0, sigma^2) + q' N(k, sigma^2)`` against the same ``Q``. The
    Markov kernel that draws ``j >= 1`` with probability ``P(J = j) / q'``
    and maps ``y`` to ``(j / k) y + N(0, sigma^2 (1 - (j / k)^2))`` takes
    ``N(0, sigma^2)`` to itself and ``N(k, sigma^2)`` to ``N(j, sigma^2)``,
    so it takes ``P'`` to ``P`` and ``Q`` to ``Q``; post-processing never
    increases a hockey-stick divergence, in either direction. Shift ``k`` at
    noise ``sigma`` is shift 1 at ``sigma / k``. Looser than the mixture
    (every participation counted at ``k`` rows), it is what the RDP
    accountant accounts (it has no mixture-of-Gaussians event), and where
    the PLD accountant is past its cost bounds.
    """
    k = max(event.sensitivities)
    q = 1.0 - event.sampling_probs[event.sensitivities.index(0.0)]
    scaled = dp_accounting.GaussianDpEvent(event.standard_deviation / k)
    return dp_accounting.PoissonSampledDpEvent(q, scaled) if q < 1 else scaled


def _dominated(event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    """``event`` with its truncated and mixture-of-Gaussians events replaced by their dominating ones (for RDP)."""
    if isinstance(event, dp_accounting.TruncatedSubsampledGaussianDpEvent):
        return truncated_dominating_event(event)
    if isinstance(event, MixtureOfGaussiansDpEvent):
        return user_level_dominating_event(event)
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return dp_accounting.SelfComposedDpEvent(_dominated(event.event), event.count)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return dp_accounting.ComposedDpEvent([_dominated(e) for e in event.events])
    return event


def user_level_event(
    noise_multiplier: float, sampling_probability: float, rows_per_user: int, count: int
) -> dp_accounting.DpEvent:
    """``count`` DP-SGD steps of example-level sampling, as private as they are for one user of ``rows_per_user`` rows.

    Every row joins a step independently with probability ``q`` and is
    clipped to ``C``; the noise is ``N(0, (sigma C)^2 I)``. A user of ``k``
    rows moves a step's clipped sum by the sum of its ``J ~ Binomial(k, q)``
    sampled rows, a vector of norm at most ``J C``. So, in units of ``C``,
    removing the user is dominated by the mixture-of-Gaussians mechanism
    ``N(0, sigma^2)`` against ``sum_j P(J = j) N(j, sigma^2)``, the event
    ``MixtureOfGaussiansDpEvent(sigma, [0 .. k], Binomial(k, q))`` that
    dp_accounting's PLD accountant composes (Choquette-Choo, Ganesh, Steinke
    and Thakurta, arXiv 2310.15526, mixture-of-Gaussians mechanisms; Charles
    et al., arXiv 2407.07737, example-level sampling with user-level
    accounting). A user with fewer rows has a stochastically smaller ``J``,
    hence a smaller privacy loss: ``k`` is the cap on rows per user that the
    data must respect. ``k = 1`` is the Poisson-sampled Gaussian: DP-SGD's
    example-level event.
    """
    k = check_positive_int("rows_per_user", rows_per_user)
    q = check_sampling_probability(sampling_probability)
    shifts = [float(j) for j in range(k + 1)]
    probabilities = [math.comb(k, j) * q**j * (1.0 - q) ** (k - j) for j in range(k + 1)]
    event = MixtureOfGaussiansDpEvent(check_noise_multiplier(noise_multiplier), shifts, probabilities)
    return dp_accounting.SelfComposedDpEvent(event, count)


@dataclasses.dataclass(frozen=True)
class _Segment:
    """``count`` identical releases: Gaussian mechanisms on one Poisson sample, or another ``dp_accounting`` event.

    ``noise_multipliers`` are the mechanisms run on the same sample in one
    release (the gradient's first, then e.g. adaptive clipping's count);
    ``sampling_probability == 1`` means the whole dataset, no sampling.
    Kind ``_EVENT``: ``event`` is the release, and those two are unused.
    """

    kind: str
    noise_multipliers: tuple[float, ...]
    sampling_probability: float
    count: int
    event: dp_accounting.DpEvent | None = None

    def same_release(self, other: "_Segment") -> bool:
        return (self.kind, self.noise_multipliers, self.sampling_probability, self.event) == (
            other.kind,
            other.noise_multipliers,
            other.sampling_probability,
            other.event,
        )

    def dp_event(self) -> dp_accounting.DpEvent:
        if self.kind == _EVENT:
            return dp_accounting.SelfComposedDpEvent(self.event, self.count)
        return sampled_gaussian_event(
            _combined_noise_multiplier(self.noise_multipliers), self.sampling_probability, self.count
        )

    def to_dict(self) -> dict[str, Any]:
        if self.kind == _EVENT:
            return {"kind": self.kind, "event": _event_to_dict(self.event), "count": self.count}
        return {
            "kind": self.kind,
            "noise_multipliers": list(self.noise_multipliers),
            "sampling_probability": self.sampling_probability,
            "count": self.count,
        }


def segments_of(event: dp_accounting.DpEvent, count: int = 1) -> list[_Segment]:
    """``count`` times ``event`` as ledger segments: DP-SGD steps where it is one, else the event as it is.

    ``SelfComposed`` counts multiply, ``Composed`` events are taken part by
    part, and ``Gaussian`` or ``PoissonSampled(q, Gaussian)`` are steps (the
    same segments ``PrivacyAccountant.step`` records, hence the same epsilon,
    cost estimate and RDP fallback); anything else is kept whole.
    """
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return segments_of(event.event, count * check_count("a SelfComposedDpEvent's count", event.count, MAX_STEPS))
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return [s for part in event.events for s in segments_of(part, count)]
    q, inner = 1.0, event
    if isinstance(event, dp_accounting.PoissonSampledDpEvent):
        q, inner = check_sampling_probability(event.sampling_probability), event.event
    if isinstance(inner, dp_accounting.GaussianDpEvent):
        return [_Segment(_STEP, (check_noise_multiplier(inner.noise_multiplier),), q, count)] if count else []
    if isinstance(event, dp_accounting.NoOpDpEvent) or not count:
        return []
    return [_Segment(_EVENT, (), 1.0, count, event)]


def _event_to_dict(event: dp_accounting.DpEvent) -> dict[str, Any]:
    """A ``dp_accounting`` event as JSON-able data (``DpEvent.to_named_tuple``, its tuples as dicts and lists)."""

    def plain(v: Any) -> Any:
        if hasattr(v, "_asdict"):
            return {k: plain(x) for k, x in v._asdict().items()}
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v

    return plain(event.to_named_tuple())


def _event_from_dict(data: Any, where: str) -> dp_accounting.DpEvent:
    """The event ``_event_to_dict`` described; only ``dp_accounting``'s own event classes are read."""
    module = data.get("module_name") if isinstance(data, Mapping) else None
    cls = None
    if isinstance(module, str) and (module == "dp_accounting" or module.startswith("dp_accounting.")):
        cls = getattr(importlib.import_module(module), str(data.get("class_name")), None)
    if not (isinstance(cls, type) and issubclass(cls, dp_accounting.DpEvent)):
        raise ValueError(f"{where} is not a dp_accounting event from get_state(): {data!r:.200}.")

    def value(v: Any) -> Any:
        if isinstance(v, Mapping) and "class_name" in v:
            return _event_from_dict(v, where)
        return [value(x) for x in v] if isinstance(v, list) else v

    return cls(**{k: value(v) for k, v in data.items() if k not in ("module_name", "class_name")})


class PrivacyAccountant:
    """Counts the DP-SGD steps actually taken and reports the epsilon spent.

    Each ``step()`` records one sampled Gaussian mechanism: noise multiplier
    ``noise_multiplier`` (plus ``extra_noise_multipliers`` on the same batch,
    see the module docstring), sampling probability ``sampling_probability``.
    Steps with other parameters, and unsampled Gaussian releases, can be
    recorded too (``step(noise_multiplier=...)``, ``compose_gaussian``); the
    ledger is a list of segments ``(noise multipliers, q, count)`` and
    ``epsilon(delta)`` asks ``dp_accounting`` about their composition:

        eps(delta) = accountant(
            compose_k  PoissonSampled(q_k, Gaussian(sigma_k)) ^ count_k
        ).get_epsilon(delta)

    Save ``get_state()`` with every model checkpoint and restore it with
    ``from_state`` on restart, so that epsilon covers every step taken.

    Args:
      noise_multiplier: ``sigma >= 0`` of the gradient noise (std / clip
        norm); ``0`` gives ``epsilon = inf``.
      sampling_probability: ``q`` in (0, 1], e.g. ``batch_size / num_examples``.
      accountant: ``"pld"`` (default) or ``"rdp"``.
      sampling: ``"poisson"`` (default) or ``"shuffle"`` (heuristic, warns;
        see the module docstring).
      extra_noise_multipliers: noise multipliers of further Gaussian
        mechanisms run on the same batch at every step, e.g. ``[2 * sigma_b]``
        for adaptive clipping's centred count.

    Examples:
      >>> acc = PrivacyAccountant(1.1, 256 / 60_000, accountant="rdp")
      >>> acc.step(1000)
      >>> acc.steps
      1000
      >>> 0 < acc.epsilon(1e-5) < 2
      True
    """

    def __init__(
        self,
        noise_multiplier: float,
        sampling_probability: float,
        *,
        accountant: str = "pld",
        sampling: str = "poisson",
        extra_noise_multipliers: Iterable[float] = (),
    ):
        self._noise_multiplier = check_noise_multiplier(noise_multiplier)
        self._sampling_probability = check_sampling_probability(sampling_probability)
        self._accountant = check_choice("accountant", accountant, ACCOUNTANTS)
        self._sampling = check_choice("sampling", sampling, SAMPLINGS)
        self._extra = tuple(
            check_noise_multiplier(s, f"extra_noise_multipliers[{i}]")
            for i, s in enumerate(_as_list("extra_noise_multipliers", extra_noise_multipliers))
        )
        self._segments: list[_Segment] = []
        self._epsilons: dict[float, float] = {}
        if self._sampling == "shuffle":
            warnings.warn(SHUFFLE_WARNING, UserWarning, stacklevel=2)

    # -- configuration ----------------------------------------------------

    @property
    def noise_multiplier(self) -> float:
        """The default gradient noise multiplier of ``step()``."""
        return self._noise_multiplier

    @property
    def sampling_probability(self) -> float:
        """The default sampling probability of ``step()``."""
        return self._sampling_probability

    @property
    def accountant(self) -> str:
        """``"pld"`` or ``"rdp"``."""
        return self._accountant

    @property
    def sampling(self) -> str:
        """``"poisson"`` or ``"shuffle"``."""
        return self._sampling

    @property
    def extra_noise_multipliers(self) -> tuple[float, ...]:
        """Noise multipliers of the further mechanisms run with every step."""
        return self._extra

    # -- recording ----------------------------------------------------------

    @property
    def steps(self) -> int:
        """DP-SGD steps recorded so far (``compose_gaussian`` releases excluded)."""
        return sum(s.count for s in self._segments if s.kind == _STEP)

    def step(
        self,
        n: int = 1,
        *,
        noise_multiplier: float | None = None,
        sampling_probability: float | None = None,
    ) -> None:
        """Records ``n >= 0`` more DP-SGD steps.

        ``noise_multiplier`` / ``sampling_probability`` override the
        accountant's defaults for these ``n`` steps only (the extra noise
        multipliers still apply).
        """
        n = check_count("n", n, MAX_STEPS)
        sigma = self._noise_multiplier if noise_multiplier is None else check_noise_multiplier(noise_multiplier)
        q = (
            self._sampling_probability
            if sampling_probability is None
            else check_sampling_probability(sampling_probability)
        )
        self._record(_Segment(_STEP, (sigma, *self._extra), q, n))

    def compose_gaussian(self, noise_multiplier: float, count: int = 1, *, sampling_probability: float = 1.0) -> None:
        """Records ``count`` further Gaussian releases that are not DP-SGD steps.

        For example a noisy statistic of the whole training set
        (``sampling_probability=1``, the default), or one computed on a
        separately Poisson-sampled batch. A quantity computed on the *same*
        batch as a step belongs in ``extra_noise_multipliers`` instead, which
        accounts for it exactly rather than as a separate release.
        """
        sigma = check_noise_multiplier(noise_multiplier)
        q = check_sampling_probability(sampling_probability)
        self._record(_Segment(_RELEASE, (sigma,), q, check_count("count", count, MAX_STEPS)))

    def record_event(self, event: dp_accounting.DpEvent) -> None:
        """Records ``event``, any ``dp_accounting`` event, as one more part of the run's composition.

        What ``segments_of`` reads as DP-SGD steps (``SelfComposed`` of
        ``PoissonSampled(q, Gaussian(sigma))``) counts towards ``steps`` and is
        accounted exactly as ``step()`` would record it; any other event is
        composed as it is. Its PLD cost is not estimated ("Bounded cost"
        covers the Gaussian segments only), and ``get_state`` saves it by its
        ``dp_accounting`` class and fields. ``extra_noise_multipliers`` apply
        to ``step()`` only: an event is recorded as given.
        """
        if not isinstance(event, dp_accounting.DpEvent):
            raise TypeError(f"event must be a dp_accounting.DpEvent; got {type(event).__name__} {event!r:.100}.")
        for segment in segments_of(event):
            self._record(segment)

    def _record(self, segment: _Segment) -> None:
        if segment.count == 0:
            return
        self._epsilons.clear()
        if self._segments and self._segments[-1].same_release(segment):
            last = self._segments.pop()
            segment = dataclasses.replace(segment, count=last.count + segment.count)
        self._segments.append(segment)

    # -- reporting ----------------------------------------------------------

    @property
    def dp_event(self) -> dp_accounting.DpEvent:
        """The ``dp_accounting`` event of everything recorded so far."""
        return _composed_event(self._segments)

    def epsilon(self, delta: float) -> float:
        """The epsilon spent so far at ``delta``; ``0.0`` before any step.

        Recomputed (and cached) after each change: with ``"pld"`` never past
        the cost bounds of "Bounded cost" in the module docstring: beyond
        them the RDP accountant answers, with a ``UserWarning``.
        """
        delta = check_delta(delta)
        if delta not in self._epsilons:
            self._epsilons[delta] = _epsilon(self._accountant, self._segments, delta)
        return self._epsilons[delta]

    # -- checkpointing ------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        """A JSON-serializable dict from which ``from_state`` rebuilds this accountant."""
        return {
            "version": _STATE_VERSION,
            "accountant": self._accountant,
            "sampling": self._sampling,
            "noise_multiplier": self._noise_multiplier,
            "sampling_probability": self._sampling_probability,
            "extra_noise_multipliers": list(self._extra),
            "segments": [s.to_dict() for s in self._segments],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "PrivacyAccountant":
        """The accountant that ``get_state()`` described, steps included."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a dict from PrivacyAccountant.get_state(); got {type(state).__name__}.")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"state['version'] must be {_STATE_VERSION}; got {state.get('version')!r}.")
        try:
            accountant = cls(
                state["noise_multiplier"],
                state["sampling_probability"],
                accountant=state["accountant"],
                sampling=state["sampling"],
                extra_noise_multipliers=state["extra_noise_multipliers"],
            )
            segments = state["segments"]
        except KeyError as e:
            raise ValueError(f"state is missing the key {e.args[0]!r}.") from None
        for i, seg in enumerate(_as_list("state['segments']", segments)):
            where = f"state['segments'][{i}]"
            if isinstance(seg, Mapping) and seg.get("kind") == _EVENT:
                count = check_count(f"{where}['count']", seg.get("count"), MAX_STEPS)
                event = _event_from_dict(seg.get("event"), f"{where}['event']")
                accountant._record(_Segment(_EVENT, (), 1.0, count, event))
                continue
            try:
                kind = check_choice(f"{where}['kind']", seg["kind"], (_STEP, _RELEASE))
                sigmas = tuple(
                    check_noise_multiplier(s, f"{where}['noise_multipliers']")
                    for s in _as_list(f"{where}['noise_multipliers']", seg["noise_multipliers"])
                )
                q = check_sampling_probability(seg["sampling_probability"], f"{where}['sampling_probability']")
                count = check_count(f"{where}['count']", seg["count"], MAX_STEPS)
            except (KeyError, TypeError) as e:
                raise ValueError(f"{where} is not a segment from get_state(): {e!r}.") from None
            if not sigmas:
                raise ValueError(f"{where}['noise_multipliers'] is empty.")
            accountant._record(_Segment(kind, sigmas, q, count))
        return accountant

    def __repr__(self) -> str:
        extra = f", extra_noise_multipliers={list(self._extra)}" if self._extra else ""
        releases = sum(s.count for s in self._segments if s.kind == _RELEASE)
        other = f", other_releases={releases}" if releases else ""
        return (
            f"PrivacyAccountant(noise_multiplier={self._noise_multiplier!r}, "
            f"sampling_probability={self._sampling_probability!r}, "
            f"accountant={self._accountant!r}, sampling={self._sampling!r}{extra}, "
            f"steps={self.steps}{other})"
        )


# --------------------------------------------------------------------------
# One-shot functions for a planned run.
# --------------------------------------------------------------------------


def dp_sgd_schedule(
    num_examples: int,
    batch_size: float,
    epochs: float | None,
    steps: int | None = None,
    sampling_probability: float | None = None,
    cycle_length: int = 1,
) -> tuple[float, int]:
    """``(q, steps)`` of a planned run, as ``compute_epsilon`` reads its arguments.

    ``q = cycle_length * batch_size / num_examples`` (``sampling_probability``,
    if given, must agree with it): the rate at which the examples of the
    part in turn are sampled, all ``N`` of them without cyclic sampling;
    ``steps = ceil(epochs * num_examples / batch_size)``, or ``steps``
    instead of ``epochs`` (floats are read by their decimal repr, so
    ``epochs=0.1`` is 1/10).

    Raises:
      ValueError: both ``epochs`` and ``steps``, or a ``sampling_probability``
        that disagrees with ``batch_size / num_examples``, or values out of range.

    Examples:
      >>> dp_sgd_schedule(60_000, 256, 60)
      (0.004266666666666667, 14063)
    """
    n = check_positive_int("num_examples", num_examples)
    b = check_real("batch_size", batch_size)
    if not b > 0:
        raise ValueError(f"batch_size must be > 0; got {batch_size!r}.")
    cycle = check_positive_int("cycle_length", cycle_length)
    if b * cycle > n * (1 + 1e-9):  # N / cycle_length as a float may round up: whole parts, q = 1
        what = f"batch_size * cycle_length ({batch_size!r} * {cycle})" if cycle > 1 else f"batch_size ({batch_size!r})"
        raise ValueError(f"{what} must be <= num_examples ({num_examples!r}).")
    if sampling_probability is None:
        q = min(1.0, b * cycle / n)
    else:
        q = check_sampling_probability(sampling_probability)
        if abs(q - b * cycle / n) > 1e-9 * q:
            ratio = f"{cycle} * batch_size / num_examples = {cycle} * " if cycle > 1 else "batch_size / num_examples = "
            raise ValueError(
                f"sampling_probability={sampling_probability!r} disagrees with {ratio}"
                f"{batch_size!r} / {num_examples!r} = {b * cycle / n:.6g}: give one of them consistent with the "
                "other (the expected batch size is q * N / cycle_length), or leave sampling_probability out."
            )
    if steps is not None:
        if epochs is not None:
            raise ValueError(
                f"give epochs or steps, not both (got epochs={epochs!r}, steps={steps!r}): steps would silently win."
            )
        steps = check_count("steps", steps, MAX_STEPS)
    else:
        if epochs is None:
            raise ValueError("epochs is required unless steps is given.")
        e = check_real("epochs", epochs)
        if not e > 0:
            raise ValueError(f"epochs must be > 0; got {epochs!r}.")
        steps = math.ceil(_exact(epochs) * n / _exact(batch_size))
        if steps > MAX_STEPS:
            raise ValueError(f"epochs={epochs!r} makes {steps:.3g} steps, more than MAX_STEPS = {MAX_STEPS:.0e}.")
    return q, steps


def compute_epsilon(
    num_examples: int,
    batch_size: float,
    epochs: float | None,
    noise_multiplier: float,
    delta: float,
    *,
    accountant: str = "pld",
    sampling: str = "poisson",
    steps: int | None = None,
    sampling_probability: float | None = None,
    mechanism: Any = None,
    rows_per_user: int | None = None,
    truncated_batch_size: int | None = None,
) -> float:
    """The epsilon of DP-SGD run for ``epochs`` epochs (or ``steps`` steps).

    With ``q = batch_size / num_examples`` (or ``sampling_probability``) and
    ``T = ceil(epochs * num_examples / batch_size)`` (or ``steps``):

        eps = accountant(PoissonSampled(q, Gaussian(noise_multiplier)) ^ T).get_epsilon(delta)

    ``batch_size`` is the expected batch size ``q * N`` under Poisson
    sampling (it may be fractional). With a ``mechanism``
    (``per_example_grads.dp.mechanisms``: ``BandMF``, ``BLT``), the run uses
    its cyclic Poisson sampling (``cycle_length = b``; ``q = b * batch_size
    / N``, the part's rate) and is accounted as the mechanism says, its
    ``mechanism.dp_event(sigma, q, T)`` (for ``BandMF``, ``ceil(T / b)``
    DP-SGD steps at ``q``; for ``BLT``, one Gaussian mechanism of noise
    multiplier ``sigma / sensitivity``). ``sampling="shuffle"`` returns the same
    number, which is only a heuristic for shuffled fixed-size batches, and
    warns (see the module docstring). ``delta >= 1 / num_examples`` warns: a
    mechanism that publishes one random example in full already meets it;
    choose ``delta`` much smaller than ``1 / N``. With ``"pld"`` past its
    cost bounds, the RDP accountant answers and a ``UserWarning`` says so
    (see "Bounded cost" in the module docstring).

    With ``rows_per_user=k`` the epsilon is per user, for a run that samples
    and clips rows (``num_examples`` and ``batch_size`` count rows) on data
    where no user has more than ``k`` rows (``user_level_event``; DP-SGD
    only; with ``"rdp"`` by the looser ``user_level_dominating_event``).

    With ``truncated_batch_size=B`` the run samples by truncated Poisson
    sampling (``peg.dp.truncated_poisson_batches``: Poisson at ``q``, a
    batch over ``B`` cut to ``B`` at random), accounted by its own event
    (``truncated_poisson_event``; DP-SGD only; with ``"rdp"`` by the looser
    ``truncated_dominating_event``).

    Raises:
      ValueError: both ``epochs`` and ``steps``; a ``sampling_probability``
        that disagrees with ``batch_size / num_examples``; more than
        ``MAX_STEPS`` steps; an RDP fallback that answers 0 (its numerics
        failing); or any argument out of range (named).

    Examples:
      >>> eps = compute_epsilon(60_000, 256, 60, 1.1, 1e-5, accountant="rdp")
      >>> 2 < eps < 4
      True
    """
    sigma = check_noise_multiplier(noise_multiplier)
    q, steps = dp_sgd_schedule(num_examples, batch_size, epochs, steps, sampling_probability, _cycle_of(mechanism))
    delta = check_run_delta(delta, num_examples)
    accountant = check_choice("accountant", accountant, ACCOUNTANTS)
    if check_choice("sampling", sampling, SAMPLINGS) == "shuffle":
        warnings.warn(SHUFFLE_WARNING, UserWarning, stacklevel=2)
    _check_per_user(rows_per_user, mechanism)
    truncation = _truncation(truncated_batch_size, num_examples, mechanism, rows_per_user)
    return _epsilon(accountant, _run_segments(sigma, q, steps, mechanism, rows_per_user, truncation), delta)


def _check_per_user(rows_per_user: int | None, mechanism: Any) -> None:
    """``ValueError`` for per-user accounting of a mechanism it does not account (DP-SGD's only)."""
    if rows_per_user is not None and mechanism is not None:
        raise ValueError(
            "rows_per_user accounts DP-SGD's independent noise only (a mixture of Gaussians per step), "
            f"not a {type(mechanism).__name__}: leave mechanism out, or rows_per_user."
        )


def _truncation(
    truncated_batch_size: int | None, num_examples: int, mechanism: Any, rows_per_user: int | None = None
) -> tuple[int, int] | None:
    """``(B, N)`` of a planned truncated Poisson run, or None; ``ValueError`` for a pairing it does not account."""
    if truncated_batch_size is None:
        return None
    b = check_positive_int("truncated_batch_size", truncated_batch_size)
    other = (
        f"a {type(mechanism).__name__} mechanism"
        if mechanism is not None
        else "rows_per_user"
        if rows_per_user is not None
        else None
    )
    if other is not None:
        raise ValueError(
            f"truncated_batch_size accounts DP-SGD's independent noise on example-level truncated Poisson "
            f"samples only, not {other}: leave one of them out."
        )
    return b, int(num_examples)


def _cycle_of(mechanism: Any) -> int:
    """The cycle ``mechanism``'s accounting assumes (1 for None), once it is checked to be a mechanism that states it."""
    if mechanism is None:
        return 1
    from per_example_grads.dp.mechanisms import check_mechanism  # keras layers: imported where a mechanism is given

    return int(check_mechanism(mechanism).cycle_length)


def _run_segments(
    sigma: float,
    q: float,
    steps: int,
    mechanism: Any = None,
    rows_per_user: int | None = None,
    truncation: tuple[int, int] | None = None,
) -> list[_Segment]:
    """The ledger of ``steps`` steps at ``(sigma, q)`` with ``mechanism`` (None: DP-SGD), as ``_Segment`` s.

    ``rows_per_user``: DP-SGD's steps per user of at most that many rows (``user_level_event``).
    ``truncation``: ``(B, N)``, DP-SGD's steps on truncated Poisson samples (``truncated_poisson_event``).
    """
    if not steps:
        return []
    if truncation is not None:
        return segments_of(truncated_poisson_event(sigma, q, *truncation, steps))
    if rows_per_user is not None:
        return segments_of(user_level_event(sigma, q, rows_per_user, steps))
    if mechanism is not None:
        return segments_of(mechanism.dp_event(sigma, q, steps))
    return [_Segment(_STEP, (sigma,), q, steps)]


def noise_multiplier_for_epsilon(
    target_epsilon: float,
    delta: float,
    num_examples: int,
    batch_size: float,
    epochs: float | None,
    *,
    accountant: str = "pld",
    sampling: str = "poisson",
    steps: int | None = None,
    sampling_probability: float | None = None,
    rtol: float = 1e-3,
    mechanism: Any = None,
    truncated_batch_size: int | None = None,
    rows_per_user: int | None = None,
) -> float:
    """The smallest noise multiplier whose epsilon is at most ``target_epsilon``.

    Same schedule as ``compute_epsilon``; sigma is searched in ``[1e-3,
    1e9]``. Epsilon decreases as sigma grows. The RDP accountant (quick
    whatever the parameters) first checks the range's bottom, then finds its
    own answer: brackets by doubling / halving from ``sigma = 1``, then
    ``dp_accounting.calibrate_dp_mechanism`` (Brent's method with a bisection
    fallback) on the bracket. With ``"rdp"`` that is the result. With
    ``"pld"`` the search continues from there with PLD alone (never mixing
    accountants): on a 10x coarser grid to locate the answer, then on the
    default grid in a narrow bracket, every evaluation's cost estimated first
    (see "Bounded cost" in the module docstring). The result ``sigma``
    satisfies ``compute_epsilon(..., sigma) <= target_epsilon`` with the same
    accountant (and ``mechanism``, ``truncated_batch_size`` and
    ``rows_per_user``, read as there: the last makes ``target_epsilon`` per
    user) and is within ``rtol`` (relative) of the smallest such sigma.

    Raises:
      ValueError: naming ``target_epsilon``, when it is met below
        ``sigma = 1e-3`` (by RDP's bound already) or needs more than ``1e9``;
        with ``"pld"``, when an evaluation the search needs is past
        ``PLD_MAX_BYTES`` / ``PLD_MAX_SECONDS`` or all of them together past
        ``SEARCH_MAX_SECONDS`` (the message gives the RDP accountant's
        answer); and for the arguments ``compute_epsilon`` refuses.

    Examples:
      >>> sigma = noise_multiplier_for_epsilon(2.0, 1e-5, 60_000, 256, 5, accountant="rdp")
      >>> compute_epsilon(60_000, 256, 5, sigma, 1e-5, accountant="rdp") <= 2.0
      True
    """
    target = check_real("target_epsilon", target_epsilon)
    if not target > 0:
        raise ValueError(f"target_epsilon must be > 0; got {target_epsilon!r}.")
    rtol = check_real("rtol", rtol)
    if not 0 < rtol < 1:
        raise ValueError(f"rtol must be in (0, 1); got {rtol!r}.")
    q, steps = dp_sgd_schedule(num_examples, batch_size, epochs, steps, sampling_probability, _cycle_of(mechanism))
    delta = check_run_delta(delta, num_examples)
    accountant = check_choice("accountant", accountant, ACCOUNTANTS)
    if check_choice("sampling", sampling, SAMPLINGS) == "shuffle":
        warnings.warn(SHUFFLE_WARNING, UserWarning, stacklevel=2)
    if steps == 0:
        raise ValueError("steps is 0: no noise is needed for zero steps.")
    _check_per_user(rows_per_user, mechanism)
    truncation = _truncation(truncated_batch_size, num_examples, mechanism, rows_per_user)

    def segments(sigma: float) -> list[_Segment]:
        return _run_segments(sigma, q, steps, mechanism, rows_per_user, truncation)

    def event(sigma: float) -> dp_accounting.DpEvent:
        parts = segments(sigma)
        return parts[0].dp_event() if len(parts) == 1 else _composed_event(parts)

    def rdp_within(sigma: float) -> bool:
        return _accountant_epsilon(_make_accountant("rdp"), event(sigma), delta) <= target

    # The range's bottom first, with the quick RDP accountant (its search then
    # finds the top, cheaply). Its epsilon is an upper bound on the exact one,
    # so a target it meets at the smallest sigma is met below it.
    if rdp_within(_SIGMA_RANGE[0]):
        raise ValueError(
            f"target_epsilon={target!r} is met with noise_multiplier below {_SIGMA_RANGE[0]:g} "
            "(by the RDP bound already): that is no privacy to speak of. Choose a smaller target_epsilon."
        )
    above = (
        f"target_epsilon={target!r} needs noise_multiplier above {_SIGMA_RANGE[1]:g} for this run: "
        "choose a larger target_epsilon, fewer steps or a smaller batch."
    )
    try:
        rdp_event = lambda sigma: _dominated(event(sigma))  # noqa: E731  (what the RDP accountant accounts)
        rdp_sigma = _calibrate(rdp_within, lambda: _make_accountant("rdp"), rdp_event, target, delta, 1.0, 2.0, rtol)
    except _AboveRange:
        if accountant == "rdp":
            raise ValueError(above) from None
        rdp_sigma = math.inf  # PLD, the tighter, may still fit in the range
    if accountant == "rdp":
        return rdp_sigma

    search = _PldSearch(segments, target, delta)
    guess = min(rdp_sigma, _SIGMA_RANGE[1])
    try:
        # The default grid's cost near the RDP answer first: PLD's answer is
        # usually a little below it.
        search.check(guess, _FINE_INTERVAL)
        # A coarse grid (10x fewer points) finds the neighbourhood; the
        # default one then usually only confirms [guess / (1 + rtol), guess].
        guess = _calibrate(*search.calibration(_COARSE_INTERVAL), target, delta, guess, 1.25, 1e-3)
        return _calibrate(*search.calibration(_FINE_INTERVAL), target, delta, guess, 1.0 + rtol, rtol)
    except _AboveRange:
        raise ValueError(above) from None
    except _TooCostly as e:
        rdp = (
            f"the RDP accountant needs noise_multiplier above {_SIGMA_RANGE[1]:g}"
            if math.isinf(rdp_sigma)
            else f"accountant='rdp' gives noise_multiplier={_round_up(rdp_sigma)}, a valid but looser calibration"
        )
        raise ValueError(f"target_epsilon={target!r}: {e}; {rdp}.") from None


# noise_multiplier_for_epsilon searches sigma in this range.
_SIGMA_RANGE = (1e-3, 1e9)


class _AboveRange(Exception):
    """The search would go above ``_SIGMA_RANGE``."""


class _TooCostly(Exception):
    """A PLD evaluation of the search is past the cost bounds (the message says which)."""


_ESTIMATE_SLACK = 1.25  # the coarse search's first factor: one estimate covers its first bracket


class _PldSearch:
    """The PLD evaluations of one ``noise_multiplier_for_epsilon`` search, each costed before it runs.

    ``charge(sigma, interval)``, before each evaluation, raises ``_TooCostly``
    when its estimate is past ``PLD_MAX_BYTES`` / ``PLD_MAX_SECONDS``, or when
    the estimated seconds of all evaluations (and estimates) so far pass
    ``SEARCH_MAX_SECONDS``. The cost decreases as sigma grows (each step's
    privacy loss narrows), so an evaluation above a sigma already estimated
    is charged that estimate instead of a new one; below all of them, the
    estimate is made at ``sigma / _ESTIMATE_SLACK``, so that it also covers
    the next few, nearby, evaluations of the search.
    """

    def __init__(self, segments: Callable[[float], list[_Segment]], target: float, delta: float):
        self._segments = segments
        self._target = target
        self._delta = delta
        self._costs: dict[float, dict[float, pld_cost.Cost]] = {}  # interval -> sigma -> estimate
        self._seconds = 0.0

    def check(self, sigma: float, interval: float) -> pld_cost.Cost:
        """The estimate that covers an evaluation at ``sigma``; ``_TooCostly`` if it is past the bounds."""
        costs = self._costs.setdefault(interval, {})
        below = max((s for s in costs if s <= sigma), default=None)
        if below is None:
            below = sigma / _ESTIMATE_SLACK
            costs[below] = _cost(self._segments(below), interval)
            self._seconds += costs[below].estimate_seconds
        cost = costs[below]
        if not cost.fits():
            raise _TooCostly(
                f"the PLD accountant would need {cost} (estimated) at noise_multiplier={below:.4g}, "
                f"past the bound of {pld_cost.bounds()}"
            )
        return cost

    def charge(self, sigma: float, interval: float) -> None:
        """``check``, then counts the evaluation's estimated seconds; ``_TooCostly`` past ``SEARCH_MAX_SECONDS``."""
        cost = self.check(sigma, interval)
        self._seconds += cost.seconds - cost.estimate_seconds
        if self._seconds > SEARCH_MAX_SECONDS:
            raise _TooCostly(
                f"calibrating with the PLD accountant would take more than {SEARCH_MAX_SECONDS:g} s "
                f"(estimated, by noise_multiplier={sigma:.4g})"
            )

    def calibration(self, interval: float) -> tuple[Callable, Callable, Callable]:
        """``_calibrate``'s first three arguments for the PLD grid ``interval``, every evaluation charged."""

        def make_accountant() -> dp_accounting.PrivacyAccountant:
            return _make_accountant("pld", interval)

        def event(sigma: float) -> dp_accounting.DpEvent:
            self.charge(sigma, interval)
            return _composed_event(self._segments(sigma))

        def within(sigma: float) -> bool:
            return _accountant_epsilon(make_accountant(), event(sigma), self._delta) <= self._target

        return within, make_accountant, event


def _calibrate(
    within: Callable[[float], bool],
    make_accountant: Callable[[], dp_accounting.PrivacyAccountant],
    event: Callable[[float], dp_accounting.DpEvent],
    target: float,
    delta: float,
    guess: float,
    factor: float,
    rtol: float,
) -> float:
    """The smallest sigma with ``within(sigma)`` (``eps(event(sigma)) <= target``), to ``rtol``.

    Brackets it by multiplying or dividing ``guess`` by ``factor`` (which
    squares after each miss, up to 2), then hands the bracket to
    ``dp_accounting.calibrate_dp_mechanism`` (with ``make_accountant`` and
    ``event``) unless it is already narrower than ``rtol``. Raises
    ``_AboveRange`` past the top of ``_SIGMA_RANGE``; below its bottom,
    ``ValueError``.
    """
    if within(guess):
        high, low = guess, guess / factor
        while within(low):
            if low < _SIGMA_RANGE[0]:
                raise ValueError(f"target_epsilon={target!r} is met with noise_multiplier below {_SIGMA_RANGE[0]:g}.")
            factor = min(factor * factor, 2.0)
            high, low = low, low / factor
    else:
        low, high = guess, guess * factor
        while not within(high):
            if high > _SIGMA_RANGE[1]:
                raise _AboveRange()
            factor = min(factor * factor, 2.0)
            low, high = high, high * factor
    if high - low <= rtol * low:
        return float(high)
    with quiet_accounting():
        return float(
            dp_accounting.calibrate_dp_mechanism(
                make_accountant,
                event,
                target,
                delta,
                bracket_interval=dp_accounting.ExplicitBracketInterval(low, high),
                tol=rtol * low,
            )
        )


def adaptive_clipping_noise_multiplier(
    total_noise_multiplier: float,
    clipped_count_stddev: float | None = None,
    expected_batch_size: float | None = None,
) -> float:
    """The gradient's noise multiplier when adaptive clipping shares the budget.

    Andrew, Thakkar, McMahan and Ramaswamy (2021), "Differentially Private
    Learning with Adaptive Clipping", NeurIPS, Theorem 1: a step that adds
    noise with multiplier ``sigma_grad`` to the clipped gradient sum and
    noise with std ``sigma_b`` to the count of *centred* unclipped
    indicators ``sum_i (1[||g_i|| <= C] - 1/2)`` (sensitivity 1/2, so noise
    multiplier ``2 sigma_b``) has the privacy of one Gaussian step with
    noise multiplier ``sigma`` when

        sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2).

    Account for such a run with ``sigma`` (``total_noise_multiplier``).
    The count must be centred: an uncentred count has sensitivity 1 and this
    formula would under-report epsilon.

    Args:
      total_noise_multiplier: ``sigma > 0``, the budget's noise multiplier.
      clipped_count_stddev: ``sigma_b > sigma / 2``, the std of the noise
        added to the count, in examples. Default: the paper's suggestion
        ``expected_batch_size / 20``.
      expected_batch_size: only used for that default; the formula itself
        does not depend on the batch size.

    Examples:
      >>> round(adaptive_clipping_noise_multiplier(1.0, 5.0), 4)
      1.005
    """
    sigma = check_real("total_noise_multiplier", total_noise_multiplier)
    if not sigma > 0:
        raise ValueError(f"total_noise_multiplier must be > 0; got {total_noise_multiplier!r}.")
    if expected_batch_size is not None:
        batch = check_real("expected_batch_size", expected_batch_size)
        if not batch > 0:
            raise ValueError(f"expected_batch_size must be > 0; got {expected_batch_size!r}.")
    if clipped_count_stddev is None:
        if expected_batch_size is None:
            raise ValueError(
                "give clipped_count_stddev, or expected_batch_size for its default expected_batch_size / 20."
            )
        sigma_b = batch / 20
    else:
        sigma_b = check_real("clipped_count_stddev", clipped_count_stddev)
        if not sigma_b > 0:
            raise ValueError(f"clipped_count_stddev must be > 0; got {clipped_count_stddev!r}.")
    if not sigma < 2 * sigma_b:
        raise ValueError(
            f"total_noise_multiplier ({sigma}) must be < 2 * clipped_count_stddev ({2 * sigma_b}): "
            "the count's noise alone would use the whole budget. Raise clipped_count_stddev."
        )
    return (sigma**-2 - (2 * sigma_b) ** -2) ** -0.5


# --------------------------------------------------------------------------
# dp_accounting plumbing.
# --------------------------------------------------------------------------


def _make_accountant(name: str, interval: float = _FINE_INTERVAL) -> dp_accounting.PrivacyAccountant:
    """A fresh accountant with ``dp_accounting``'s defaults; ``interval``: the PLD grid's step."""
    if name == "pld":
        return _ReusingPLDAccountant(neighboring_relation=_RELATION, value_discretization_interval=interval)
    return _ReusingRdpAccountant(neighboring_relation=_RELATION)


class _ReusingRdpAccountant(rdp.RdpAccountant):
    """``dp_accounting``'s RDP accountant, each DP-SGD step's RDP curve computed once per process.

    A budget's and a ledger's searches compose the same Poisson-sampled
    Gaussian step at many step counts, and ``RdpAccountant`` computes its
    curve over the orders anew each time (0.2-0.3 s a step kind, most of a
    search's seconds). The curve is a function of ``(q, sigma)``, the orders
    and the relation alone, and composing adds ``count`` times it, so adding
    ``count`` times the kept curve is what the parent adds, bit for bit
    (``tests/test_dp_accounting.py`` checks equality). Every other event, and
    a step of zero sampling or noise, is the parent's.
    """

    def _maybe_compose(self, event, count, do_compose):
        key = _step_key(event)  # the PLD accountant's key: a DP-SGD step is ("poisson", sigma, q)
        if not do_compose or key is None or key[0] != "poisson" or self._neighboring_relation != _RELATION:
            return super()._maybe_compose(event, count, do_compose)
        _, sigma, q = key
        self._rdp += count * _step_rdp(q, sigma, tuple(self._orders.tolist()))
        return None


@functools.lru_cache(maxsize=256)
def _step_rdp(q: float, sigma: float, orders: tuple) -> np.ndarray:
    """The RDP curve of one Poisson-sampled Gaussian step over ``orders``, as the parent accountant computes it (read-only)."""
    one = rdp.RdpAccountant(orders=list(orders), neighboring_relation=_RELATION)
    one.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)))
    curve = one._rdp.copy()
    curve.flags.writeable = False
    return curve


class _ReusingPLDAccountant(pld.PLDAccountant):
    """``dp_accounting``'s PLD accountant, each kind of step's PLD built once per process and self-composed.

    A budget's and a ledger's searches ask for the same step's PLD at many
    step counts, and ``PLDAccountant`` builds it anew each time (its slowest
    part: 0.3-0.6 s for a truncated or mixture step), after ``pld_cost`` built
    it once more for its estimate. That PLD is a function of the event's
    parameters, the grid and the relation alone, and composing returns new
    objects, so composing the kept one (``pld_cost.step_distribution``, which
    the estimate reads too) composes what the parent would build
    (``tests/test_dp_accounting.py`` checks equality).
    Every other event, and a step of zero sampling or noise, is the parent's.
    """

    def _maybe_compose(self, event, count, do_compose):
        key = _step_key(event)
        if not do_compose or key is None or self.neighboring_relation != _RELATION:
            return super()._maybe_compose(event, count, do_compose)
        step = pld_cost.step_distribution(key, self._value_discretization_interval, self.neighboring_relation)
        self._pld = self._pld.compose(step.self_compose(count))
        return None


def _step_key(event: dp_accounting.DpEvent) -> tuple | None:
    """``pld_cost.step_distribution``'s key of ``event``: the three step events a run records; else None."""
    if isinstance(event, dp_accounting.PoissonSampledDpEvent) and isinstance(
        event.event, dp_accounting.GaussianDpEvent
    ):
        q, sigma = event.sampling_probability, event.event.noise_multiplier
        return ("poisson", float(sigma), float(q)) if q > 0 and sigma > 0 else None
    if isinstance(event, dp_accounting.TruncatedSubsampledGaussianDpEvent):
        params = (event.dataset_size, event.sampling_probability, event.truncated_batch_size, event.noise_multiplier)
        return ("truncated", *params) if all(v > 0 for v in params) else None
    if isinstance(event, MixtureOfGaussiansDpEvent):
        sensitivities, probabilities = tuple(event.sensitivities), tuple(event.sampling_probs)
        if event.standard_deviation > 0 and sensitivities != (0.0,):
            return ("mixture", float(event.standard_deviation), sensitivities, probabilities)
    return None


def _composed_event(segments: list[_Segment]) -> dp_accounting.DpEvent:
    return dp_accounting.ComposedDpEvent([s.dp_event() for s in segments])


def _accountant_epsilon(
    accountant: dp_accounting.PrivacyAccountant, event: dp_accounting.DpEvent, delta: float
) -> float:
    if isinstance(accountant, rdp.RdpAccountant):
        event = _dominated(event)
    with quiet_accounting():
        try:
            accountant.compose(event)
        except dp_accounting.UnsupportedEventError as e:
            name = "pld" if isinstance(accountant, pld.PLDAccountant) else "rdp"
            raise ValueError(
                f"the {name!r} accountant of dp_accounting cannot account this run's events ({e}): choose the "
                "accountant that supports them (accountant='pld' or 'rdp')."
            ) from None
        return float(accountant.get_epsilon(delta))


def _epsilon(accountant: str, segments: list[_Segment], delta: float) -> float:
    """Epsilon of ``segments``' composition, with RDP where PLD is past its cost bounds (see the module docstring).

    The warning names the caller of the public function (``stacklevel=3``).
    """
    event = _composed_event(segments)
    if accountant == "pld":
        cost = _cost(segments, _FINE_INTERVAL)
        if not cost.fits():
            epsilon = _accountant_epsilon(_make_accountant("rdp"), event, delta)
            what = _describe(segments)
            if epsilon == 0:  # dp_accounting's answer where its RDP numerics break down
                raise ValueError(
                    f"{what}: the PLD accountant would need {cost} (estimated, past the bound of {pld_cost.bounds()}) and "
                    "the RDP accountant returns epsilon = 0, which it cannot vouch for at these parameters."
                )
            warnings.warn(
                f"{what}: the PLD accountant would need {cost} (estimated, past the bound of {pld_cost.bounds()}), so "
                "epsilon comes from the RDP accountant: a valid upper bound, looser than PLD's. "
                "accountant='rdp' skips the estimate.",
                AccountantFallbackWarning,
                stacklevel=3,
            )
            return epsilon
    return _accountant_epsilon(_make_accountant(accountant), event, delta)


def _cost(segments: list[_Segment], interval: float) -> pld_cost.Cost:
    """``pld_cost.estimate`` of ``segments``, each as one sampled Gaussian of its combined noise multiplier.

    Other events (``record_event``) are not estimated: their cost is theirs to bound.
    """
    releases = [
        (_combined_noise_multiplier(s.noise_multipliers), s.sampling_probability, s.count)
        for s in segments
        if s.kind != _EVENT
    ]
    # a truncated step's PLD is two Gaussian ones mixed, the wider at sigma / 2: costed as that one
    releases += [
        (s.event.noise_multiplier / 2.0, s.event.sampling_probability, s.count)
        for s in segments
        if s.kind == _EVENT and isinstance(s.event, dp_accounting.TruncatedSubsampledGaussianDpEvent)
    ]
    return pld_cost.estimate(releases, interval)


def _describe(segments: list[_Segment]) -> str:
    """``"steps=1000000000, noise_multiplier=1.1, q=0.004267"``, or a count of segments, for messages."""
    if len(segments) == 1 and segments[0].kind != _EVENT:
        (s,) = segments
        sigma = _combined_noise_multiplier(s.noise_multipliers)
        what = "steps" if s.kind == _STEP else "releases"
        return f"{what}={s.count}, noise_multiplier={sigma:.4g}, q={s.sampling_probability:.4g}"
    return f"{len(segments)} segments ({sum(s.count for s in segments)} releases)"


def _combined_noise_multiplier(noise_multipliers: Iterable[float]) -> float:
    """Gaussian mechanisms on the same data, as one: ``(sum_k s_k^-2)^(-1/2)``."""
    sigmas = tuple(noise_multipliers)
    if len(sigmas) == 1:
        return sigmas[0]
    if any(s == 0 for s in sigmas):
        return 0.0
    return math.fsum(s**-2 for s in sigmas) ** -0.5


def _round_up(x: float) -> float:
    """``x > 0`` rounded up to 6 significant digits, so that a printed noise multiplier still meets its target."""
    scale = 10.0 ** (5 - math.floor(math.log10(x)))
    return math.ceil(x * scale) / scale


# --------------------------------------------------------------------------
# Argument checks beyond the scalar ones of per_example_grads._core.arguments.
# --------------------------------------------------------------------------


def _exact(x: Any) -> Fraction:
    """``x`` as a fraction, reading floats by their shortest repr (``0.1`` is 1/10)."""
    return Fraction(int(x)) if isinstance(x, numbers.Integral) else Fraction(repr(float(x)))


def check_run_delta(value: Any, num_examples: int) -> float:
    delta = check_delta(value)
    if delta >= 1 / num_examples:
        warnings.warn(
            f"delta={delta:g} is >= 1/num_examples = {1 / num_examples:g}; publishing one "
            "random example in full already satisfies it. Choose delta much smaller than "
            "1/num_examples.",
            UserWarning,
            stacklevel=3,
        )
    return delta


def _as_list(name: str, value: Any) -> list:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list; got {value!r}.")
    return list(value)
