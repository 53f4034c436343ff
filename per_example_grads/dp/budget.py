"""``PrivacyBudget``: the most a DP training run may spend, as a number of steps.

A budget is either a target ``(epsilon, delta)`` or a number of steps. Both
become one number, ``max_steps``: the most DP-SGD steps the run may take.
For a target, that is the largest ``T`` with

    accountant( PoissonSampled(q, Gaussian(sigma)) ^ T ).get_epsilon(delta) <= epsilon

for the run's noise multiplier ``sigma`` and sampling probability ``q`` (the
same event ``DPModel.epsilon`` reports, through ``dp_accounting``). Epsilon
grows with ``T``, so the largest such ``T`` is found by bisection: first with
the RDP accountant, whose epsilon is never below PLD's (so its ``T`` is within
a PLD budget too), then, for ``accountant="pld"``, upwards from there with
PLD until the bracket is within ``rtol`` of its lower end. The answer is
always a ``T`` whose epsilon is at most the target with the chosen
accountant; it may be a few steps short of the largest (at most ``rtol``).

``DPModel(..., budget=PrivacyBudget(...))`` never takes a step past
``max_steps``, nor ``GradientAccumulator(..., budget=...)`` a release: the
ledger counts every step taken, restored runs included, so a run restored
from a checkpoint stops at the same total.

This module imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

from per_example_grads._core.arguments import check_choice, check_count, check_delta, check_real
from per_example_grads.dp.accounting import ACCOUNTANTS, MAX_STEPS, PrivacyAccountant, truncated_poisson_event

# The largest number of steps a budget is searched up to.
MAX_SEARCHED_STEPS = 10**9


@dataclasses.dataclass(frozen=True)
class PrivacyBudget:
    """The most a run may spend: ``epsilon`` at ``delta``, or ``steps`` DP-SGD steps.

    Args:
      epsilon: target epsilon ``> 0`` (with ``delta``).
      delta: its delta, in (0, 1).
      steps: a number of steps instead (``>= 0``).
      accountant: ``"pld"`` (default, as ``DPModel.epsilon``) or ``"rdp"``
        (searches faster; its epsilon is never below PLD's, so it allows
        fewer steps).
      rtol: how far below the largest allowed number of steps the answer
        may fall, relatively (default 1%).

    Examples:
      >>> budget = PrivacyBudget(epsilon=2.0, delta=1e-5, accountant="rdp")
      >>> steps = budget.max_steps(noise_multiplier=1.1, sampling_probability=0.01)
      >>> from per_example_grads.dp.accounting import compute_epsilon
      >>> compute_epsilon(10_000, 100, None, 1.1, 1e-5, steps=steps, accountant="rdp") <= 2.0
      True
      >>> PrivacyBudget(steps=500).max_steps(noise_multiplier=1.1, sampling_probability=0.01)
      500
    """

    epsilon: float | None = None
    delta: float | None = None
    steps: int | None = None
    accountant: str = "pld"
    rtol: float = 0.01

    def __post_init__(self):
        if self.steps is not None:
            if self.epsilon is not None or self.delta is not None:
                raise ValueError("PrivacyBudget takes either steps or (epsilon, delta), not both.")
            check_count("steps", self.steps, MAX_STEPS)
        elif self.epsilon is None or self.delta is None:
            raise ValueError("PrivacyBudget needs epsilon and delta, or steps.")
        else:
            if not check_real("epsilon", self.epsilon) > 0:
                raise ValueError(f"epsilon must be > 0; got {self.epsilon!r}.")
            check_delta(self.delta)
        check_choice("accountant", self.accountant, ACCOUNTANTS)
        if not 0 < check_real("rtol", self.rtol) < 1:
            raise ValueError(f"rtol must be in (0, 1); got {self.rtol!r}.")

    def max_steps(
        self,
        *,
        noise_multiplier: float,
        sampling_probability: float,
        mechanism: Any = None,
        taken: Sequence[tuple] = (),
        truncation: tuple[int, int] = (0, 0),
    ) -> int:
        """The most steps this budget allows at ``(sigma, q)``: ``steps``, or the search above.

        The search counts Poisson-sampled steps; fixed-size batches are
        accounted with the same numbers (``sampling="shuffle"``, a heuristic).
        With a noise ``mechanism`` (``per_example_grads.dp.mechanisms``), steps
        are accounted as it says (``mechanism.dp_event``).

        ``taken``: steps a run has already taken, as ``(steps, sigma, q)``
        runs in order, or ``(steps, sigma, q, B, N)`` (a ledger's segments,
        ``per_example_grads.dp.ledger``: ``B > 0`` a truncated Poisson run),
        for a mechanism whose steps compose one by one (not a correlated
        one). The answer is then the most steps in total: those, then more at
        ``(sigma, q)``, each run accounted as the mechanism says and composed,
        as ``DPModel.epsilon`` accounts them; it is ``sum(steps)`` when they
        alone reach the budget. ``truncation``: ``(B, N)`` when the further
        steps are truncated Poisson samples (DP-SGD's noise only).
        """
        if self.steps is not None:
            return int(self.steps)
        if mechanism is not None:
            from per_example_grads.dp.mechanisms import check_mechanism  # keras layers: imported where one is given

            mechanism = check_mechanism(mechanism)
        return _max_steps(
            float(self.epsilon),
            float(self.delta),
            float(noise_multiplier),
            float(sampling_probability),
            self.accountant,
            float(self.rtol),
            mechanism,
            tuple((int(n), float(s), float(r), *(int(v) for v in (rest or (0, 0)))) for n, s, r, *rest in taken),
            tuple(int(v) for v in truncation),
        )

    def describe(self) -> str:
        """``"epsilon = 2 at delta = 1e-05"`` or ``"500 steps"``, for messages."""
        if self.steps is not None:
            return f"{self.steps} steps"
        return f"epsilon = {self.epsilon:g} at delta = {self.delta:g}"


@functools.lru_cache(maxsize=64)
def _max_steps(epsilon, delta, sigma, q, accountant, rtol, mechanism=None, taken=(), truncation=(0, 0)) -> int:
    done = sum(n for n, *_ in taken)
    if sigma == 0:
        return done

    def within(name: str, total: int) -> bool:
        ledger = PrivacyAccountant(sigma, q, accountant=name, sampling="poisson")
        for n, s, rate, b, size in [*taken, (total - done, sigma, q, *truncation)]:
            if n and b > 0:  # a truncated Poisson run (DP-SGD's noise)
                ledger.record_event(truncated_poisson_event(s, rate, b, size, n))
            elif mechanism is None:
                ledger.step(n, noise_multiplier=s, sampling_probability=rate)
            elif n:
                ledger.record_event(mechanism.dp_event(s, rate, n))
        return ledger.epsilon(delta) <= epsilon

    first = done + 1
    if not within("rdp", first) and (accountant == "rdp" or not within(accountant, first)):
        return done
    low = _largest("rdp", within, first, rtol if accountant == "rdp" else 0.05)
    if accountant == "rdp":
        return low
    # A truncated run's RDP epsilon is its dominating event's, not a bound on PLD's: the start is checked.
    if any(b > 0 for *_, b, _ in [*taken, (*truncation,)]) and not within(accountant, low):
        if low == first or not within(accountant, first):
            return done
        low = first
    return _largest(accountant, within, low, rtol)


def _largest(name: str, within, low: int, rtol: float) -> int:
    """The largest ``T >= low`` (``low`` within budget) with ``within(name, T)``, to ``rtol``: doubling, then bisection."""
    high = low
    while True:
        high = min(2 * high, MAX_SEARCHED_STEPS)
        if not within(name, high):
            break
        low = high
        if high == MAX_SEARCHED_STEPS:
            return high
    while high - low > max(1, math.floor(rtol * low)):
        middle = (low + high) // 2
        if within(name, middle):
            low = middle
        else:
            high = middle
    return low
