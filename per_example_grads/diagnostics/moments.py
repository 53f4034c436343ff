"""Per-batch sufficient statistics of per-example gradients, without ``B x P`` where possible.

For a batch of ``B`` examples with per-example gradients ``g_i`` (``g_i[v]``
of shape ``[*var.shape]`` for variable ``v``) and a reference gradient ``r``
(same structure), ``batch_moments`` returns, per variable ``v``:

- ``sum[v]   = sum_i g_i[v]``                      ``[*var.shape]`` float64
- ``sumsq[v] = sum_i g_i[v] ** 2`` (elementwise)    ``[*var.shape]`` float64
- ``sqnorms[v, i] = ||g_i[v]||^2``                  ``[n_vars, B]`` float64
- ``dots[i] = sum_v <g_i[v], r[v]>``               ``[B]`` float64

These are all the streaming statistics need (means, per-parameter variances,
norms, cosines to a reference).

How they are computed:

* A layer called once whose rule gives its gradients as outer products
  (``LayerRule.outer_factors``: a Dense layer on a rank-2 input, example n's
  kernel gradient ``a_n g_n^T`` from its input ``a`` ``[B, i]`` and
  pre-activation gradient ``g`` ``[B, j]``) uses closed forms:
  ``sum = a^T g``, ``sumsq = (a*a)^T (g*g)`` (because ``(a_n g_n^T)^2 =
  a_n^2 (g_n^2)^T``), ``||.||^2 = ||a_n||^2 ||g_n||^2``, and
  ``<a_n g_n^T, R> = a_n^T R g_n`` (a bias, ``g_n`` alone, likewise).
  Nothing of size ``B x P`` is built.
* Every other layer the layer-wise engine covers materializes that one
  layer's per-example gradients (``unit_per_example``), reduces them, and
  moves on (layers are chained by control dependencies, so one layer's
  ``[B, *var.shape]`` tensors exist at a time).
* Models it does not cover go through ``per_example_gradients`` with the
  requested engine: ``B x P`` for the batch, reduced at once.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from per_example_grads._core.batch import Batch
from per_example_grads.engines import selection
from per_example_grads.engines import layerwise as layerwise
from per_example_grads._core.problem import Problem

F64 = tf.float64


def outer_factors(unit: Any, calls: list) -> list | None:
    """The rule's ``(A, G)`` per variable of a unit called once, or None (see ``LayerRule.outer_factors``)."""
    if len(calls) != 1:
        return None
    record, g = calls[0]
    return unit.rule.outer_factors(unit.layer, record.saved, g)


def _reduce_materialized(pe: tf.Tensor, ref: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """(sum, sumsq, sqnorms, dots) of ``[B, *shape]`` per-example gradients."""
    pe = tf.cast(pe, F64)
    flat = tf.reshape(pe, [tf.shape(pe)[0], -1])
    return (
        tf.reduce_sum(pe, axis=0),
        tf.reduce_sum(tf.square(pe), axis=0),
        tf.reduce_sum(tf.square(flat), axis=1),
        tf.linalg.matvec(flat, tf.reshape(tf.cast(ref, F64), [-1])),
    )


def _factor_moments(a, g, ref) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """(sum, sumsq, sqnorms, dots) of gradients ``a_n^T g_n`` (or ``g_n`` when ``a`` is None)."""
    g = tf.cast(g, F64)  # [B, j]
    ref = tf.cast(ref, F64)
    g2 = tf.square(g)
    if a is None:
        return tf.reduce_sum(g, axis=0), tf.reduce_sum(g2, axis=0), tf.reduce_sum(g2, axis=1), tf.linalg.matvec(g, ref)
    a = tf.cast(a, F64)  # [B, i]
    a2 = tf.square(a)
    return (
        tf.matmul(a, g, transpose_a=True),
        tf.matmul(a2, g2, transpose_a=True),
        tf.reduce_sum(a2, axis=1) * tf.reduce_sum(g2, axis=1),
        tf.reduce_sum(tf.matmul(a, ref) * g, axis=1),
    )


def batch_moments(
    problem: Problem, batch: Batch, reference: Sequence[tf.Tensor], method: str = "auto", training: bool = False
) -> dict[str, Any]:
    """Sufficient statistics of one batch (see the module docstring).

    Args:
      problem: the per-example losses and variables.
      batch: a ``Batch`` of ``B`` examples.
      reference: one ``[*var.shape]`` tensor per variable (``dots`` are taken
        against it; zeros if not needed).
      method: engine; ``"auto"``/``"layerwise"`` use the capture path when the
        layer-wise engine covers the model.
      training: passed to the model.

    Returns:
      ``{"sum": [n_vars] list, "sumsq": [n_vars] list, "sqnorms": [n_vars, B],
      "dots": [B]}``, all float64.
    """
    variables = list(problem.variables)
    refs = {id(v): r for v, r in zip(variables, reference)}
    found: dict[int, tuple] = {}
    if layerwise.use_layerwise(method, problem):
        captured = layerwise.capture(problem, batch)
        wanted = set(refs)
        previous: list = []
        for unit, calls in captured.by_unit().items():
            if not calls:
                continue
            with tf.control_dependencies(previous):
                factors = outer_factors(unit, calls)
                part = {}
                if factors is not None:
                    for v, (a, g) in zip(unit.variables, factors):
                        if id(v) in wanted:
                            part[id(v)] = _factor_moments(a, g, refs[id(v)])
                else:
                    for v, pe in zip(unit.variables, layerwise.unit_per_example(unit, calls)):
                        if id(v) in wanted:
                            part[id(v)] = _reduce_materialized(pe, refs[id(v)])
            found.update(part)
            previous = [t for stats in part.values() for t in stats]
        b = captured.batch_size
    else:
        grads = selection.compute(method, problem, batch)
        for v, pe in zip(variables, grads):
            found[id(v)] = _reduce_materialized(pe, refs[id(v)])
        b = tf.shape(grads[0])[0]
    zeros_b = tf.zeros([b], F64)
    stats = [
        found.get(id(v), (tf.zeros(v.shape, F64), tf.zeros(v.shape, F64), zeros_b, zeros_b))
        for v in variables
    ]
    return {
        "sum": [s[0] for s in stats],
        "sumsq": [s[1] for s in stats],
        "sqnorms": tf.stack([s[2] for s in stats]),
        "dots": tf.add_n([s[3] for s in stats]),
    }
