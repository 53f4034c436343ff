"""``GradientReport``: what ``gradient_statistics`` found, as numbers, JSON and a PNG.

The formulas are in ``per_example_grads.diagnostics.statistics``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np

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
        """``tr(Sigma) / (||m||^2 - tr(Sigma)/N)``: the estimator with ``B_big = N``."""
        g2 = self.mean_gradient_norm**2 - self.trace_covariance / max(self.num_examples, 1)
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
        """``{"0.5": median, ...}`` of the global per-example norms."""
        norms = self.per_example_norms
        if not norms.size:
            return {str(q): math.nan for q in QUANTILES}
        return {str(q): float(np.quantile(norms, q)) for q in QUANTILES}

    def norm_histogram(self, bins: int = HISTOGRAM_BINS) -> dict[str, list]:
        """``{"counts": [bins], "edges": [bins + 1]}`` of the global norms (linear bins)."""
        counts, edges = np.histogram(self.per_example_norms, bins=bins)
        return {"counts": counts.astype(int).tolist(), "edges": edges.tolist()}

    def top_examples(self, k: int | None = None) -> list[dict[str, Any]]:
        """The ``k`` largest norms, largest first: ``{"index", "norm", "cosine"}``."""
        k = self.top_k if k is None else k
        norms = self.per_example_norms
        order = np.argsort(-norms, kind="stable")[:k]
        return [
            {
                "index": int(i),
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
            "num_batches": len(self.batch_sizes),
            "num_params": int(sum(m.size for m in self.mean)),
            "trace_covariance": self.trace_covariance,
            "mean_gradient_norm": self.mean_gradient_norm,
            "noise_scale": self.noise_scale,
            "noise_scale_full_data": self.noise_scale_full_data,
            "noise_scale_trace": self.noise_scale_trace,
            "per_example_norm_mean": float(np.mean(norms)) if norms.size else math.nan,
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

    def save_png(self, path: str | Path) -> Path:
        """Writes a 2x2 overview PNG: per-layer tr(Sigma), per-layer GSNR, norm histogram, noise-scale trace.

        Uses matplotlib's Agg canvas directly (the pyplot backend is left alone).
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        path = Path(path)
        layers = self.layers()
        names = list(layers)
        fig = Figure(figsize=(12, 8), dpi=100)
        FigureCanvasAgg(fig)
        (ax_var, ax_gsnr), (ax_hist, ax_ns) = fig.subplots(2, 2)

        traces = [layers[n]["trace_covariance"] for n in names]
        ax_var.bar(range(len(names)), traces, color="tab:blue")
        ax_var.set_title("per-layer gradient variance tr(Σ)")
        positive = [t for t in traces if t > 0]
        if positive and max(positive) > 100 * min(positive):
            ax_var.set_yscale("log")

        gsnrs = [layers[n]["gsnr"] for n in names]
        ax_gsnr.bar(range(len(names)), [g if np.isfinite(g) else 0.0 for g in gsnrs], color="tab:green")
        ax_gsnr.set_title("per-layer GSNR  mean_p E[g_p]² / Var[g_p]")
        for ax in (ax_var, ax_gsnr):
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)

        norms = self.per_example_norms
        if norms.size:
            ax_hist.hist(norms, bins=HISTOGRAM_BINS, color="tab:blue", edgecolor="white", linewidth=0.5)
            med = float(np.median(norms))
            ax_hist.axvline(med, color="tab:orange", linestyle="--", label=f"median {med:.3g}")
            ax_hist.legend()
        ax_hist.set_title(f"per-example gradient norms (N={self.num_examples})")
        ax_hist.set_xlabel("‖g_i‖")
        ax_hist.set_ylabel("examples")

        trace = np.array(self.noise_scale_trace, dtype=float)
        seen = np.cumsum(self.batch_sizes)
        ok = np.isfinite(trace) & (trace > 0)
        if ok.any():
            ax_ns.plot(seen[ok], trace[ok], marker=".", color="tab:red")
            ax_ns.set_yscale("log")
        ax_ns.set_title(f"noise scale B_simple (running): {self.noise_scale:.4g}")
        ax_ns.set_xlabel("examples seen")
        ax_ns.set_ylabel("B_simple")

        fig.tight_layout()
        fig.savefig(path, format="png")
        return path

    def summary(self) -> str:
        """A few lines for a terminal."""
        q = self.norm_quantiles()
        return "\n".join(
            [
                f"examples: {self.num_examples} in {len(self.batch_sizes)} batches",
                f"mean gradient norm ||G||: {self.mean_gradient_norm:.4g}",
                f"trace of gradient covariance tr(Σ): {self.trace_covariance:.4g}",
                f"simple noise scale B_simple: {self.noise_scale:.4g} "
                f"(full-data estimate {self.noise_scale_full_data:.4g})",
                f"per-example norms: median {q['0.5']:.4g}, 95% {q['0.95']:.4g}, max {q['1.0']:.4g}",
            ]
        )


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
