"""The figures behind the PNGs the package writes, built on matplotlib's Agg canvas.

Each ``*_figure`` function returns a ``matplotlib.figure.Figure`` (so tests
and users can read back its titles, labels and legends) without touching the
global pyplot state or backend; the ``save_*`` functions next to the demos
write them. Conventions for every figure: a title naming the model and the
data, labelled axes with units, the key numbers in the legend, and the same
log scale wherever per-example gradient norms are shown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NORM_LABEL = "‖g_i‖₂, L2 norm of example i's loss gradient (log scale)"


def new_figure(width: float, height: float) -> "Figure":
    """A ``Figure`` with its own Agg canvas (pyplot is never involved)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def norms_histogram_figure(norms: np.ndarray, *, title: str) -> "Figure":
    """A log-scale histogram of ``[N]`` per-example gradient norms.

    The axes title reads "Per-example gradient norms" over ``title`` (name the
    model and data there); the legend gives N, the median, the 95th
    percentile and the maximum.
    """
    fig = new_figure(7.5, 4.8)
    ax = fig.add_subplot()
    plot_norms_histogram(ax, norms)
    ax.set_title(f"Per-example gradient norms\n{wrapped(title, 80)}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_norms_histogram(ax: Any, norms: np.ndarray, *, bins: int = 40) -> None:
    """Draws the log-binned histogram of ``norms`` on ``ax``, with axis labels and legend.

    Shared by ``norms_histogram.png`` and ``GradientReport.save_png``, so both
    show the same scale. Zero norms cannot sit on a log axis, and NaN or
    infinite ones on no axis: the legend counts them, and the statistics
    (median, percentile, maximum) are of the positive finite norms.
    """
    norms = np.asarray(norms, dtype=np.float64).ravel()
    positive = norms[np.isfinite(norms) & (norms > 0)]
    nonfinite = int(np.sum(~np.isfinite(norms)))
    ax.set_xlabel(NORM_LABEL)
    ax.set_ylabel("examples per bin")
    if not len(positive):
        note = f" ({nonfinite:,} non-finite)" if nonfinite else ""
        ax.text(0.5, 0.5, f"no positive norms to show{note}", ha="center", va="center", transform=ax.transAxes)
        return
    low, high = float(positive.min()), float(positive.max())
    edges = np.geomspace(low, high if high > low else low * 10, bins + 1)
    ax.hist(
        positive, bins=edges, color="tab:blue", edgecolor="white", linewidth=0.5, label=f"N = {len(norms):,} examples"
    )
    ax.set_xscale("log")
    plain_log_ticks(ax.xaxis)
    median, p95 = (float(v) for v in np.percentile(positive, [50, 95]))
    ax.axvline(median, color="tab:orange", linestyle="--", label=f"median {median:.3g}")
    ax.axvline(p95, color="tab:red", linestyle=":", label=f"95th percentile {p95:.3g}")
    ax.axvline(high, color="black", linewidth=0.8, label=f"max {high:.3g}")
    zeros = int(np.sum(norms == 0))
    if zeros:
        ax.plot([], [], " ", label=f"{zeros:,} zero norm(s), not shown")
    if nonfinite:
        ax.plot([], [], " ", label=f"{nonfinite:,} non-finite norm(s) (NaN or Inf), not shown")
    ax.legend(fontsize=8, loc="upper left")


def plain_log_ticks(axis: Any, subs: tuple[float, ...] = (1.0, 2.0, 5.0)) -> None:
    """Ticks at 1, 2, 5 x 10^k on a log ``axis``, labelled as plain numbers (0.5, 20, 300).

    Instead of matplotlib's default for short ranges, 3x10^1, 4x10^1, 6x10^1.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.6g}"))
    axis.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
    axis.set_minor_formatter(NullFormatter())


def wrapped(text: str, width: int = 90) -> str:
    """``text`` broken into lines of at most ``width`` characters, for a title."""
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) or text
