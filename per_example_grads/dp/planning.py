"""Choosing a noise mechanism for a planned run: the least noise at the run's epsilon, amplification counted.

At a target ``(epsilon, delta)``, each candidate's noise multiplier
``sigma`` is calibrated by the accounting of the batches it would train on
(``noise_multiplier_for_epsilon`` with the mechanism):

- DP-SGD on Poisson batches at ``q = B / N``;
- ``BandMF(b)`` on ``b`` cyclic parts, each step a Poisson sample of the part
  in turn at ``q = b B / N`` (amplified: ``ceil(T / b)`` DP-SGD steps);
- ``BLT(d)`` and ``BISR(p)`` (``dp.bisr``) on whole parts (``cycle_length
  = floor(N / B)``, ``q = 1``, so ``N / floor(N / B) >= B`` examples a
  step): their accounting is one Gaussian release of their sensitivity,
  which sampling does not lower, so the longest cycle (fewest
  participations) is their best; with ``monte_carlo=True`` they are
  calibrated instead by ``monte_carlo_noise_multiplier``, which counts each
  example's random part (minutes per candidate), still on whole parts:
  shorter cycles at ``q < 1`` moved BLT(2)'s error by -1% to +3% in the
  correlated-noise guide's measurement, at 5-12 times the calibration time.

A mechanism adds ``sigma C^{-1} z`` (``z`` standard normal) to the clipped
sums, so the root-mean-square noise of the run's ``n`` prefix sums (what
SGD's iterates integrate) is

    error = sigma * ||A C^{-1}||_F / sqrt(n)      (``mechanisms.prefix_sum_error``)

with ``A`` the all-ones lower-triangular matrix; DP-SGD's is ``sigma
sqrt((n + 1) / 2)``. Candidates are ranked by it: the amplified figure of
merit that Choquette-Choo et al. (NeurIPS 2023, "(Amplified) Banded Matrix
Factorization: A unified approach to private training", arXiv 2306.08153)
choose BandMF's bands by. It is a proxy for utility, not a measurement:
``docs/guides/correlated-noise.md`` compares it with this library's
test accuracies at equal epsilon, and states where it does not apply
(adaptive optimizers such as Adam see each step's noise, which correlation
makes larger).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from per_example_grads._core.arguments import check_positive_int
from per_example_grads.dp.accounting import noise_multiplier_for_epsilon


@dataclasses.dataclass(frozen=True)
class MechanismChoice:
    """One candidate of ``rank_mechanisms``, with what a run needs to train with it.

    Attributes:
      mechanism: the ``NoiseMechanism`` (a ``GaussianNoise`` for DP-SGD),
        built for the planned steps.
      noise_multiplier: ``sigma`` at the target epsilon.
      cycle_length: ``poisson_batches(..., cycle_length=...)``.
      sampling_probability: ``poisson_batches(..., sampling_probability=...)``,
        the rate of the part in turn.
      error: ``sigma * prefix_sum_error(mechanism, steps)``, the ranking's key.
      accounting: ``"pld"``/``"rdp"`` (the ledger's accountant), or
        ``"monte_carlo"``.
    """

    mechanism: object
    noise_multiplier: float
    cycle_length: int
    sampling_probability: float
    error: float
    accounting: str

    @property
    def name(self) -> str:
        """``"DP-SGD"``, ``"BandMF(b)"``, ``"BLT(d)"``, ``"BISR(p)"``."""
        from per_example_grads.dp.bisr import BISR

        m = self.mechanism
        if isinstance(m, BISR):
            return f"BISR({m.bands})"
        if hasattr(m, "bands"):
            return f"BandMF({m.bands})"
        if hasattr(m, "buffers"):
            return f"BLT({m.buffers})"
        return "DP-SGD"


def _powers_of_two(limit: int) -> tuple[int, ...]:
    return tuple(2**k for k in range(1, int(math.log2(limit)) + 1)) if limit >= 2 else ()


def rank_mechanisms(
    target_epsilon: float,
    delta: float,
    num_examples: int,
    batch_size: int,
    steps: int,
    *,
    bands: Sequence[int] | None = None,
    blt_buffers: Sequence[int] | None = None,
    bisr_bands: Sequence[int] = (),
    monte_carlo: bool = False,
    accountant: str = "pld",
    progress: bool = True,
) -> list[MechanismChoice]:
    """DP-SGD, BandMF, BLT (and BISR if asked) for a planned run, each calibrated to ``target_epsilon``, least error first.

    See the module docstring for the sampling each is calibrated on and the
    error it is ranked by.

    Args:
      target_epsilon, delta: the run's target.
      num_examples: ``N``.
      batch_size: the expected batch size ``B`` every candidate trains with.
      steps: the planned number of steps ``n`` (each mechanism is optimized
        for it).
      bands: BandMF's candidate band counts, each at most ``N / B`` (its
        cycle) and ``steps``; default the powers of two up to both. DP-SGD
        is always a candidate.
      blt_buffers: BLT's candidate buffer counts (``()`` for none); BLT needs
        ``N / B <= steps`` for a cycle within the run. Default ``(2,)`` where
        it has one, else none.
      bisr_bands: BISR's candidate band counts, on whole parts as BLT (the
        same cycle within the run needed); default none.
      monte_carlo: calibrate BLT and BISR by Monte Carlo (the random part
        counted; minutes each, seeded 0) instead of their ledger accounting.
      accountant: ``"pld"`` or ``"rdp"`` for the ledger's calibrations.
      progress: a progress bar over the candidates.

    Returns:
      ``MechanismChoice`` per candidate, sorted by ``error``.

    Raises:
      ValueError: naming the argument, for a band count above ``N / B`` or
        ``steps``, a BLT or BISR with no cycle within the run, or what
        ``noise_multiplier_for_epsilon`` refuses.

    Example (1,000 examples, batches of 10, 100 steps, epsilon 2):

      >>> ranked = rank_mechanisms(2.0, 1e-5, 1000, 10, 100, bands=[4], blt_buffers=(), progress=False)
      >>> [(c.name, round(c.noise_multiplier, 2), round(c.error, 1)) for c in ranked]
      [('BandMF(4)', 0.95, 3.7), ('DP-SGD', 0.74, 5.2)]
    """
    from tqdm.auto import tqdm

    from per_example_grads.dp import mechanisms
    from per_example_grads.dp.bisr import BISR
    from per_example_grads.dp.monte_carlo import monte_carlo_noise_multiplier

    n = check_positive_int("num_examples", num_examples)
    b = check_positive_int("batch_size", batch_size)
    steps = check_positive_int("steps", steps)
    parts = n // b  # the most cyclic parts of B expected examples
    if parts < 1:
        raise ValueError(f"batch_size ({batch_size}) must be at most num_examples ({num_examples}).")
    bands = _powers_of_two(min(parts, steps)) if bands is None else tuple(bands)
    for k in bands:
        if check_positive_int("bands", k) > min(parts, steps):
            raise ValueError(
                f"bands={k} needs {k} cyclic parts of batch_size examples each and at most steps bands: at most "
                f"min(num_examples // batch_size, steps) = {min(parts, steps)} here."
            )
    if blt_buffers is None:
        blt_buffers = (2,) if parts <= steps else ()
    blt_buffers = tuple(check_positive_int("blt_buffers", d) for d in blt_buffers)
    bisr_bands = tuple(check_positive_int("bisr_bands", p) for p in bisr_bands)
    for name, given, what in (("blt_buffers", blt_buffers, "BLT"), ("bisr_bands", bisr_bands, "BISR")):
        if given and parts > steps:
            raise ValueError(
                f"{name}: {what} trains on whole parts (cycle num_examples // batch_size = {parts}), which needs "
                f"steps >= {parts}; got steps={steps}. Leave {what} out of a run shorter than an epoch."
            )

    candidates = [("dpsgd", 1)] + [("bandmf", k) for k in bands if k > 1]
    candidates += [("blt", d) for d in blt_buffers] + [("bisr", p) for p in bisr_bands]
    choices = []
    for kind, k in tqdm(candidates, desc="Calibrating mechanisms", unit="mechanism", disable=not progress):
        batch = b
        if kind in ("blt", "bisr"):  # built here, not up front: optimizing a BLT takes seconds
            build = mechanisms.BLT if kind == "blt" else BISR
            mechanism, cycle = build(k, num_steps=steps, cycle_length=parts), parts
            batch = n / parts  # whole parts (q = 1): N / parts >= B examples a step
        else:
            mechanism, cycle = (mechanisms.BandMF(bands=k, num_steps=steps), k) if k > 1 else (None, 1)
        q = min(1.0, batch * cycle / n)
        if kind in ("blt", "bisr") and monte_carlo:
            result = monte_carlo_noise_multiplier(mechanism, target_epsilon, steps, delta=delta, seed=0)
            sigma, accounting = result.noise_multiplier, "monte_carlo"
        else:
            sigma = noise_multiplier_for_epsilon(
                target_epsilon, delta, n, batch, None, steps=steps, mechanism=mechanism, accountant=accountant
            )
            accounting = accountant
        mechanism = mechanism or mechanisms.GaussianNoise()
        error = sigma * mechanisms.prefix_sum_error(mechanism, steps)
        choices.append(MechanismChoice(mechanism, float(sigma), cycle, q, float(error), accounting))
    return sorted(choices, key=lambda c: c.error)


__all__ = ["MechanismChoice", "rank_mechanisms"]
