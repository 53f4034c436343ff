"""``GradientReport``: what ``gradient_statistics`` found, as numbers, JSON and a PNG.

The formulas are in ``per_example_grads.diagnostics.statistics``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

QUANTILES = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)
HISTOGRAM_BINS = 30


@dataclasses.dataclass
class GradientReport:
    """Gradient statistics of ``num_examples`` examples.

    Attributes:
      num_examples: ``N``.
      variable_paths: one name per variable (``variable.path``).
      mean: per variable, the mean gradient ``m`` ``[*var.shape]`` float64.
      variance: per variable, unbiased per-parameter variances ``v``
        ``[*var.shape]`` (NaN if ``N < 2``).
      per_variable_norms: ``[n_vars, N]`` per-example gradient norms per
        variable.
      cosines: ``[N]`` cosine of each example's gradient to the mean gradient
        (or None).
      batch_sizes: size of each batch of the stream.
      batch_trace, batch_g2: per batch, McCandlish's unbiased ``tr(Sigma)`` and
        ``|G|^2`` estimates (NaN for batches of one example).
      top_k: how many largest-norm examples ``top_examples`` lists.
      num_nonfinite: examples left out because their gradient had a NaN or
        Inf entry (``statistics``' module docstring); every other attribute
        is over the ``num_examples`` others.
      example_indices: ``[N]`` each example's position in the stream (the
        dataset index ``top_examples`` reports), or None for ``0 .. N-1``.
    """

    num_examples: int
    variable_paths: list[str]
    mean: list[np.ndarray]
    variance: list[np.ndarray]
    per_variable_norms: np.ndarray
    cosines: np.ndarray | None
    batch_sizes: list[int]
    batch_trace: list[float]
    batch_g2: list[float]
    top_k: int = 10
    num_nonfinite: int = 0
    example_indices: np.ndarray | None = None

    # ---- global quantities -------------------------------------------------

    @property
    def per_example_norms(self) -> np.ndarray:
        """``[N]`` global norms ``||g_i||``."""
        return np.sqrt(np.sum(np.square(self.per_variable_norms), axis=0))

    @property
    def trace_covariance(self) -> float:
        """``tr(Sigma) ~ sum_p v_p`` over all parameters."""
        return float(sum(np.sum(v) for v in self.variance))

    @property
    def mean_gradient_norm(self) -> float:
        """``||m||``, the norm of the mean-loss gradient."""
        return math.sqrt(sum(float(np.sum(np.square(m))) for m in self.mean))

    @property
    def noise_scale(self) -> float:
        """``B_simple``: batch-size-weighted ``tr(Sigma)_b`` over weighted ``|G|^2_b``."""
        return _ratio_of_sums(self.batch_sizes, self.batch_trace, self.batch_g2)

    @property
    def noise_scale_trace(self) -> list[float]:
        """``noise_scale`` after each batch (a running estimate)."""
        return [
            _ratio_of_sums(self.batch_sizes[: k + 1], self.batch_trace[: k + 1], self.batch_g2[: k + 1])
            for k in range(len(self.batch_sizes))
        ]

    @property
    def noise_scale_full_data(self) -> float:
        """``tr(Sigma) / (||m||^2 - tr(Sigma)/N)``: the estimator with ``B_big = N``.

        ``inf`` when the estimate of ``|G|^2`` is not positive; NaN when there
        is no estimate (fewer than two examples: no variance).
        """
        g2 = self.mean_gradient_norm**2 - self.trace_covariance / max(self.num_examples, 1)
        if math.isnan(g2):
            return math.nan
        return self.trace_covariance / g2 if g2 > 0 else math.inf

    def gsnr(self) -> dict[str, float]:
        """Per variable: ``mean_{p: v_p > 0} m_p^2 / v_p``."""
        return {p: _gsnr([m], [v]) for p, m, v in zip(self.variable_paths, self.mean, self.variance)}

    def layers(self) -> dict[str, dict[str, float]]:
        """Per layer (variables grouped by their path without the last part).

        Returns:
          ``{layer: {"num_params", "trace_covariance", "mean_gradient_norm",
          "gsnr", "mean_example_norm"}}``.
        """
        groups: dict[str, list[int]] = {}
        for k, p in enumerate(self.variable_paths):
            groups.setdefault(p.rsplit("/", 1)[0] if "/" in p else p, []).append(k)
        out = {}
        for layer, ks in groups.items():
            means = [self.mean[k] for k in ks]
            variances = [self.variance[k] for k in ks]
            norms = np.sqrt(np.sum(np.square(self.per_variable_norms[ks]), axis=0))
            out[layer] = {
                "num_params": int(sum(m.size for m in means)),
                "trace_covariance": float(sum(np.sum(v) for v in variances)),
                "mean_gradient_norm": math.sqrt(sum(float(np.sum(m**2)) for m in means)),
                "gsnr": _gsnr(means, variances),
                "mean_example_norm": float(np.mean(norms)) if norms.size else math.nan,
            }
        return out

    def norm_quantiles(self) -> dict[str, float]:
        """``{"0.5": median, ...}`` of the global per-example norms (the finite ones)."""
        norms = _finite_values(self.per_example_norms)
        if not norms.size:
            return {str(q): math.nan for q in QUANTILES}
        return {str(q): float(np.quantile(norms, q)) for q in QUANTILES}

    def norm_histogram(self, bins: int = HISTOGRAM_BINS) -> dict[str, Any]:
        """``{"counts": [bins], "edges": [bins + 1], "non_finite": n}`` of the global norms (linear bins).

        Non-finite norms (none from ``gradient_statistics``, which leaves such
        examples out) are not binned; ``non_finite`` counts them.
        """
        norms = np.asarray(self.per_example_norms, np.float64)
        counts, edges = np.histogram(_finite_values(norms), bins=bins)
        return {
            "counts": counts.astype(int).tolist(),
            "edges": edges.tolist(),
            "non_finite": int(np.sum(~np.isfinite(norms))),
        }

    def top_examples(self, k: int | None = None) -> list[dict[str, Any]]:
        """The ``k`` largest norms, largest first: ``{"index", "norm", "cosine"}``, ``index`` the dataset index."""
        k = self.top_k if k is None else k
        norms = self.per_example_norms
        order = np.argsort(-np.nan_to_num(norms, nan=-np.inf), kind="stable")[:k]
        indices = np.arange(len(norms)) if self.example_indices is None else np.asarray(self.example_indices)
        return [
            {
                "index": int(indices[i]),
                "norm": float(norms[i]),
                "cosine": None if self.cosines is None else _finite(self.cosines[i]),
            }
            for i in order
        ]

    # ---- output -------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable summary (non-finite numbers become None)."""
        norms = self.per_example_norms
        cos = self.cosines
        d = {
            "num_examples": self.num_examples,
            "num_nonfinite_examples": self.num_nonfinite,
            "num_batches": len(self.batch_sizes),
            "num_params": int(sum(m.size for m in self.mean)),
            "trace_covariance": self.trace_covariance,
            "mean_gradient_norm": self.mean_gradient_norm,
            "noise_scale": self.noise_scale,
            "noise_scale_full_data": self.noise_scale_full_data,
            "noise_scale_trace": self.noise_scale_trace,
            "per_example_norm_mean": float(np.mean(_finite_values(norms))) if np.isfinite(norms).any() else math.nan,
            "per_example_norm_quantiles": self.norm_quantiles(),
            "per_example_norm_histogram": self.norm_histogram(),
            "gsnr": self.gsnr(),
            "variables": {
                p: {
                    "shape": list(m.shape),
                    "trace_covariance": float(np.sum(v)),
                    "mean_gradient_norm": float(np.sqrt(np.sum(m**2))),
                }
                for p, m, v in zip(self.variable_paths, self.mean, self.variance)
            },
            "layers": self.layers(),
            "cosine_to_mean": None
            if cos is None or not np.isfinite(cos).any()
            else {
                "mean": float(np.nanmean(cos)),
                "fraction_negative": float(np.mean(cos[np.isfinite(cos)] < 0)),
                "quantiles": {str(q): float(np.nanquantile(cos, q)) for q in QUANTILES},
            },
            "top_examples": self.top_examples(),
        }
        return _jsonable(d)

    def save_png(self, path: str | Path, *, title: str | None = None) -> Path:
        """Writes ``figure(title=title)`` to ``path`` (PNG)."""
        path = Path(path)
        self.figure(title=title).savefig(path, format="png")
        return path

    def figure(self, *, title: str | None = None) -> "Figure":
        """The 2x2 overview: per-layer tr(Σ), per-layer GSNR, norm histogram, noise scale.

        Args:
          title: names the model and data (for example ``"my_cnn (1.2M
            parameters, loss sparse_categorical_crossentropy) on cifar10
            train (50,000 examples)"``); the figure's title is "Gradient
            diagnostics: " followed by it.

        Uses matplotlib's Agg canvas directly (the pyplot backend is left
        alone). Per-layer bars are on log axes with the values printed on
        them; the norm histogram is log-binned like ``norms_histogram.png``;
        the noise-scale panel shows the running per-batch estimate and the
        all-examples estimate, both numbers in its legend.
        """
        from per_example_grads import plots

        layers = self.layers()
        names = list(layers)
        labels = _short_layer_names(names)
        fig = plots.new_figure(13, 9)
        (ax_var, ax_gsnr), (ax_hist, ax_ns) = fig.subplots(2, 2)
        heading = "Gradient diagnostics\n" + plots.wrapped(title or f"{self.num_examples:,} examples", 140)
        if self.num_nonfinite:
            heading += f"\n{self.left_out()}"
        fig.suptitle(heading, fontsize=12)

        _layer_bars(
            ax_var,
            labels,
            [layers[n]["trace_covariance"] for n in names],
            "tab:blue",
            "Gradient noise per layer: tr(Σ) = Σ_p Var[g_p] over its parameters p",
            "tr(Σ) (gradient units², log scale)",
        )
        _layer_bars(
            ax_gsnr,
            labels,
            [layers[n]["gsnr"] for n in names],
            "tab:green",
            "Gradient signal-to-noise ratio per layer: GSNR = mean_p E[g_p]² / Var[g_p]",
            "GSNR (dimensionless, log scale)",
        )

        plots.plot_norms_histogram(ax_hist, self.per_example_norms)
        ax_hist.set_title(f"Per-example gradient norms (N = {self.num_examples:,})", fontsize=10)

        self._plot_noise_scale(ax_ns, plots)
        fig.tight_layout()
        return fig

    def _plot_noise_scale(self, ax: Any, plots: Any) -> None:
        trace = np.array(self.noise_scale_trace, dtype=float)
        seen = np.cumsum(self.batch_sizes)
        ok = np.isfinite(trace) & (trace > 0)
        full, batched = self.noise_scale_full_data, self.noise_scale
        values = list(trace[ok])
        if ok.any():
            ax.plot(
                seen[ok],
                trace[ok],
                marker=".",
                color="tab:red",
                label=f"per-batch estimate, running; final {_g(batched)}",
            )
            last = (seen[ok][-1], trace[ok][-1])
            ax.annotate(
                _g(last[1]), last, textcoords="offset points", xytext=(0, 6), ha="right", fontsize=8, color="tab:red"
            )
        else:
            ax.plot([], [], " ", label=f"per-batch estimate: {_g(batched)} (undefined)")
        if math.isfinite(full) and full > 0:
            ax.axhline(
                full,
                color="black",
                linestyle="--",
                label=f"from all {self.num_examples:,} examples: {_g(full)} (use this)",
            )
            ax.annotate(
                _g(full),
                (0.0, full),
                xycoords=("axes fraction", "data"),
                textcoords="offset points",
                xytext=(4, 3),
                fontsize=8,
            )
            values.append(full)
        else:
            ax.plot([], [], " ", label=f"from all {self.num_examples:,} examples: undefined ({_why_undefined(full)})")
        if values:
            ax.set_yscale("log")
            low, high = min(values), max(values)
            pad = max((high / low) ** 0.1, 1.3)  # equal values (one batch) still get a visible range
            ax.set_ylim(low / pad, high * pad)
            plots.plain_log_ticks(ax.yaxis, subs=(1.0, 2.0, 3.0, 5.0, 7.0) if high / low < 30 else (1.0, 2.0, 5.0))
        ax.set_title("Gradient noise scale B_simple = tr(Σ) / |G|²  (≈ critical batch size)", fontsize=10)
        ax.set_xlabel("examples seen (streamed in batches)")
        ax.set_ylabel("B_simple (examples, log scale)")
        ax.legend(fontsize=8, loc="best")

    def left_out(self) -> str:
        """``"3 non-finite examples left out (NaN or Inf gradients)"``, or ``""`` if none were."""
        n = self.num_nonfinite
        if not n:
            return ""
        return f"{n:,} non-finite example{'s' if n != 1 else ''} left out (NaN or Inf gradient{'s' if n != 1 else ''})"

    def summary(self) -> str:
        """A few lines for a terminal, each saying what its number is."""
        q = self.norm_quantiles()
        batches = len(self.batch_sizes)
        largest = max(self.batch_sizes, default=0)
        full, batched = self.noise_scale_full_data, self.noise_scale
        if math.isfinite(full) and full > 0:
            headline = f"{full:.4g} (from all {self.num_examples} examples at once)"
        elif math.isnan(full):
            headline = f"undefined from all {self.num_examples} examples (it needs at least two)"
        else:
            headline = (
                f"undefined from all {self.num_examples} examples (the estimate of |G|^2 is not "
                "positive: the mean gradient is within its noise; the model may be near a minimum)"
            )
        return "\n".join(
            [
                f"examples: {self.num_examples}, streamed in {batches} batches of up to {largest}",
                *(
                    [f"{self.left_out()}: every number below is over the other {self.num_examples}"]
                    if self.num_nonfinite
                    else []
                ),
                f"|G|, norm of the mean-loss gradient: {self.mean_gradient_norm:.4g}",
                f"tr(Σ), trace of the per-example gradient covariance: {self.trace_covariance:.4g}",
                f"gradient noise scale B_simple = tr(Σ)/|G|^2: {headline}",
                f"  the per-batch estimate of McCandlish et al. (2018), averaged over the {batches} "
                f"batches, is {batched:.4g};",
                "  it uses only pairs of examples within a batch, so it is noisier: trust the first",
                f"per-example gradient norms ||g_i||: median {q['0.5']:.4g}, "
                f"95th percentile {q['0.95']:.4g}, max {q['1.0']:.4g}",
            ]
        )


def _short_layer_names(names: list[str]) -> list[str]:
    """Layer paths without the prefix they all share (the model's name, which the title gives)."""
    if len(names) < 2:
        return [n.rsplit("/", 1)[-1] if "/" in n else n for n in names]
    parts = [n.split("/") for n in names]
    shared = 0
    while all(len(p) > shared + 1 for p in parts) and len({p[shared] for p in parts}) == 1:
        shared += 1
    return ["/".join(p[shared:]) for p in parts]


def _layer_bars(ax: Any, labels: list[str], values: list[float], color: str, title: str, ylabel: str) -> None:
    """One bar per layer on a log axis, each with its value printed above it (NaN or <= 0: 'n/a')."""
    x = np.arange(len(labels))
    shown = [v if math.isfinite(v) and v > 0 else math.nan for v in values]
    ok = [v for v in shown if math.isfinite(v)]
    if ok:
        from per_example_grads import plots

        ax.bar(x, [v if math.isfinite(v) else 0.0 for v in shown], color=color)
        ax.set_yscale("log")
        low, high = min(ok), max(ok)
        ax.set_ylim(low / 3, high * 3)
        plots.plain_log_ticks(ax.yaxis)
    for xi, v in zip(x, shown):
        text = _g(v) if math.isfinite(v) else "n/a"
        ax.annotate(
            text,
            (xi, v if math.isfinite(v) else (min(ok) if ok else 1.0)),
            textcoords="offset points",
            xytext=(0, 3),
            ha="center",
            fontsize=8,
        )
    ax.set_xticks(x)
    ax.set_xticklabels(
        labels, rotation=30 if len(labels) > 4 else 0, ha="right" if len(labels) > 4 else "center", fontsize=8
    )
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel, fontsize=9)


def _why_undefined(noise_scale: float) -> str:
    """Why ``noise_scale_full_data`` has no value, for a legend."""
    return "fewer than 2 examples" if math.isnan(noise_scale) else "|G|² ≤ 0"


def _g(x: float) -> str:
    """A number in 4 significant digits, or 'n/a' for NaN and 'inf'."""
    if math.isnan(x):
        return "n/a"
    return "inf" if math.isinf(x) else f"{x:.4g}"


def _gsnr(means: list[np.ndarray], variances: list[np.ndarray]) -> float:
    m = np.concatenate([x.ravel() for x in means]) if means else np.zeros(0)
    v = np.concatenate([x.ravel() for x in variances]) if variances else np.zeros(0)
    ok = np.isfinite(v) & (v > 0)
    return float(np.mean(m[ok] ** 2 / v[ok])) if ok.any() else math.nan


def _ratio_of_sums(sizes: list[int], num: list[float], den: list[float]) -> float:
    w = np.asarray(sizes, float)
    n, d = np.asarray(num, float), np.asarray(den, float)
    ok = np.isfinite(n) & np.isfinite(d)
    if not ok.any():
        return math.nan
    top, bottom = float(np.sum(w[ok] * n[ok])), float(np.sum(w[ok] * d[ok]))
    return top / bottom if bottom > 0 else math.inf


def _finite_values(values: np.ndarray) -> np.ndarray:
    """The finite entries of ``values``, flattened."""
    values = np.asarray(values, np.float64).ravel()
    return values[np.isfinite(values)]


def _finite(x: Any) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return _finite(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    return obj
