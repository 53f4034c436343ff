"""Reading a matplotlib figure back: titles, axis labels and legends, for the PNG tests."""

from __future__ import annotations

from typing import Any, Callable


def title_text(fig: Any) -> str:
    """The figure's title and every axes title, one per line."""
    return "\n".join([fig.get_suptitle()] + [ax.get_title() for ax in fig.axes])


def legend_text(fig: Any) -> str:
    """Every legend's title and entries, one per line."""
    lines = []
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            lines.append(legend.get_title().get_text())
            lines.extend(t.get_text() for t in legend.get_texts())
    return "\n".join(lines)


def assert_report_ready(fig: Any, *, title_has: list[str], legend_has: list[str], panels: int) -> None:
    """``panels`` axes, each with a title and both axis labels; the named texts in the titles and legends."""
    assert len(fig.axes) == panels, [ax.get_title() for ax in fig.axes]
    for ax in fig.axes:
        assert ax.get_title().strip(), "an axes without a title"
        assert ax.get_xlabel().strip(), f"no x label: {ax.get_title()}"
        assert ax.get_ylabel().strip(), f"no y label: {ax.get_title()}"
    # Long titles are wrapped: compare with the line breaks as spaces.
    titles, legends = " ".join(title_text(fig).split()), " ".join(legend_text(fig).split())
    for text in title_has:
        assert text in titles, (text, titles)
    for text in legend_has:
        assert text in legends, (text, legends)


def recording(figures: list, make: Callable) -> Callable:
    """``make`` that also appends every figure it returns to ``figures``."""

    def wrapper(*args, **kwargs):
        fig = make(*args, **kwargs)
        figures.append(fig)
        return fig

    return wrapper
