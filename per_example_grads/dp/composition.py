"""Which parts of a DP step combine: every refused pairing, in one table, checked in one place.

A DP step is made of parts: the noise mechanism (independent or correlated
noise), the clipping (fixed or adaptive, flat or per layer, per example or
per unit, in physical chunks or not), sparse embedding noise, the sampling of
the data, an audit's canaries, and where it runs (replicas, XLA). Each front
door (``DPModel``, ``GradientAccumulator``, ``private_gradients``,
``DPAggregator``, ``audit``) describes the parts it was given as ``Parts``
and calls ``check``, which refuses the first pairing of ``PAIRINGS`` that
applies with one message naming both parts, why they do not combine and what
to do instead::

    DPModel: adaptive_clipping cannot be combined with a correlated mechanism (BandMF): ...

A pairing is refused for one of two reasons, said in its ``why``: its privacy
is not accounted (the accounting of one part assumes what the other breaks),
or it is not implemented. Pairings absent from the table combine; each
combination's test is in ``tests/test_dp_composition.py``. Checks of one
argument's value, of a value that must agree with the data (``num_examples``,
``expected_batch_size``) and of a restored ledger stay with the argument or
the ledger.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What ``DPModel.fit`` knows of its data's sampling.

    Attributes:
      poisson: the data is a ``poisson_batches`` or ``min_sep_batches``
        dataset (else fixed-size batches, or a dataset of unknown sampling).
      cycle_length: its ``cycle_length`` (1 without a cycle, or not Poisson);
        a ``min_sep_batches`` dataset's ``min_separation``.
      scheme: ``"poisson"``, ``"min_sep"``, ``"truncated_poisson"`` or
        ``"fixed_size"`` (the sampler's ``scheme``).
      units: it samples units (``unit_ids``).
      rows_per_unit: its rows per unit, or None.
    """

    poisson: bool
    cycle_length: int = 1
    scheme: str = "poisson"
    units: bool = False
    rows_per_unit: int | None = None


@dataclasses.dataclass(frozen=True)
class Parts:
    """The parts a front door was given.

    Attributes:
      owner: the front door, for messages (``"DPModel"``, ...).
      mechanism: the ``NoiseMechanism``, or None (DP-SGD's independent noise).
      private: DP mode (a ``GradientAccumulator`` without ``l2_norm_clip`` is plain).
      adaptive: adaptive clipping.
      per_layer: a per-layer ``l2_norm_clip`` (a dict or list).
      units: per-unit clipping (``privacy_unit="unit"``).
      chunks: ``physical_batch_size``, or None.
      sparse: sparse embedding noise.
      budget: a ``PrivacyBudget`` is given.
      audit: an audit's canaries: ``"gradient"`` (they join the release),
        ``"input"`` (examples in the data), or None.
      replicas: replicas in sync.
      xla: the step is compiled with XLA.
      sampling: the data's ``Sampling``, where it is known (``fit``).
      user_rows: per-user accounting of example-level sampling was asked for,
        with at most this many rows per user (``epsilon(rows_per_user=...)``).
      monte_carlo: Monte-Carlo accounting of the run was asked for
        (``monte_carlo_epsilon``).
      truncated: the run's ledger holds truncated Poisson steps (known when
        it is accounted; at ``fit``, the data's ``Sampling`` says it).
    """

    owner: str
    mechanism: Any = None
    private: bool = True
    adaptive: bool = False
    per_layer: bool = False
    units: bool = False
    chunks: int | None = None
    sparse: bool = False
    budget: bool = False
    audit: str | None = None
    replicas: int = 1
    xla: bool = False
    sampling: Sampling | None = None
    user_rows: int | None = None
    monte_carlo: bool = False
    truncated: bool = False

    @property
    def correlated(self) -> bool:
        return bool(getattr(self.mechanism, "correlated", False))

    @property
    def cycle_length(self) -> int:
        return int(getattr(self.mechanism, "cycle_length", 1))

    def mechanism_name(self) -> str:
        return type(self.mechanism).__name__

    @property
    def truncated_sampling(self) -> bool:
        """Truncated Poisson sampling, in the data (``fit``) or in the ledger (accounting)."""
        return self.truncated or (self.sampling is not None and self.sampling.scheme == "truncated_poisson")


@dataclasses.dataclass(frozen=True)
class Pairing:
    """Two parts that do not combine.

    Attributes:
      first, second: ``Parts -> str``, the two parts as the message names them.
      applies: ``Parts -> bool``, whether the parts hold both.
      why: ``Parts -> str``, why they do not combine.
      instead: ``Parts -> str``, what to do.
    """

    first: Callable[[Parts], str]
    second: Callable[[Parts], str]
    applies: Callable[[Parts], bool]
    why: Callable[[Parts], str]
    instead: Callable[[Parts], str]

    def message(self, parts: Parts) -> str:
        return (
            f"{parts.owner}: {self.first(parts)} cannot be combined with {self.second(parts)}: "
            f"{self.why(parts)}. {self.instead(parts)}"
        )


def _text(s: str) -> Callable[[Parts], str]:
    return lambda parts: s


_CORRELATED = lambda p: f"a correlated mechanism ({p.mechanism_name()})"  # noqa: E731
_UNITS = _text("privacy_unit='unit'")
_REPLICAS = lambda p: f"{p.replicas} replicas"  # noqa: E731

PAIRINGS: tuple[Pairing, ...] = (
    # -- DP mode -------------------------------------------------------------------------
    Pairing(
        _UNITS,
        _text("plain mode (no l2_norm_clip)"),
        lambda p: p.units and not p.private,
        _text("without clipping, units change nothing"),
        _text("Give l2_norm_clip (DP mode), or leave privacy_unit out."),
    ),
    Pairing(
        _text("sparse_embeddings"),
        _text("plain mode (no l2_norm_clip)"),
        lambda p: p.sparse and not p.private,
        _text("sparse embedding noise is noise of a DP step"),
        _text("Give l2_norm_clip (DP mode), or leave sparse_embeddings out."),
    ),
    # -- noise ----------------------------------------------------------------------------
    Pairing(
        _text("adaptive_clipping"),
        _CORRELATED,
        lambda p: p.adaptive and p.correlated,
        _text(
            "the correlated noise mixes the draws of several steps, whose std would differ as the clip norm "
            "moves, which the mechanism's accounting does not cover"
        ),
        _text("Give a fixed l2_norm_clip, or use GaussianNoise (DP-SGD)."),
    ),
    Pairing(
        _text("sparse_embeddings"),
        _CORRELATED,
        lambda p: p.sparse and p.correlated,
        _text(
            "its noise mixes the draws of several steps, and a step's row selection would then depend on earlier "
            "gradient noise, which the one-Gaussian-mechanism accounting of the selection does not cover"
        ),
        _text("Use GaussianNoise (DP-SGD) with sparse_embeddings, or dense noise with the correlated mechanism."),
    ),
    Pairing(
        _text("sparse_embeddings"),
        _text("adaptive_clipping"),
        lambda p: p.sparse and p.adaptive,
        _text("both split the noise budget, and their composition is not accounted"),
        _text("Use a fixed l2_norm_clip."),
    ),
    # -- clipping -------------------------------------------------------------------------
    Pairing(
        _text("adaptive_clipping"),
        _text("a per-layer l2_norm_clip"),
        lambda p: p.adaptive and p.per_layer,
        _text("adaptive clipping moves one flat clip norm, and the per-layer norms would be ignored"),
        _text("Give a single l2_norm_clip (adaptive_clipping's initial_l2_norm_clip is its start)."),
    ),
    Pairing(
        _text("physical_batch_size"),
        _text("a per-layer l2_norm_clip"),
        lambda p: p.chunks is not None and p.per_layer,
        _text("physical chunks are implemented for a single (flat) clip norm only"),
        _text("Give a single l2_norm_clip, or leave physical_batch_size out."),
    ),
    Pairing(
        _UNITS,
        _text("adaptive_clipping"),
        lambda p: p.units and p.adaptive,
        _text("adaptive clipping's noisy count is of examples, and the accounting is per unit"),
        _text("Give a fixed l2_norm_clip."),
    ),
    Pairing(
        _text("sparse_embeddings"),
        _UNITS,
        lambda p: p.sparse and p.units,
        _text("its noisy lookup counts bound one example's contribution, not one unit's"),
        _text("Use privacy_unit='example' with sparse_embeddings, or dense noise per unit."),
    ),
    # -- where it runs ------------------------------------------------------------------------
    Pairing(
        _UNITS,
        _REPLICAS,
        lambda p: p.units and p.replicas > 1 and p.owner == "GradientAccumulator",
        _text("a unit's rows could be clipped in parts on two replicas"),
        _text("Use DPModel(privacy_unit='unit'), which keeps units whole across replicas."),
    ),
    Pairing(
        _text("sparse_embeddings"),
        _REPLICAS,
        lambda p: p.sparse and p.replicas > 1 and p.owner == "GradientAccumulator",
        _text("the accumulated row selection is kept on one replica only"),
        _text("Use DPModel(sparse_embeddings=...)."),
    ),
    Pairing(
        _UNITS,
        _text("XLA (jit_compile=True)"),
        lambda p: p.units and p.xla,
        _text("the engine's grouped clipped sums have data-dependent shapes"),
        _text("Compile with jit_compile=False."),
    ),
    Pairing(
        _text("sparse_embeddings"),
        _text("XLA (jit_compile=True)"),
        lambda p: p.sparse and p.xla,
        _text("the number of selected rows varies from step to step"),
        _text("Compile with jit_compile=False."),
    ),
    Pairing(
        _text("budget"),
        _CORRELATED,
        lambda p: p.budget and (p.correlated or p.cycle_length > 1) and p.owner == "GradientAccumulator",
        lambda p: (
            f"{p.mechanism_name()}'s accounting assumes each example joins at most one step in every "
            f"{p.cycle_length}, which the accumulator cannot see, so it cannot count what its releases spend"
        ),
        _text("Use DPModel(budget=...) on poisson_batches(..., cycle_length=...), or stop by steps yourself."),
    ),
    # -- per-user accounting of example-level sampling (accounting.user_level_event) -------------
    Pairing(
        _text("rows_per_user"),
        _UNITS,
        lambda p: p.user_rows is not None and p.units,
        _text("the run clips and samples units already, and its epsilon() is per unit"),
        _text("Leave rows_per_user out."),
    ),
    Pairing(
        _text("rows_per_user"),
        _CORRELATED,
        lambda p: p.user_rows is not None and (p.correlated or p.cycle_length > 1),
        _text("the per-user mixture of Gaussians accounts independent noise on Poisson-sampled rows"),
        _text("Account a GaussianNoise (DP-SGD) run per user, or train with privacy_unit='unit'."),
    ),
    Pairing(
        _text("rows_per_user"),
        _text("adaptive_clipping"),
        lambda p: p.user_rows is not None and p.adaptive,
        _text("the noisy clipped count moves by up to a user's rows, which its split of the noise does not cover"),
        _text("Give a fixed l2_norm_clip."),
    ),
    Pairing(
        _text("rows_per_user"),
        _text("sparse_embeddings"),
        lambda p: p.user_rows is not None and p.sparse,
        _text("its noisy lookup counts bound one example's contribution, not one user's"),
        _text("Leave sparse_embeddings out, or train with privacy_unit='unit'."),
    ),
    # -- Monte-Carlo accounting (monte_carlo: the pair of the mechanism's clipped sums alone) ----
    Pairing(
        _text("monte_carlo_epsilon"),
        _text("adaptive_clipping"),
        lambda p: p.monte_carlo and p.adaptive,
        _text("every step also releases a noisy clipped count, which the Monte-Carlo pair leaves out"),
        _text("Use epsilon(), or give a fixed l2_norm_clip."),
    ),
    Pairing(
        _text("monte_carlo_epsilon"),
        _text("sparse_embeddings"),
        lambda p: p.monte_carlo and p.sparse,
        _text("its noisy lookup counts are a release the Monte-Carlo pair leaves out"),
        _text("Use epsilon(), or leave sparse_embeddings out."),
    ),
    # -- audit ----------------------------------------------------------------------------
    Pairing(
        _text("input canaries"),
        _UNITS,
        lambda p: p.audit == "input" and p.units,
        _text("they are single rows of the data, while the model's epsilon is per unit, which they do not measure"),
        _text(
            "Audit it with gradient canaries (each one unit's clipped contribution) and unit_ids, or audit a "
            "DPModel with privacy_unit='example'."
        ),
    ),
    Pairing(
        _text("gradient canaries"),
        _text("sparse_embeddings"),
        lambda p: p.audit == "gradient" and p.sparse,
        _text("they assume the dense release"),
        _text("Audit a DPModel without sparse_embeddings (the same network and noise), or with input canaries."),
    ),
    Pairing(
        _text("gradient canaries"),
        _REPLICAS,
        lambda p: p.audit == "gradient" and p.replicas > 1,
        _text("each replica would add them, and read only its share of the noise"),
        _text("Audit in a single process (no distribution strategy), or with input canaries."),
    ),
    # -- truncated Poisson sampling (accounting.truncated_poisson_event: DP-SGD on examples) ------
    Pairing(
        _text("truncated Poisson sampling"),
        lambda p: f"the {p.mechanism_name()} mechanism",
        lambda p: p.truncated_sampling and (p.correlated or p.cycle_length > 1),
        _text("its event accounts independent Gaussian noise on each step's truncated sample, no cycle"),
        _text("Use GaussianNoise (DP-SGD), or fit on peg.dp.poisson_batches with the mechanism's cycle_length."),
    ),
    Pairing(
        _text("truncated Poisson sampling"),
        _text("adaptive_clipping"),
        lambda p: p.truncated_sampling and p.adaptive,
        _text(
            "an example that displaces another moves the noisy clipped count by up to 2, which adaptive "
            "clipping's split of the noise does not cover"
        ),
        _text("Give a fixed l2_norm_clip, or fit on peg.dp.poisson_batches."),
    ),
    Pairing(
        _text("truncated Poisson sampling"),
        _text("sparse_embeddings"),
        lambda p: p.truncated_sampling and p.sparse,
        _text("the accounting of the noisy row selection assumes untruncated Poisson sampling"),
        _text("Fit on peg.dp.poisson_batches, or leave sparse_embeddings out."),
    ),
    Pairing(
        _text("rows_per_user"),
        _text("truncated Poisson sampling"),
        lambda p: p.user_rows is not None and p.truncated_sampling,
        _text("the per-user mixture of Gaussians assumes rows Poisson-sampled without truncation"),
        _text("Use epsilon() without rows_per_user (per example)."),
    ),
    Pairing(
        _text("monte_carlo_epsilon"),
        _text("truncated Poisson sampling"),
        lambda p: p.monte_carlo and p.truncated_sampling,
        _text("the Monte-Carlo pair models untruncated Poisson sampling"),
        _text("Use epsilon(), which accounts the truncated steps by their own event."),
    ),
    # -- sampling (fit, where the data's sampling is known) ---------------------------------------
    Pairing(
        lambda p: f"the {p.mechanism_name()} mechanism",
        _text("data not sampled by peg.dp.poisson_batches"),
        lambda p: p.sampling is not None and not p.sampling.poisson and (p.correlated or p.cycle_length > 1),
        lambda p: (
            f"its accounting needs every example's participations at least cycle_length={p.cycle_length} steps "
            "apart, which other data does not guarantee"
        ),
        lambda p: f"Fit on peg.dp.poisson_batches(x, y, sampling_probability=q, cycle_length={p.cycle_length}).",
    ),
    Pairing(
        lambda p: f"the {p.mechanism_name()} mechanism (accounted with amplification by Poisson sampling)",
        _text("b-min-sep sampling (a min_sep_batches dataset)"),
        lambda p: p.sampling is not None and p.sampling.scheme == "min_sep" and getattr(p.mechanism, "amplified", True),
        _text(
            "no accountant of this library bounds b-min-sep sampling's amplification (jax_privacy estimates it "
            "by Monte Carlo), and its steps are not Poisson-sampled"
        ),
        lambda p: (
            f"Use a mechanism accounted without amplification (peg.dp.BLT or peg.dp.BISR with "
            f"cycle_length={p.sampling.cycle_length}), or fit on peg.dp.poisson_batches."
        ),
    ),
    Pairing(
        lambda p: f"the {p.mechanism_name()} mechanism (accounted for cycle_length={p.cycle_length})",
        lambda p: (
            f"a min_sep_batches dataset of min_separation={p.sampling.cycle_length}"
            if p.sampling.scheme == "min_sep"
            else f"a poisson_batches dataset of cycle_length={p.sampling.cycle_length}"
        ),
        lambda p: p.sampling is not None and p.sampling.poisson and p.sampling.cycle_length != p.cycle_length,
        _text("the accounting assumes the mechanism's cycle"),
        lambda p: (
            f"Resample with min_sep_batches(..., min_separation={p.cycle_length})."
            if p.sampling.scheme == "min_sep"
            else f"Resample with poisson_batches(..., cycle_length={p.cycle_length})."
        ),
    ),
    Pairing(
        _text("privacy_unit='example'"),
        _text("a poisson_batches dataset of units (given unit_ids)"),
        lambda p: p.sampling is not None and p.sampling.units and not p.units,
        _text("the steps would clip rows, not units"),
        _text("Give DPModel(..., privacy_unit='unit'), or sample rows (poisson_batches without unit_ids)."),
    ),
    Pairing(
        _UNITS,
        _text("data without unit ids"),
        lambda p: p.sampling is not None and p.units and not p.sampling.units,
        _text("neither its steps could clip per unit nor epsilon() count units"),
        _text("Fit on peg.dp.poisson_batches(x, y, unit_ids=..., rows_per_unit=k, sampling_probability=q)."),
    ),
    Pairing(
        lambda p: f"physical_batch_size={p.chunks}",
        lambda p: f"units of up to rows_per_unit={p.sampling.rows_per_unit} rows",
        lambda p: (
            p.chunks is not None
            and p.sampling is not None
            and p.sampling.rows_per_unit is not None
            and p.sampling.rows_per_unit > p.chunks
        ),
        _text("a physical chunk holds whole units (a unit's gradient is summed before it is clipped)"),
        lambda p: f"Give physical_batch_size >= {p.sampling.rows_per_unit}, or resample with a smaller rows_per_unit.",
    ),
)


def check(parts: Parts) -> None:
    """Refuses the first pairing of ``PAIRINGS`` that ``parts`` hold.

    Raises:
      ValueError: ``"{owner}: {first} cannot be combined with {second}: {why}. {instead}"``.
    """
    for pairing in PAIRINGS:
        if pairing.applies(parts):
            raise ValueError(pairing.message(parts))


def per_layer(l2_norm_clip: Any) -> bool:
    """Whether ``l2_norm_clip`` is a per-layer one (a dict, list or tuple)."""
    return isinstance(l2_norm_clip, (dict, list, tuple))
