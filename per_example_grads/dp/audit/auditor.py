"""From canary scores to epsilon lower bounds: the guesses and thresholds an auditor picks, made valid.

``CanaryScoreAuditor(in_scores, out_scores)`` takes one score per canary
(higher: more likely included; the canaries in ``in_scores`` were included in
the training, those in ``out_scores`` were not) and gives:

- ``one_run(delta=...)``: the one-run bound of Steinke, Nasr and Jagielski
  (2023). The auditor guesses "in" for the ``k_in`` highest scores and "out"
  for the ``k_out`` lowest, abstaining on the rest; a guess depends only on
  the scores, never on which canaries were included, as the theorem needs. The
  pair ``(k_in, k_out)`` is the best of a fixed list of ``H`` pairs (both
  ends, or the top only, for 1, 2, 5, 10, 20, 50 and 100 % of the canaries),
  each tested at ``significance / H`` (Bonferroni), so the bound reported
  holds at ``significance`` although the best pair was chosen after seeing
  the scores. Give ``guesses=(k_in, k_out)`` to test one pair at the full
  ``significance``.
- ``threshold_test(delta=...)``: the Gaussian-DP bound of Nasr et al. (2023)
  and the plain Clopper-Pearson one, for the test "in when ``score >=
  threshold``". Give the threshold (fixed before looking at the scores: for
  gradient canaries, half the expected score of an included one), or let the
  auditor choose it on a random half of the canaries (the one maximizing the
  Gaussian-DP bound there) and count its errors on the other half only, so
  the choice does not bias the counts.

Everything here is numpy plus ``per_example_grads.dp.audit.statistics``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from per_example_grads.dp.audit import statistics

GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # of the canaries, for the one-run guesses


@dataclasses.dataclass(frozen=True)
class OneRunBound:
    """The one-run lower bound and the counts it came from.

    Attributes:
      epsilon: the lower bound (0: no claim rejected).
      num_canaries: ``m``, canaries included with probability 1/2 each.
      num_guesses: ``r = guessed_in + guessed_out``.
      num_correct: right guesses among them.
      guessed_in, guessed_out: canaries guessed in (highest scores) and out (lowest).
      delta, significance: of the bound.
      hypotheses: guess pairs compared; each was tested at ``significance / hypotheses``.
    """

    epsilon: float
    num_canaries: int
    num_guesses: int
    num_correct: int
    guessed_in: int
    guessed_out: int
    delta: float
    significance: float
    hypotheses: int


@dataclasses.dataclass(frozen=True)
class ThresholdBound:
    """The bounds of one threshold test ("in when ``score >= threshold``") and its counts.

    Attributes:
      epsilon: the Gaussian-DP lower bound, ``epsilon_for_mu(mu, delta)``
        (assumes a Gaussian trade-off curve and independent canaries).
      mu: the Gaussian-DP ``mu`` ruled out.
      epsilon_clopper_pearson: the bound against ``(epsilon, delta)``-DP
        itself at the same test (no Gaussian assumption; looser).
      threshold: the threshold.
      false_positives, num_out: left-out canaries called "in", of those counted.
      false_negatives, num_in: included canaries called "out", of those counted.
      selected_on: canaries used to choose the threshold, and not counted (0
        when it was given).
      delta, significance: of the bounds.
    """

    epsilon: float
    mu: float
    epsilon_clopper_pearson: float
    threshold: float
    false_positives: int
    num_out: int
    false_negatives: int
    num_in: int
    selected_on: int
    delta: float
    significance: float


def _scores(name: str, values) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite; got {int(np.sum(~np.isfinite(array)))} NaN or infinite values.")
    return array


class CanaryScoreAuditor:
    """Epsilon lower bounds from the scores of included and left-out canaries.

    Args:
      in_scores: ``[m_in]`` scores of the canaries the training included.
      out_scores: ``[m_out]`` scores of those it left out. Higher scores must
        mean "more likely included" (for a loss, pass its negative).
      num_canaries: ``m`` of the one-run bound, the canaries whose inclusion
        was randomized; default ``m_in + m_out``.

    Examples:
      >>> auditor = CanaryScoreAuditor(np.arange(500) + 400.0, np.arange(500))
      >>> bound = auditor.one_run(delta=1e-5)
      >>> bound.num_correct == bound.num_guesses, bound.epsilon > 2
      (True, True)
      >>> test = auditor.threshold_test(delta=1e-5, threshold=450.0)
      >>> test.false_positives, test.false_negatives
      (50, 50)
    """

    def __init__(self, in_scores, out_scores, *, num_canaries: int | None = None):
        self.in_scores = _scores("in_scores", in_scores)
        self.out_scores = _scores("out_scores", out_scores)
        m = len(self.in_scores) + len(self.out_scores)
        if m == 0:
            raise ValueError("in_scores and out_scores are both empty: an audit needs canaries.")
        if num_canaries is None:
            num_canaries = m
        if isinstance(num_canaries, bool) or int(num_canaries) != num_canaries or num_canaries < m:
            raise ValueError(f"num_canaries must be an integer >= the {m} scores given; got {num_canaries!r}.")
        self.num_canaries = int(num_canaries)

    def _ranked(self) -> np.ndarray:
        """``[m]`` booleans, True for included canaries, ordered from the highest score to the lowest."""
        scores = np.concatenate([self.in_scores, self.out_scores])
        included = np.concatenate([np.ones(len(self.in_scores), bool), np.zeros(len(self.out_scores), bool)])
        order = np.argsort(-scores, kind="stable")  # ties: by position, which does not depend on the outcome
        return included[order]

    def guess_pairs(self) -> list[tuple[int, int]]:
        """The ``(k_in, k_out)`` pairs ``one_run`` compares: both ends, or the top only, for each of ``GUESS_FRACTIONS``."""
        m = len(self.in_scores) + len(self.out_scores)
        pairs: list[tuple[int, int]] = []
        for fraction in GUESS_FRACTIONS:
            r = max(1, int(round(fraction * m)))
            for pair in ((r - r // 2, r // 2), (r, 0)):
                if pair not in pairs and (fraction < 1.0 or pair[1] > 0):
                    pairs.append(pair)
        return pairs

    def one_run(
        self, *, delta: float, significance: float = 0.05, guesses: tuple[int, int] | None = None
    ) -> OneRunBound:
        """The one-run lower bound (``statistics.epsilon_one_run``) of the best guess pair.

        Args:
          delta: the delta of the claims tested.
          significance: the chance, if the training was ``(epsilon*, delta)``-DP,
            that the bound exceeds ``epsilon*``.
          guesses: ``(k_in, k_out)`` to test one pair only; default: the best
            of ``guess_pairs()``, each at ``significance / len(pairs)``.

        Raises:
          ValueError: ``guesses`` not two non-negative integers summing to at
            most the number of scores, or ``delta``/``significance`` out of range.
        """
        delta = statistics.check_delta(delta)
        alpha = statistics.check_significance(significance)
        ranked = self._ranked()
        m = len(ranked)
        if guesses is None:
            pairs = self.guess_pairs()
        else:
            k_in, k_out = (int(g) for g in guesses)
            if k_in < 0 or k_out < 0 or k_in + k_out > m or k_in + k_out == 0:
                raise ValueError(f"guesses must be (k_in, k_out) >= 0 with 0 < k_in + k_out <= {m}; got {guesses!r}.")
            pairs = [(k_in, k_out)]
        level = alpha / len(pairs)
        best = None
        for k_in, k_out in pairs:
            correct = int(ranked[:k_in].sum()) + int((~ranked[m - k_out :]).sum())
            epsilon = statistics.epsilon_one_run(
                self.num_canaries, k_in + k_out, correct, delta=delta, significance=level
            )
            if best is None or epsilon > best.epsilon:
                best = OneRunBound(
                    epsilon, self.num_canaries, k_in + k_out, correct, k_in, k_out, delta, alpha, len(pairs)
                )
        return best

    def threshold_test(
        self, *, delta: float, significance: float = 0.05, threshold: float | None = None, seed: int = 0
    ) -> ThresholdBound:
        """The Gaussian-DP and Clopper-Pearson bounds of the test "in when ``score >= threshold``".

        Args:
          delta: the delta of the epsilon bounds, in ``(0, 1)``.
          significance: both rates' Clopper-Pearson bounds hold together with
            probability at least ``1 - significance`` (``significance / 2`` each).
          threshold: fixed in advance; None chooses it on a random half of the
            canaries (from ``seed``), maximizing the Gaussian-DP ``mu`` there,
            and counts on the other half.

        Raises:
          ValueError: ``delta`` or ``significance`` out of range.
        """
        delta = statistics._probability("delta", delta, closed_low=False)
        alpha = statistics.check_significance(significance)
        ins, outs = self.in_scores, self.out_scores
        selected_on = 0
        if threshold is None:
            rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x7468726573]))  # "thres"
            pick_in, pick_out = rng.random(len(ins)) < 0.5, rng.random(len(outs)) < 0.5
            threshold = self._best_threshold(ins[pick_in], outs[pick_out], alpha)
            selected_on = int(pick_in.sum() + pick_out.sum())
            ins, outs = ins[~pick_in], outs[~pick_out]
        threshold = float(threshold)
        fp, fn = statistics.threshold_counts(ins, outs, [threshold])
        fp, fn = int(fp[0]), int(fn[0])
        if len(ins) == 0 or len(outs) == 0:
            mu = 0.0
            eps_cp = 0.0
        else:
            mu = statistics.mu_gaussian_dp(fp, fn, num_out=len(outs), num_in=len(ins), significance=alpha)
            eps_cp = statistics.epsilon_clopper_pearson(
                fp, fn, num_out=len(outs), num_in=len(ins), delta=delta, significance=alpha
            )
        return ThresholdBound(
            statistics.epsilon_for_mu(mu, delta),
            mu,
            eps_cp,
            threshold,
            fp,
            len(outs),
            fn,
            len(ins),
            selected_on,
            delta,
            alpha,
        )

    @staticmethod
    def _best_threshold(ins: np.ndarray, outs: np.ndarray, alpha: float) -> float:
        """The threshold (one of the scores given) whose Gaussian-DP ``mu`` bound on these canaries is largest; the median if none is above 0."""
        candidates = np.unique(np.concatenate([ins, outs]))
        if len(candidates) == 0 or len(ins) == 0 or len(outs) == 0:
            return math.inf
        fp, fn = statistics.threshold_counts(ins, outs, candidates)
        mus = statistics.threshold_mus(fp, fn, num_out=len(outs), num_in=len(ins), significance=alpha)
        if not np.max(mus) > 0:  # no threshold separates anything: report the median one's counts
            return float(np.median(np.concatenate([ins, outs])))
        return float(candidates[int(np.argmax(mus))])
