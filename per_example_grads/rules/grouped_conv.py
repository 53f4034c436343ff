"""Grouped forms of convolutions: each unit's kernel-gradient norm, by per-unit kernels or a Gram form over its positions.

For Conv1D/2D/3D (``groups = 1``, channels_last) and their transposed
versions (``rules.conv``, ``rules.conv_transpose``: the same forms on the
swapped operands), with ``p`` ``[B, T, f]`` the input patches (``f = K c_in``)
and ``g`` ``[B, T, k]`` the loss gradient at the pre-activation output, unit
``u``'s kernel gradient is ``G_u = sum_{n in u} p_n^T g_n`` and

    ||G_u||^2 = sum_{n, m in u} sum_{t, s} (p_nt . p_ms)(g_nt . g_ms).

Two exact forms (``rules.grouped``'s notation: ``U`` units, ``R`` the most
rows of any unit):

- kernels: every example's ``G_n`` ``[B, f, k]`` by the cheapest
  materialized path of ``path_costs.materialized_cost`` (per kernel offset,
  or from patches), segment-summed into ``[U, f, k]`` (``rules.grouped``'s
  fallback, which is exactly this for ``ConvPatchesRule.per_example``). The
  per-unit kernels are kept for the clipped sum (``sum_u c_u G_u``, one
  matrix-vector product) when they fit (``grouped.kept_fits``), else the
  clipped sum is the rule's kernel VJP at ``c_{ids[n]} g_n``;
- gram: the patches of each unit's rows laid end to end as one example
  (``grouped.unit_examples``, ``[U, R T, f]``) and the Gram form over its
  ``R T`` positions, ``U (R T)^2 (f + k)``: cheaper when positions are few
  and ``f k`` large (late layers of image networks); the clipped sum is
  then the rule's kernel VJP.

The form is picked by ``path_costs``' prices when traced, with ``R =
ceil(B / U)`` (even units, the Gram form's least cost). Where the Gram form
wins there, the choice is made again at run time with the batch's ``R``
(``tf.cond``; norms only). Under XLA (static shapes: ``R`` is known only at
run time), with sizes unknown when traced, or with a layer called more than
once, the kernels. The bias's norm is that of each unit's summed ``g``.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from per_example_grads._core.example_ops import WIDE
from per_example_grads._core.xla_context import in_xla_context
from per_example_grads.rules import conv, grouped, path_costs
from per_example_grads.rules import outer_products as op
from per_example_grads.rules.conv_transpose import ConvTransposeRule

CONV_FORM = "auto"  # "kernels" or "gram" force one form (tests); "auto": by cost


def _conv_parts(rule, layer, calls, ids, count, keep) -> grouped.UnitParts:
    """``grouped.UnitParts`` of a ``ConvPatchesRule`` layer by the form of the module docstring."""
    kernels = lambda keep_: grouped.fallback_parts(rule, layer, calls, ids, count, keep_)  # noqa: E731
    if not grouped.NATIVE_FORMS or len(calls) != 1 or CONV_FORM == "kernels" or in_xla_context():
        return kernels(keep)
    ((saved, grads),) = calls
    spec = conv.ConvSpec.of(layer)
    a, g = rule.convolution_operands(saved, grads)
    shape = conv.conv_shape(spec, a, g)
    b = ids.shape[0]
    if shape is None or b is None or not isinstance(count, int) or count == 0:
        if CONV_FORM != "gram":
            return kernels(keep)
    if CONV_FORM != "gram":
        shape = dataclasses.replace(shape, batch=b)  # the ids' static length, where the batch size is unknown
        fits = keep and grouped.kept_fits(calls, [tf.TensorShape(v.shape) for v in rule.variables(layer)], ids, count)
        by_kernels, by_gram = conv_costs(shape, count, -(-b // count), keep, fits)
        if by_kernels <= by_gram:
            return kernels(keep)
    builder = path_costs.cheapest_patches(shape, path_costs.machine())[0] if shape is not None else None
    p, g2 = conv.patches(spec, a, builder), op.as_btf(g)
    layout = grouped._layout(ids, count)

    def gram_norms():
        norms = grouped._unit_gram([(p, g2)], ids, count, layout)
        if layer.use_bias:
            norms.append(grouped._bias_squares([tf.reduce_sum(op.as_btf(grads[0]), axis=1)], ids, count))
        return [tf.cast(n, WIDE) for n in norms]

    if CONV_FORM == "gram":
        return grouped.UnitParts(gram_norms())
    r = tf.cast(layout.r, tf.float64)
    by_kernels, by_gram = conv_costs(shape, count, r, False, False)
    norms = tf.cond(by_gram < by_kernels, gram_norms, lambda: [tf.cast(n, WIDE) for n in kernels(False).norms])
    return grouped.UnitParts(list(norms))


def conv_costs(s: path_costs.ConvShape, units: int, r, for_sum: bool, kept: bool) -> tuple:
    """``(kernels, gram)``: the priced seconds of the two forms for ``s`` (``s.batch`` rows), ``r`` a number or a tensor.

    kernels: the cheapest materialized ``G_n`` (``path_costs.materialized_cost``),
    their segment sum and the squares of ``[U, f, k]``; with ``for_sum`` the
    clipped sum from the kept per-unit kernels (``kept``) or the kernel VJP.
    gram: the cheapest patches, their layout into units, two ``[U, R T, R T]``
    Gram products and their elementwise product; with ``for_sum`` the VJP.
    The Gram products are priced at the full matrix rate (``R T`` is at
    least the vector width wherever the Gram form can win).
    """
    m = path_costs.machine()
    b, t, f, k = s.batch, s.positions, s.features, s.c_out
    element = 2.0 * path_costs.BYTES / m.copy_bytes_s
    by_kernels = path_costs.materialized_cost(s, m)[1] + element * (b * f * k + units * f * k)
    positions = r * t
    by_gram = path_costs.cheapest_patches(s, m)[1] + element * (b * t * (f + k) + 3 * units * positions * positions)
    by_gram += 2.0 * units * positions * positions * (f + k) / m.flops + 4 * m.op_s
    if for_sum:
        vjp = path_costs.vjp_sum_cost(s, m)
        by_kernels += element * units * f * k if kept else vjp
        by_gram += vjp
    return by_kernels, by_gram


grouped.register_grouped_parts(conv.ConvPatchesRule, _conv_parts)
grouped.register_grouped_parts(ConvTransposeRule, _conv_parts)
