"""Deprecated module path: ``GradientAccumulator`` lives in ``per_example_grads.dp.accumulation``.

Its DP mode is a ``per_example_grads.dp.DPAggregator``'s step, and the API
layer does not import ``dp/``. Use ``peg.GradientAccumulator`` or
``peg.dp.GradientAccumulator`` (the same class).
"""

import warnings

from per_example_grads.dp.accumulation import GradientAccumulator

__all__ = ["GradientAccumulator"]

warnings.warn(
    "per_example_grads.accumulation is deprecated: import GradientAccumulator from per_example_grads "
    "(peg.GradientAccumulator) or per_example_grads.dp.",
    DeprecationWarning,
    stacklevel=2,
)
