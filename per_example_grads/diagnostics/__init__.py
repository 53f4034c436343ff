"""Gradient diagnostics built on per-example gradients.

- ``gradient_statistics``: streaming mean / variance / tr(Σ) / GSNR / norms /
  gradient noise scale / cosines to the mean / top-k examples, as a
  ``GradientReport`` (``to_dict()``, ``save_png(path)``).
- ``gradient_similarity``, ``tracin_scores``: gradient dot products between
  examples, and TracIn influence over checkpoints.
- ``GradientStatisticsCallback``: the statistics every N training steps, in
  TensorBoard.

    import per_example_grads as peg
    report = peg.diagnostics.gradient_statistics(model, loss, (x, y), batch_size=128)
    print(report.noise_scale, report.to_dict()["gsnr"])

The names load their modules on first use (as in ``per_example_grads``), so
``pegrad diagnose`` can check its arguments before TensorFlow is imported.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from per_example_grads import _lazy

_EXPORTS = {
    "GradientReport": "per_example_grads.diagnostics.report",
    "GradientStatistics": "per_example_grads.diagnostics.statistics",
    "GradientStatisticsCallback": "per_example_grads.diagnostics.callback",
    "TracInResult": "per_example_grads.diagnostics.similarity",
    "gradient_similarity": "per_example_grads.diagnostics.similarity",
    "gradient_statistics": "per_example_grads.diagnostics.statistics",
    "tracin_scores": "per_example_grads.diagnostics.similarity",
}

__all__ = sorted(_EXPORTS, key=str.lower)

if _TYPE_CHECKING:
    from per_example_grads.diagnostics.callback import GradientStatisticsCallback  # noqa: F401
    from per_example_grads.diagnostics.report import GradientReport  # noqa: F401
    from per_example_grads.diagnostics.similarity import (  # noqa: F401
        TracInResult,
        gradient_similarity,
        tracin_scores,
    )
    from per_example_grads.diagnostics.statistics import GradientStatistics, gradient_statistics  # noqa: F401


__getattr__, __dir__ = _lazy.exports(globals(), _EXPORTS)
