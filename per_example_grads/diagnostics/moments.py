"""Per-batch sufficient statistics of per-example gradients, without ``B x P`` where possible.

For a batch of ``B`` examples with per-example gradients ``g_i`` (``g_i[v]``
of shape ``[*var.shape]`` for variable ``v``) and a reference gradient ``r``
(same structure), ``batch_moments`` returns, per variable ``v``:

- ``sum[v]   = sum_i g_i[v]``                      ``[*var.shape]`` float64
- ``sumsq[v] = sum_i g_i[v] ** 2`` (elementwise)    ``[*var.shape]`` float64
- ``sqnorms[v, i] = ||g_i[v]||^2``                  ``[n_vars, B]`` float64
- ``dots[i] = sum_v <g_i[v], r[v]>``               ``[B]`` float64

These are all the streaming statistics need (means, per-parameter variances,
norms, cosines to a reference). They are an engine capability
(``Engine.moments``, ``per_example_grads.engines.moments``): the layer-wise
engine's closed forms build nothing of size ``B x P`` for layers whose
gradients are outer products (a Dense layer on a rank-2 input) and one
layer's per-example gradients at a time for the others; every other engine
materializes the batch's. The engine is picked as for every capability
(``selection.run``: ``method="auto"`` with its fallbacks).
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from per_example_grads._core.batch import Batch
from per_example_grads._core.problem import Problem
from per_example_grads.engines import selection

F64 = tf.float64


def batch_moments(
    problem: Problem, batch: Batch, reference: Sequence[tf.Tensor], method: str = "auto", training: bool = False
) -> dict[str, Any]:
    """Sufficient statistics of one batch (see the module docstring).

    Args:
      problem: the per-example losses and variables.
      batch: a ``Batch`` of ``B`` examples.
      reference: one ``[*var.shape]`` tensor per variable (``dots`` are taken
        against it; zeros if not needed).
      method: the engine, or ``"auto"`` (``selection.run``).
      training: unused (the problem holds the mode); kept for callers.

    Returns:
      ``{"sum": [n_vars] list, "sumsq": [n_vars] list, "sqnorms": [n_vars, B],
      "dots": [B]}``, all float64.
    """
    reference = list(reference)
    return selection.run(method, problem, lambda engine: engine.moments(problem, batch, reference), batch)
