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
accountant mathematics itself. Everything else computed from the private
data is *not* accounted here: hyperparameter tuning on it, training-set
metrics or losses, the fraction of clipped examples, normalization
statistics, or several examples belonging to one user (user-level privacy).

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
import math
import numbers
import warnings
from fractions import Fraction
from typing import Any, Callable, Iterable, Mapping

import dp_accounting
from dp_accounting import pld, rdp

from per_example_grads._core.quiet import quiet_accounting
from per_example_grads.dp import pld_cost

ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")
SAMPLINGS: tuple[str, ...] = ("poisson", "shuffle")

_STATE_VERSION = 1
_STEP = "step"  # a DP-SGD step: counts towards ``PrivacyAccountant.steps``
_RELEASE = "release"  # any other Gaussian release (``compose_gaussian``)

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


@dataclasses.dataclass(frozen=True)
class _Segment:
    """``count`` identical releases: Gaussian mechanisms on one Poisson sample.

    ``noise_multipliers`` are the mechanisms run on the same sample in one
    release (the gradient's first, then e.g. adaptive clipping's count);
    ``sampling_probability == 1`` means the whole dataset, no sampling.
    """

    kind: str
    noise_multipliers: tuple[float, ...]
    sampling_probability: float
    count: int

    def same_release(self, other: "_Segment") -> bool:
        return (self.kind, self.noise_multipliers, self.sampling_probability) == (
            other.kind, other.noise_multipliers, other.sampling_probability,
        )

    def dp_event(self) -> dp_accounting.DpEvent:
        gaussian = dp_accounting.GaussianDpEvent(_combined_noise_multiplier(self.noise_multipliers))
        if self.sampling_probability != 1.0:
            gaussian = dp_accounting.PoissonSampledDpEvent(self.sampling_probability, gaussian)
        return dp_accounting.SelfComposedDpEvent(gaussian, self.count)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "noise_multipliers": list(self.noise_multipliers),
            "sampling_probability": self.sampling_probability,
            "count": self.count,
        }


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

    Example:
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
        self._noise_multiplier = _check_noise_multiplier(noise_multiplier)
        self._sampling_probability = _check_sampling_probability(sampling_probability)
        self._accountant = _check_choice("accountant", accountant, ACCOUNTANTS)
        self._sampling = _check_choice("sampling", sampling, SAMPLINGS)
        self._extra = tuple(
            _check_noise_multiplier(s, f"extra_noise_multipliers[{i}]")
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
        n = _check_count("n", n)
        sigma = self._noise_multiplier if noise_multiplier is None else _check_noise_multiplier(noise_multiplier)
        q = self._sampling_probability if sampling_probability is None else _check_sampling_probability(sampling_probability)
        self._record(_Segment(_STEP, (sigma, *self._extra), q, n))

    def compose_gaussian(
        self, noise_multiplier: float, count: int = 1, *, sampling_probability: float = 1.0
    ) -> None:
        """Records ``count`` further Gaussian releases that are not DP-SGD steps.

        For example a noisy statistic of the whole training set
        (``sampling_probability=1``, the default), or one computed on a
        separately Poisson-sampled batch. A quantity computed on the *same*
        batch as a step belongs in ``extra_noise_multipliers`` instead, which
        accounts for it exactly rather than as a separate release.
        """
        sigma = _check_noise_multiplier(noise_multiplier)
        q = _check_sampling_probability(sampling_probability)
        self._record(_Segment(_RELEASE, (sigma,), q, _check_count("count", count)))

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
        return dp_accounting.ComposedDpEvent([s.dp_event() for s in self._segments])

    def epsilon(self, delta: float) -> float:
        """The epsilon spent so far at ``delta``; ``0.0`` before any step.

        Recomputed (and cached) after each change: with ``"pld"`` that is a
        fraction of a second to a few seconds for a long run.
        """
        delta = _check_delta(delta)
        if delta not in self._epsilons:
            self._epsilons[delta] = _epsilon(self._accountant, self.dp_event, delta)
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
            try:
                kind = _check_choice(f"{where}['kind']", seg["kind"], (_STEP, _RELEASE))
                sigmas = tuple(
                    _check_noise_multiplier(s, f"{where}['noise_multipliers']")
                    for s in _as_list(f"{where}['noise_multipliers']", seg["noise_multipliers"])
                )
                q = _check_sampling_probability(seg["sampling_probability"], f"{where}['sampling_probability']")
                count = _check_count(f"{where}['count']", seg["count"])
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
) -> tuple[float, int]:
    """``(q, steps)`` of a planned run, as ``compute_epsilon`` reads its arguments.

    ``q = batch_size / num_examples`` (``sampling_probability``, if given,
    must agree with it); ``steps = ceil(epochs * num_examples / batch_size)``,
    or ``steps`` instead of ``epochs`` (floats are read by their decimal
    repr, so ``epochs=0.1`` is 1/10).

    Raises:
      ValueError: both ``epochs`` and ``steps``, or a ``sampling_probability``
        that disagrees with ``batch_size / num_examples``, or values out of range.

    Example:
      >>> dp_sgd_schedule(60_000, 256, 60)
      (0.004266666666666667, 14063)
    """
    n = _check_positive_int("num_examples", num_examples)
    b = _check_real("batch_size", batch_size)
    if not b > 0:
        raise ValueError(f"batch_size must be > 0; got {batch_size!r}.")
    if b > n:
        raise ValueError(f"batch_size ({batch_size!r}) must be <= num_examples ({num_examples!r}).")
    if sampling_probability is None:
        q = b / n
    else:
        q = _check_sampling_probability(sampling_probability)
        if abs(q - b / n) > 1e-9 * q:
            raise ValueError(
                f"sampling_probability={sampling_probability!r} disagrees with batch_size / num_examples = "
                f"{batch_size!r} / {num_examples!r} = {b / n:.6g}: give one of them consistent with the "
                "other (the expected batch size is q * N), or leave sampling_probability out."
            )
    if steps is not None:
        if epochs is not None:
            raise ValueError(
                f"give epochs or steps, not both (got epochs={epochs!r}, steps={steps!r}): steps would "
                "silently win."
            )
        steps = _check_count("steps", steps)
    else:
        if epochs is None:
            raise ValueError("epochs is required unless steps is given.")
        e = _check_real("epochs", epochs)
        if not e > 0:
            raise ValueError(f"epochs must be > 0; got {epochs!r}.")
        steps = math.ceil(_exact(epochs) * n / _exact(batch_size))
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
) -> float:
    """The epsilon of DP-SGD run for ``epochs`` epochs (or ``steps`` steps).

    With ``q = batch_size / num_examples`` (or ``sampling_probability``) and
    ``T = ceil(epochs * num_examples / batch_size)`` (or ``steps``):

        eps = accountant(PoissonSampled(q, Gaussian(noise_multiplier)) ^ T).get_epsilon(delta)

    ``batch_size`` is the expected batch size ``q * N`` under Poisson
    sampling (it may be fractional). ``sampling="shuffle"`` returns the same
    number, which is only a heuristic for shuffled fixed-size batches, and
    warns (see the module docstring). ``delta >= 1 / num_examples`` warns: a
    mechanism that publishes one random example in full already meets it;
    choose ``delta`` much smaller than ``1 / N``.

    Example:
      >>> eps = compute_epsilon(60_000, 256, 60, 1.1, 1e-5, accountant="rdp")
      >>> 2 < eps < 4
      True
    """
    sigma = _check_noise_multiplier(noise_multiplier)
    q, steps = dp_sgd_schedule(num_examples, batch_size, epochs, steps, sampling_probability)
    delta = check_run_delta(delta, num_examples)
    accountant = _check_choice("accountant", accountant, ACCOUNTANTS)
    if _check_choice("sampling", sampling, SAMPLINGS) == "shuffle":
        warnings.warn(SHUFFLE_WARNING, UserWarning, stacklevel=2)
    return _epsilon(accountant, _dp_sgd_event(sigma, q, steps), delta)


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
) -> float:
    """The smallest noise multiplier whose epsilon is at most ``target_epsilon``.

    Same schedule as ``compute_epsilon``. Epsilon decreases as sigma grows;
    the search brackets the answer by doubling / halving from ``sigma = 1``,
    then runs ``dp_accounting.calibrate_dp_mechanism`` (Brent's method with a
    bisection fallback) on that bracket; with ``"pld"`` it first locates the
    answer with a 10x coarser PLD grid, which is much faster, and then
    searches a narrow bracket with the default grid. The result ``sigma``
    satisfies ``compute_epsilon(..., sigma) <= target_epsilon`` with the same
    accountant and is within ``rtol`` (relative) of the smallest such sigma.

    Example:
      >>> sigma = noise_multiplier_for_epsilon(2.0, 1e-5, 60_000, 256, 5, accountant="rdp")
      >>> compute_epsilon(60_000, 256, 5, sigma, 1e-5, accountant="rdp") <= 2.0
      True
    """
    target = _check_real("target_epsilon", target_epsilon)
    if not target > 0:
        raise ValueError(f"target_epsilon must be > 0; got {target_epsilon!r}.")
    rtol = _check_real("rtol", rtol)
    if not 0 < rtol < 1:
        raise ValueError(f"rtol must be in (0, 1); got {rtol!r}.")
    q, steps = dp_sgd_schedule(num_examples, batch_size, epochs, steps, sampling_probability)
    delta = check_run_delta(delta, num_examples)
    accountant = _check_choice("accountant", accountant, ACCOUNTANTS)
    if _check_choice("sampling", sampling, SAMPLINGS) == "shuffle":
        warnings.warn(SHUFFLE_WARNING, UserWarning, stacklevel=2)
    if steps == 0:
        raise ValueError("steps is 0: no noise is needed for zero steps.")

    def event(sigma: float) -> dp_accounting.DpEvent:
        return _dp_sgd_event(sigma, q, steps)

    try:
        return _search_sigma(accountant, event, target, delta, rtol)
    except _PldTooCostly as e:
        _warn_rdp_fallback(e.event)  # one accountant per search: brackets must not mix them
        return _search_sigma("rdp", event, target, delta, rtol)


# noise_multiplier_for_epsilon searches sigma in this range.
_SIGMA_RANGE = (1e-3, 1e9)


class _PldTooCostly(Exception):
    """A PLD evaluation of the search would exceed ``pld_cost.MAX_PLD_POINTS`` (``event``)."""

    def __init__(self, event):
        super().__init__()
        self.event = event


def _search_sigma(accountant: str, event, target: float, delta: float, rtol: float) -> float:
    """``noise_multiplier_for_epsilon``'s search with one accountant; ``_PldTooCostly`` if PLD would be."""
    # The ends of the searched range first, so an unreachable target fails at
    # once instead of after many evaluations towards it. (At the small end RDP
    # may stand in for PLD: if RDP's epsilon is within the target, PLD's is too.)
    if _epsilon(accountant, event(_SIGMA_RANGE[0]), delta, warn=False) <= target:
        raise ValueError(
            f"target_epsilon={target!r} is met with noise_multiplier below {_SIGMA_RANGE[0]:g}: "
            "that is no privacy to speak of. Choose a smaller target_epsilon."
        )
    if not _epsilon(accountant, event(_SIGMA_RANGE[1]), delta, warn=False) <= target:
        raise ValueError(
            f"target_epsilon={target!r} needs noise_multiplier above {_SIGMA_RANGE[1]:g} for this "
            "run: choose a larger target_epsilon, fewer steps or a smaller batch."
        )
    guess = 1.0
    if accountant == "pld":
        # A coarse PLD (10x faster) finds the neighbourhood; the default one
        # then usually only confirms the bracket [guess / (1 + rtol), guess].
        guess = _calibrate("pld", True, event, target, delta, 1.0, 2.0, 1e-3)
    factor = 2.0 if accountant == "rdp" else 1.0 + rtol
    return _calibrate(accountant, False, event, target, delta, guess, factor, rtol)


def _checked_accountant(name: str, coarse: bool, event: dp_accounting.DpEvent) -> dp_accounting.PrivacyAccountant:
    accountant, used = _accountant_for(name, event, coarse=coarse)
    if used != name:
        raise _PldTooCostly(event)
    return accountant


def _within_budget(name: str, coarse: bool, event: dp_accounting.DpEvent, target: float, delta: float) -> bool:
    accountant = _checked_accountant(name, coarse, event)
    with quiet_accounting():
        return accountant.compose(event).get_epsilon(delta) <= target


def _calibrate(
    name: str,
    coarse: bool,
    event: Callable[[float], dp_accounting.DpEvent],
    target: float,
    delta: float,
    guess: float,
    factor: float,
    rtol: float,
) -> float:
    """The smallest sigma in ``_SIGMA_RANGE`` with ``eps(event(sigma)) <= target``, to ``rtol``.

    Brackets it by multiplying or dividing ``guess`` by ``factor`` (which
    squares after each miss, up to 2), then hands the bracket to
    ``dp_accounting.calibrate_dp_mechanism`` unless it is already narrower
    than ``rtol``. The range's ends are known to bracket the answer.
    """

    def within_budget(sigma: float) -> bool:
        return _within_budget(name, coarse, event(sigma), target, delta)

    if within_budget(guess):
        high, low = guess, guess / factor
        while within_budget(low):
            factor = min(factor * factor, 2.0)
            high, low = low, max(low / factor, _SIGMA_RANGE[0])
    else:
        low, high = guess, guess * factor
        while not within_budget(high):
            factor = min(factor * factor, 2.0)
            low, high = high, min(high * factor, _SIGMA_RANGE[1])
    if high - low <= rtol * low:
        return float(high)
    _checked_accountant(name, coarse, event(low))  # the larger grid of the bracket
    with quiet_accounting():
        return float(
            dp_accounting.calibrate_dp_mechanism(
                lambda: _make_accountant(name, coarse=coarse),
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

    Example:
      >>> round(adaptive_clipping_noise_multiplier(1.0, 5.0), 4)
      1.005
    """
    sigma = _check_real("total_noise_multiplier", total_noise_multiplier)
    if not sigma > 0:
        raise ValueError(f"total_noise_multiplier must be > 0; got {total_noise_multiplier!r}.")
    if expected_batch_size is not None:
        batch = _check_real("expected_batch_size", expected_batch_size)
        if not batch > 0:
            raise ValueError(f"expected_batch_size must be > 0; got {expected_batch_size!r}.")
    if clipped_count_stddev is None:
        if expected_batch_size is None:
            raise ValueError("give clipped_count_stddev, or expected_batch_size for its default expected_batch_size / 20.")
        sigma_b = batch / 20
    else:
        sigma_b = _check_real("clipped_count_stddev", clipped_count_stddev)
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


def _make_accountant(name: str, *, coarse: bool = False) -> dp_accounting.PrivacyAccountant:
    """A fresh accountant with ``dp_accounting``'s defaults (``coarse``: PLD on a 10x coarser grid)."""
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if name == "pld":
        if coarse:
            return pld.PLDAccountant(neighboring_relation=relation, value_discretization_interval=1e-3)
        return pld.PLDAccountant(neighboring_relation=relation)
    return rdp.RdpAccountant(neighboring_relation=relation)


def _dp_sgd_event(sigma: float, q: float, steps: int) -> dp_accounting.DpEvent:
    if steps == 0:
        return dp_accounting.NoOpDpEvent()
    return _Segment(_STEP, (sigma,), q, steps).dp_event()


def _accountant_for(name: str, event: dp_accounting.DpEvent, *, coarse: bool = False) -> tuple[dp_accounting.PrivacyAccountant, str]:
    """``(accountant, name used)``: ``name``'s, or RDP where PLD's grid would exceed ``pld_cost.MAX_PLD_POINTS``.

    RDP's epsilon is never below PLD's, so the answer can only over-report;
    it costs milliseconds whatever the event (``per_example_grads.dp.pld_cost``).
    """
    if name == "pld" and pld_cost.pld_points(event, 1e-3 if coarse else 1e-4) > pld_cost.MAX_PLD_POINTS:
        return _make_accountant("rdp"), "rdp"
    return _make_accountant(name, coarse=coarse), name


def _warn_rdp_fallback(event: dp_accounting.DpEvent) -> None:
    points = pld_cost.pld_points(event)
    gigabytes = "unbounded memory" if math.isinf(points) else f"a grid of about {points:.3g} entries"
    warnings.warn(
        f"the PLD accountant would need {gigabytes} (more than {pld_cost.MAX_PLD_POINTS:.3g}, about 1 GB) "
        "for this run, so epsilon comes from the RDP accountant: a valid upper bound, never below "
        "PLD's, and looser.",
        UserWarning, stacklevel=3,
    )


def _epsilon(accountant: str, event: dp_accounting.DpEvent, delta: float, *, warn: bool = True) -> float:
    """Epsilon of ``event`` with ``accountant``, or with RDP where PLD would be too costly (warned if ``warn``)."""
    used_accountant, used = _accountant_for(accountant, event)
    if used != accountant and warn:
        _warn_rdp_fallback(event)
    with quiet_accounting():
        return float(used_accountant.compose(event).get_epsilon(delta))


def _combined_noise_multiplier(noise_multipliers: Iterable[float]) -> float:
    """Gaussian mechanisms on the same data, as one: ``(sum_k s_k^-2)^(-1/2)``."""
    sigmas = tuple(noise_multipliers)
    if len(sigmas) == 1:
        return sigmas[0]
    if any(s == 0 for s in sigmas):
        return 0.0
    return math.fsum(s**-2 for s in sigmas) ** -0.5


# --------------------------------------------------------------------------
# Argument checks: every error names the argument.
# --------------------------------------------------------------------------


def _exact(x: Any) -> Fraction:
    """``x`` as a fraction, reading floats by their shortest repr (``0.1`` is 1/10)."""
    return Fraction(int(x)) if isinstance(x, numbers.Integral) else Fraction(repr(float(x)))


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number; got {value!r}.")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value!r}.")
    return value


def _check_noise_multiplier(value: Any, name: str = "noise_multiplier") -> float:
    sigma = _check_real(name, value)
    if sigma < 0:
        raise ValueError(f"{name} must be >= 0 (0 means no noise, epsilon = inf); got {value!r}.")
    return sigma


def _check_sampling_probability(value: Any, name: str = "sampling_probability") -> float:
    q = _check_real(name, value)
    if not 0 < q <= 1:
        raise ValueError(f"{name} must be in (0, 1]; got {value!r}.")
    return q


def _check_delta(value: Any) -> float:
    delta = _check_real("delta", value)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1); got {value!r}.")
    return delta


def check_run_delta(value: Any, num_examples: int) -> float:
    delta = _check_delta(value)
    if delta >= 1 / num_examples:
        warnings.warn(
            f"delta={delta:g} is >= 1/num_examples = {1 / num_examples:g}; publishing one "
            "random example in full already satisfies it. Choose delta much smaller than "
            "1/num_examples.",
            UserWarning,
            stacklevel=3,
        )
    return delta


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer; got {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1; got {value!r}.")
    return int(value)


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer; got {value!r}.")
    if value < 0:
        raise ValueError(f"{name} must be >= 0; got {value!r}.")
    return int(value)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}.")
    return value


def _as_list(name: str, value: Any) -> list:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list; got {value!r}.")
    return list(value)
