"""``audit``: train a ``DPModel`` with canaries through its ordinary ``fit``, score them, bound epsilon from below.

    report = peg.dp.audit.audit(dp_model, x, y, canaries=peg.dp.audit.GradientCanaries(1000),
                                sampling_probability=q, steps=T, delta=1e-5, png="audit.png")
    report.epsilon_accountant, report.epsilon_one_run, report.epsilon_gaussian_dp

The run is the one users run: ``dp_model.fit`` on ``poisson_batches`` (with
the mechanism's ``cycle_length``), its engine, clipping, physical chunks,
noise, mechanism, divisor and optimizer. Gradient canaries enter through the
aggregator's one hook (``DPAggregator.canaries``); input canaries are rows of
the training data whose Poisson mask is multiplied by 0 when they are left
out. ``epsilon_accountant`` is the accountant's epsilon of the audited steps
alone (the canaries take part in no other; on a fresh model it is
``dp_model.epsilon(delta)`` after the run); the lower bounds are
``CanaryScoreAuditor``'s.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from per_example_grads.dp import composition
from per_example_grads.dp.audit import statistics
from per_example_grads.dp.audit.auditor import CanaryScoreAuditor, OneRunBound, ThresholdBound
from per_example_grads.dp.audit.canaries import GradientCanaries, InputCanaries

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_SAMPLING_TAG = 0x62617463  # "batc": the Poisson batches' seed, derived from the audit's


@dataclasses.dataclass
class AuditReport:
    """What an audit found: the accountant's epsilon beside the empirical lower bounds.

    Attributes:
      epsilon_accountant: what the library claims for the audited steps: the
        accountant's epsilon of those steps alone, at the run's noise
        multiplier and ``sampling_probability``.
      one_run: the one-run bound (``OneRunBound``): valid for any mechanism.
      threshold_test: the Gaussian-DP and Clopper-Pearson bounds of one
        threshold test (``ThresholdBound``); the Gaussian-DP one assumes a
        Gaussian trade-off curve and independent canaries (true for gradient
        canaries at ``q = 1``).
      kind: ``"gradient"`` (white box) or ``"input"`` (black box).
      in_scores, out_scores: the canaries' scores.
      delta, significance: of every bound.
      steps: DP steps of the audited run.
      noise_multiplier, sampling_probability, l2_norm_clip, mechanism: the run's settings.
      seconds: wall time of the training (``fit``).
      title: the model and data, in words (the figure's title).
    """

    epsilon_accountant: float
    one_run: OneRunBound
    threshold_test: ThresholdBound
    kind: str
    in_scores: np.ndarray
    out_scores: np.ndarray
    delta: float
    significance: float
    steps: int
    noise_multiplier: float
    sampling_probability: float
    l2_norm_clip: Any
    mechanism: str
    seconds: float
    title: str

    @property
    def epsilon_one_run(self) -> float:
        """The one-run lower bound."""
        return self.one_run.epsilon

    @property
    def epsilon_gaussian_dp(self) -> float:
        """The Gaussian-DP lower bound."""
        return self.threshold_test.epsilon

    @property
    def num_canaries(self) -> int:
        return len(self.in_scores) + len(self.out_scores)

    @property
    def num_included(self) -> int:
        return len(self.in_scores)

    @property
    def gaussian_dp_exact(self) -> bool:
        """Whether the Gaussian-DP bound's assumptions hold: gradient canaries at ``q = 1`` (else it is a heuristic)."""
        return self.kind == "gradient" and self.sampling_probability == 1.0

    @property
    def violated(self) -> bool:
        """True when a valid lower bound exceeds the accountant's epsilon: evidence that the claim is false.

        The one-run bound always counts (under a correct claim it exceeds it
        with probability at most ``significance``); the Gaussian-DP bound
        counts where its assumptions hold (``gaussian_dp_exact``).
        """
        bounds = [self.epsilon_one_run] + ([self.epsilon_gaussian_dp] if self.gaussian_dp_exact else [])
        return max(bounds) > self.epsilon_accountant

    def to_dict(self) -> dict[str, Any]:
        """The numbers of the report (no scores), for JSON."""
        return {
            "epsilon_accountant": self.epsilon_accountant,
            "epsilon_one_run": self.epsilon_one_run,
            "epsilon_gaussian_dp": self.epsilon_gaussian_dp,
            "epsilon_clopper_pearson": self.threshold_test.epsilon_clopper_pearson,
            "gaussian_dp_exact": self.gaussian_dp_exact,
            "violated": self.violated,
            "one_run": dataclasses.asdict(self.one_run),
            "threshold_test": dataclasses.asdict(self.threshold_test),
            "kind": self.kind,
            "num_canaries": self.num_canaries,
            "num_included": self.num_included,
            "delta": self.delta,
            "significance": self.significance,
            "steps": self.steps,
            "noise_multiplier": self.noise_multiplier,
            "sampling_probability": self.sampling_probability,
            "l2_norm_clip": self.l2_norm_clip
            if isinstance(self.l2_norm_clip, (int, float))
            else str(self.l2_norm_clip),
            "mechanism": self.mechanism,
            "seconds": self.seconds,
            "title": self.title,
        }

    def summary(self) -> str:
        """A table of the bounds beside the accountant's epsilon, with the counts they come from."""
        o, t = self.one_run, self.threshold_test
        confidence = f"{1 - self.significance:.0%}"
        rows = [
            [
                "accountant (the claim)",
                f"{self.epsilon_accountant:.3f}",
                f"{_mechanism_name(self.mechanism)}, sigma = {self.noise_multiplier:.4g}, "
                f"q = {self.sampling_probability:.4g}, {self.steps} steps",
            ],
            [
                f"one-run lower bound ({confidence})",
                f"{o.epsilon:.3f}",
                f"{o.num_correct} of {o.num_guesses} guesses right ({o.guessed_in} in, {o.guessed_out} out; best of {o.hypotheses})",
            ],
            [
                f"Gaussian-DP lower bound ({confidence})",
                f"{t.epsilon:.3f}",
                f"mu >= {t.mu:.3f}; threshold {t.threshold:.4g}: {t.false_positives}/{t.num_out} false in, "
                f"{t.false_negatives}/{t.num_in} false out"
                + ("" if self.gaussian_dp_exact else " (assumes a Gaussian trade-off: a heuristic here)"),
            ],
            [
                f"Clopper-Pearson lower bound ({confidence})",
                f"{t.epsilon_clopper_pearson:.3f}",
                "same test, no Gaussian assumption",
            ],
        ]
        table = _table([f"epsilon at delta = {self.delta:g}", "value", "from"], rows)
        verdict = (
            "A LOWER BOUND EXCEEDS THE CLAIM: the implementation or its accounting is wrong (or, at the "
            f"{self.significance:g} level, this run was unlucky)."
            if self.violated
            else "No lower bound exceeds the claim: the audit found no violation (a lower bound is no proof of privacy)."
        )
        return (
            f"Audit of {self.title}: {self.num_canaries} {self.kind} canaries, {self.num_included} included "
            f"(each with probability 1/2); training took {self.seconds:.1f} s.\n{table}\n{verdict}"
        )

    def figure(self) -> "Figure":
        """Two panels: the in/out score histograms, and the trade-off of false "out" against false "in" calls.

        The trade-off panel draws the canaries' empirical curve (every
        threshold), the claim as a Gaussian trade-off curve (``mu`` with
        ``epsilon_for_mu(mu, delta) = epsilon_accountant``, which every test
        stays on or above when the trade-off is Gaussian, as for DP-SGD at
        ``q = 1``), and the Gaussian-DP curve of the ``mu`` the audit rules out.
        Drawn on matplotlib's Agg canvas (pyplot untouched).
        """
        from per_example_grads import plots

        fig = plots.new_figure(13, 5.8)
        hist_ax, trade_ax = fig.subplots(1, 2)
        o, t = self.one_run, self.threshold_test
        confidence = f"{1 - self.significance:.0%}"
        fig.suptitle(
            plots.wrapped(f"Privacy audit of {self.title}", 120)
            + f"\n{self.num_canaries} {self.kind} canaries ({self.num_included} included), "
            f"{_mechanism_name(self.mechanism)}, {self.steps} steps, q = {self.sampling_probability:.3g}, "
            f"σ = {self.noise_multiplier:.3g}"
            + f"\nε (accountant) = {self.epsilon_accountant:.2f}; lower bounds at {confidence}: "
            f"one-run {o.epsilon:.2f}, Gaussian DP {t.epsilon:.2f} (δ = {self.delta:g})",
            fontsize=11,
        )
        ins, outs = self.in_scores, self.out_scores
        edges = np.histogram_bin_edges(np.concatenate([ins, outs]), bins=40)
        hist_ax.hist(outs, bins=edges, alpha=0.6, color="tab:orange", label=f"left out ({len(outs)})")
        hist_ax.hist(ins, bins=edges, alpha=0.6, color="tab:blue", label=f"included ({len(ins)})")
        if math.isfinite(t.threshold):
            hist_ax.axvline(
                t.threshold,
                color="black",
                linestyle="--",
                label=f"threshold {t.threshold:.3g}: Gaussian DP ε ≥ {t.epsilon:.2f}",
            )
        ranked = np.sort(np.concatenate([ins, outs]))[::-1]
        if o.guessed_in:
            hist_ax.axvline(
                ranked[o.guessed_in - 1],
                color="tab:blue",
                linestyle=":",
                label=f"one-run: top {o.guessed_in} guessed in, bottom {o.guessed_out} out: ε ≥ {o.epsilon:.2f}",
            )
        if o.guessed_out:
            hist_ax.axvline(ranked[len(ranked) - o.guessed_out], color="tab:orange", linestyle=":")
        top = hist_ax.get_ylim()[1]
        hist_ax.set_ylim(0, top * 1.5)  # room for the legend
        hist_ax.set_title("Canary scores", fontsize=10)
        hist_ax.set_xlabel(
            "score: <canary direction, release − data> / (C × turns); included ≈ q"
            if self.kind == "gradient"
            else "score: minus the canary's loss at the trained model"
        )
        hist_ax.set_ylabel("canaries")
        hist_ax.legend(
            fontsize=7.5, loc="upper left", title=f"ε accountant = {self.epsilon_accountant:.2f}", title_fontsize=8
        )
        hist_ax.grid(alpha=0.3)

        fpr_grid = np.linspace(0.0, 1.0, 401)
        taus = np.concatenate([np.unique(np.concatenate([ins, outs])), [np.inf]])
        fp, fn = statistics.threshold_counts(ins, outs, taus)
        trade_ax.step(
            fp / max(len(outs), 1),
            fn / max(len(ins), 1),
            where="post",
            color="tab:green",
            label="canaries: every threshold",
        )
        eps, d = self.epsilon_accountant, self.delta
        if math.isfinite(eps) and eps > 0:
            claim = statistics.mu_for_epsilon(eps, d)
            trade_ax.plot(
                fpr_grid,
                _gaussian_tradeoff(fpr_grid, claim),
                color="black",
                label=f"the claim ε = {eps:.2f} as Gaussian DP, μ = {claim:.2f}: "
                + ("tests stay above" if self.gaussian_dp_exact else "approximate (q < 1 or input canaries)"),
            )
        if t.mu > 0:
            trade_ax.plot(
                fpr_grid,
                _gaussian_tradeoff(fpr_grid, t.mu),
                color="tab:red",
                linestyle="--",
                label=f"Gaussian DP μ = {t.mu:.2f} (ruled out): ε = {t.epsilon:.2f}",
            )
        trade_ax.set_xlim(0, 1)
        trade_ax.set_ylim(0, 1)
        trade_ax.set_title("Trade-off of the membership test", fontsize=10)
        trade_ax.set_xlabel("false positive rate (left-out canaries called in)")
        trade_ax.set_ylabel("false negative rate (included canaries called out)")
        trade_ax.legend(fontsize=8, loc="upper right", title=f"δ = {d:g}", title_fontsize=8)
        trade_ax.grid(alpha=0.3)
        fig.tight_layout()
        return fig

    def save_png(self, path: str | Path) -> Path:
        """Writes ``figure()`` to ``path`` (PNG), under a temporary name moved into place when complete."""
        path = Path(path)
        handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
        os.close(handle)
        try:
            self.figure().savefig(temporary, format="png")
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return path


def _mechanism_name(mechanism: str) -> str:
    return "DP-SGD" if mechanism == "GaussianNoise" else mechanism


def _table(headers: list[str], rows: list[list[str]]) -> str:
    """Plain-text columns: the first and last left-aligned, the middle right-aligned."""
    cells = [headers] + rows
    widths = [max(len(row[j]) for row in cells) for j in range(len(headers))]
    line = lambda row: "  ".join(  # noqa: E731
        c.rjust(w) if 0 < j < len(row) - 1 else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))
    ).rstrip()
    return "\n".join([line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def _claim(dp_model: Any, sampling_probability: float, steps: int, delta: float) -> float:
    """The accountant's epsilon of ``steps`` releases of ``dp_model``'s privatizer at its noise multiplier and ``q``."""
    from per_example_grads.dp.accounting import PrivacyAccountant

    dp_model._check_ledger_covers_network()
    ledger = PrivacyAccountant(dp_model.noise_multiplier, sampling_probability)
    ledger.record_event(dp_model.aggregator.privatizer.dp_event(dp_model.noise_multiplier, sampling_probability, steps))
    return float(ledger.epsilon(delta))


def _gaussian_tradeoff(fpr: np.ndarray, mu: float) -> np.ndarray:
    """``Phi(Phi^-1(1 - FPR) - mu)``: the smallest false negative rate ``mu``-Gaussian DP allows."""
    from scipy.stats import norm  # drawing only; the bounds themselves use tensorflow-probability

    return norm.cdf(norm.isf(np.clip(fpr, 0.0, 1.0)) - mu)


def audit(
    dp_model: Any,
    x: Any,
    y: Any = None,
    *,
    canaries: GradientCanaries | InputCanaries,
    sampling_probability: float,
    delta: float,
    steps: int | None = None,
    significance: float = 0.05,
    seed: int = 0,
    png: str | Path | None = None,
    title: str | None = None,
    verbose: int = 0,
    callbacks: list | None = None,
    unit_ids: Any = None,
) -> AuditReport:
    """Trains ``dp_model`` on ``(x, y)`` with ``canaries`` through ``fit``, and bounds its epsilon from below.

    The batches are ``peg.dp.poisson_batches(..., sampling_probability=q,
    steps=steps, cycle_length=dp_model.mechanism.cycle_length)``, seeded from
    ``seed``; ``dp_model.fit`` takes them for one pass. Gradient canaries are
    attached to ``dp_model.aggregator`` for the run (and detached after);
    input canaries are appended to the data (see ``InputCanaries``). Then
    ``CanaryScoreAuditor`` turns the scores into the one-run bound and the
    threshold test's bounds (gradient canaries: the threshold is half an
    included canary's expected score, fixed in advance; input canaries: chosen
    on half of them), and the accountant's epsilon of the audited steps alone
    gives the claim (a model that trained before is not credited with its
    earlier steps, in which no canary took part).

    Audit a run made for the audit, not the model you release: the canaries
    are part of its training.

    A ``DPModel(privacy_unit="unit")`` is audited at the level it claims:
    the batches sample units (``poisson_batches(..., unit_ids=unit_ids)``),
    each gradient canary is one unit's clipped contribution (norm ``C``,
    sampled as a unit is, at ``q``), and the claim is the per-unit epsilon.

    Args:
      dp_model: a compiled ``peg.keras.DPModel``. Leave its
        ``num_examples`` and ``expected_batch_size`` out (taken from the
        data): with input canaries the data has ``N + m`` rows.
      x, y: the training data (arrays or structures of arrays).
      canaries: ``GradientCanaries`` (white box) or ``InputCanaries`` (black box).
      sampling_probability: ``q`` of the Poisson batches (the part's rate
        under a cycle).
      delta: the delta of the claim and of the bounds, in ``(0, 1)``.
      steps: DP steps; default one epoch, ``round(cycle_length / q)``.
      significance: of every bound (default 0.05: 95 % confidence).
      seed: the batches' seed (the canaries have their own).
      png: where to write ``report.figure()``, or None.
      title: the model and data in words, for the report (default the model's name).
      verbose, callbacks: passed to ``fit``.
      unit_ids: ``[N]`` the unit of every row of ``x``, for (and only for) a
        ``privacy_unit="unit"`` model (gradient canaries).

    Returns:
      An ``AuditReport``.

    Raises:
      TypeError: ``dp_model`` is not a ``DPModel`` or ``canaries`` not canaries.
      ValueError: ``dp_model`` is not compiled; ``unit_ids`` missing for a unit-level model or given for
        an example-level one; input canaries for a unit-level model; or an argument is out of range
        (``delta``, ``significance``, ``sampling_probability``, ``steps``).
    """
    from per_example_grads.dp.aggregator import DPAggregator
    from per_example_grads.dp.sampling import poisson_batches

    # A DPModel is what trains through a DPAggregator with fit; read so, without importing the keras
    # package (which builds on this one).
    if not (isinstance(getattr(dp_model, "aggregator", None), DPAggregator) and hasattr(dp_model, "_parts")):
        raise TypeError(f"dp_model must be a peg.keras.DPModel; got {type(dp_model).__name__}.")
    if not isinstance(canaries, (GradientCanaries, InputCanaries)):
        raise TypeError(
            f"canaries must be peg.dp.audit.GradientCanaries or InputCanaries; got {type(canaries).__name__}."
        )
    composition.check(
        dataclasses.replace(
            dp_model._parts,
            owner="audit",
            audit="gradient" if isinstance(canaries, GradientCanaries) else "input",
            replicas=dp_model.distribute_strategy.num_replicas_in_sync,
        )
    )
    if getattr(dp_model, "optimizer", None) is None or getattr(dp_model, "loss", None) is None:
        raise ValueError("compile dp_model (optimizer and loss) before auditing it.")
    if dp_model._parts.units and unit_ids is None:
        raise ValueError(
            "dp_model has privacy_unit='unit': give audit(..., unit_ids=...), the unit of every row of x, so that "
            "its batches sample units and its canaries are audited as units."
        )
    if not dp_model._parts.units and unit_ids is not None:
        raise ValueError("unit_ids needs a DPModel(privacy_unit='unit'); this one protects single examples.")
    delta = statistics._probability("delta", delta, closed_low=False)
    significance = statistics.check_significance(significance)
    cycle = dp_model.mechanism.cycle_length
    batch_seed = int(np.random.SeedSequence([int(seed), _SAMPLING_TAG]).generate_state(1)[0])
    if isinstance(canaries, InputCanaries):
        if y is None:
            raise ValueError("input canaries need labels: give y (the canaries' own y was given to InputCanaries).")
        x_all, y_all, weight = canaries.training_data(x, y)
        batches = poisson_batches(
            (x_all, weight),
            y_all,
            sampling_probability=sampling_probability,
            steps=steps,
            seed=batch_seed,
            cycle_length=cycle,
        )
        sampling = batches.pegrad_sampling
        data = batches.map(lambda xb, yb, mask: (xb[0], yb, mask * xb[1]))  # a left-out canary weighs 0: never computed
        data.pegrad_sampling = sampling  # the same Poisson sampling, which fit reads
    else:
        data = poisson_batches(
            x,
            y,
            sampling_probability=sampling_probability,
            steps=steps,
            seed=batch_seed,
            cycle_length=cycle,
            unit_ids=unit_ids,
        )
        sampling = data.pegrad_sampling
    before = int(dp_model.dp_steps.numpy())
    if isinstance(canaries, GradientCanaries):
        canaries.attach(dp_model.aggregator, dp_model.model.trainable_variables)
    dp_model.train_function = None  # retrace: the step must see the hook (and later, no longer see it)
    started = time.perf_counter()
    try:
        dp_model.fit(data, epochs=1, verbose=verbose, callbacks=callbacks)
    finally:
        if isinstance(canaries, GradientCanaries):
            canaries.detach()
        dp_model.train_function = None
    seconds = time.perf_counter() - started
    if isinstance(canaries, GradientCanaries):
        in_scores, out_scores = canaries.scores()
        threshold = canaries.threshold
    else:
        in_scores, out_scores = canaries.scores(dp_model.model, dp_model.loss)
        threshold = None
    auditor = CanaryScoreAuditor(in_scores, out_scores)
    audited = int(dp_model.dp_steps.numpy()) - before
    report = AuditReport(
        epsilon_accountant=_claim(dp_model, sampling.sampling_probability, audited, delta),
        one_run=auditor.one_run(delta=delta, significance=significance),
        threshold_test=auditor.threshold_test(
            delta=delta, significance=significance, threshold=threshold, seed=canaries.seed
        ),
        kind=canaries.kind,
        in_scores=in_scores,
        out_scores=out_scores,
        delta=delta,
        significance=significance,
        steps=audited,
        noise_multiplier=float(dp_model.noise_multiplier),
        sampling_probability=float(sampling.sampling_probability),
        l2_norm_clip=dp_model.l2_norm_clip
        if not hasattr(dp_model.l2_norm_clip, "numpy")
        else float(dp_model.l2_norm_clip.numpy()),
        mechanism=type(dp_model.mechanism).__name__,
        seconds=seconds,
        title=title or dp_model.model.name,
    )
    if png is not None:
        report.save_png(png)
    return report
