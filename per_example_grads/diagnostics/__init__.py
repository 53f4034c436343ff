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
"""

from per_example_grads.diagnostics.callback import GradientStatisticsCallback
from per_example_grads.diagnostics.report import GradientReport
from per_example_grads.diagnostics.similarity import TracInResult, gradient_similarity, tracin_scores
from per_example_grads.diagnostics.statistics import GradientStatistics, gradient_statistics

__all__ = [
    "GradientReport",
    "GradientStatistics",
    "GradientStatisticsCallback",
    "TracInResult",
    "gradient_similarity",
    "gradient_statistics",
    "tracin_scores",
]
