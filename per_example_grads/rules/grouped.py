"""Grouped forms of the rules: squared norms of each *unit's* gradient, one layer at a time.

A unit is a group of rows of the batch (a user's examples). With ``ids``
``[B]`` int32 in ``[0, count)``, unit ``u``'s gradient of a variable is
``G_u = sum_{n: ids[n] = u} grad_n``, the sum of its rows' (weighted)
gradients, and ``grouped_squared_norms`` gives ``||G_u||^2`` per variable
(``[count]`` each) from what the rule's ``forward`` saved and the loss
gradients at its taps, over every call of the layer (a layer called several
times adds its calls' gradients before the square). Units with no rows get 0.

A rule's grouped form is registered for its class (``register_grouped_norms``,
or ``register_grouped_parts`` for a form that may also keep the per-unit
gradients ``G_u`` for the clipped sum: ``UnitParts``); a rule without one
gets the exact fallback (``fallback_parts``): its ``per_example`` gradients,
summed over the calls, segment-summed into units and squared (this layer
only: ``B x (layer's parameters)`` for the time of that layer), the ``[U,
*var.shape]`` sums kept for the clipped sum when no larger than what the
layer holds until then anyway (``kept_fits``), so that it costs one
matrix-vector product rather than the rule's ``weighted_sum``. That is what
the normalization, scale, bias-like and other small rules use (their
per-example gradients are as small as the layer's outputs per example, so a
closed form would save nothing), and what depthwise, separable and grouped
convolutions (whose example-level rules build every example's kernel
anyway), recurrent layers and the layer-local fallback use.

Grouped forms:

- Dense, and EinsumDense equations that are a Dense in disguise
  (``rules.einsum_dense``): with the rows ``r = (n, t)`` (example, position)
  of ``a`` ``[B, T, i]`` and ``g`` ``[B, T, j]`` over every call,
  ``||G_u||^2 = sum_{r, s in u} (a_r . a_s)(g_r . g_s)``, by the cheapest
  of three forms for the batch's units (``kernel_squared_norms``): the Gram
  matrices of all ``N = B T`` rows masked to pairs of one unit, the Gram
  form over each unit's examples laid end to end as one padded example
  (``unit_examples``: ``[U, R T, i]``, ``R`` the most examples of any unit),
  or each unit's ``[i, j]`` kernel built from those. The bias's from the same form: the
  sum of the ``g`` Gram matrix over the unit's pairs, or the unit's summed ``g``.
- Embedding: ``||G_u||^2 = sum_v ||sum_{r in u: x_r = v} g_r||^2``: each
  unit's ids sorted (``[U, R T]``, the example-level rule's sort with units
  for examples) and only the rows whose id repeats in their unit summed by
  group, cost ``O(B T D)``; with units so uneven that the padded layout
  would more than double the rows, and under XLA, one sort of all ``B T``
  (unit, id) keys.
- Conv1D/2D/3D and their transposed versions (``rules.grouped_conv``):
  per-unit kernels from every example's, or the Gram form over each unit's
  positions, by cost.
- ReversibleEmbedding (a table used as lookup and tied output projection):
  by cost (``_reversible_embedding_parts``), each unit's ``[V, D]`` table
  (``unit_tables``: rows summed by (unit, id), the projection by one batched
  product per unit), kept for the clipped sum; or each unit's examples laid
  end to end as one example (``unit_examples``) and the rule's own
  example-level form on those.

Under XLA (``jit_compile``), which needs static shapes, the forms that lay
units out as padded examples (``R`` rows, known only at run time) give way
to the masked Gram form, the static forms (per-unit tables and kernels from
every example's) or the exact fallback; ``num_units`` must then be given (a
Python int), not inferred (``engines.grouped.make_units`` refuses it).

They are computed in the rules' compute dtype (float32, or float64 for
float64 layers) and returned as float64. Where a form's float32 products
overflow for a unit whose gradient is finite (entries beyond about 1.8e19),
that layer's norms are recomputed by the exact fallback, which squares in
float64 (``example_ops.widened``), in a ``tf.cond`` taken only for such a
batch (``grouped_parts``); a unit whose gradient is NaN or Inf keeps a
non-finite norm, and the clipped sum leaves it out. Squared norms that rounding drives below zero (a Gram form
over rows whose gradients cancel) are returned as 0.

The forms live in this module (and ``grouped_conv.py``), registered per rule class, rather than
beside each rule: the rule modules stay as they are, and a rule's grouped
form reads only what its ``forward`` saves (for Dense, the input; for
Embedding, the flat ids).
"""

from __future__ import annotations

import dataclasses
import math
import string
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import tensorflow as tf

from per_example_grads._core.example_ops import WIDE, compute_dtype, squares_part, weighted_example_sum, widened
from per_example_grads._core.xla_context import in_xla_context
from per_example_grads.per_example_slices import PerExampleSlices, repeated_rows
from per_example_grads.rules import path_costs
from per_example_grads.rules import reversible_embedding as rev
from per_example_grads.rules.dense import DenseRule
from per_example_grads.rules.einsum_dense import EinsumDenseRule
from per_example_grads.rules.embedding import EmbeddingRule
from per_example_grads.rules.rule import LayerRule, sum_to_shape

# (rule, layer, calls, ids, count) -> list of [count] squared norms aligned with rule.variables(layer)
GroupedNorms = Callable[[LayerRule, Any, Sequence[tuple[Any, Sequence[tf.Tensor]]], tf.Tensor, Any], list]


@dataclasses.dataclass(frozen=True)
class UnitParts:
    """What a grouped form gives for one layer.

    Attributes:
      norms: ``||G_u||^2`` per variable of ``rule.variables(layer)``, ``[count]`` each.
      kept: None, or the per-unit gradients ``G_u`` ``[count, *var.shape]``
        per variable (in the compute dtype), which the clipped sum then
        reads (``sum_u c_u G_u``, one matrix-vector product) instead of
        calling the rule's ``weighted_sum``.
    """

    norms: list
    kept: list | None = None


# (rule, layer, calls, ids, count, keep) -> UnitParts (kept only when keep)
GroupedParts = Callable[[LayerRule, Any, Sequence[tuple[Any, Sequence[tf.Tensor]]], tf.Tensor, Any, bool], UnitParts]

GROUPED: dict[type, GroupedParts] = {}

GRAM_LIMIT = 1 << 22  # most entries of a masked [N, N] row Gram matrix (16 MiB in float32)
NATIVE_FORMS = (
    True  # False: convolutions on the fallback, ReversibleEmbedding on the Gram form, nothing kept (comparisons)
)


def register_grouped_norms(rule_class: type, fn: GroupedNorms) -> None:
    """Registers ``fn`` as the grouped form of ``rule_class`` (exactly that class, not its subclasses).

    ``fn(rule, layer, calls, ids, count)`` returns ``||G_u||^2`` per variable
    of ``rule.variables(layer)``, ``[count]`` each (any float dtype), for
    ``calls`` a list of ``(saved, grads)``, one per call of the layer.
    Subclasses are not covered: one that changes ``per_example`` needs its
    own form, and gets the exact fallback until it has one.
    """
    register_grouped_parts(
        rule_class, lambda rule, layer, calls, ids, count, keep: UnitParts(fn(rule, layer, calls, ids, count))
    )


def register_grouped_parts(rule_class: type, fn: GroupedParts) -> None:
    """As ``register_grouped_norms``, for a form that may keep its per-unit gradients for the clipped sum.

    ``fn(rule, layer, calls, ids, count, keep)`` returns a ``UnitParts``;
    with ``keep`` False (no clipped sum follows) its ``kept`` must be None.
    """
    if not (isinstance(rule_class, type) and issubclass(rule_class, LayerRule)):
        raise TypeError(f"rule_class must be a LayerRule subclass; got {rule_class!r}.")
    GROUPED[rule_class] = fn


def has_grouped_form(rule: LayerRule) -> bool:
    """Whether ``rule`` has a registered grouped form (else ``grouped_squared_norms`` materializes this layer)."""
    return type(rule) in GROUPED


def grouped_parts(
    rule: LayerRule, layer, calls: Sequence[tuple[Any, Sequence[tf.Tensor]]], ids: tf.Tensor, count, keep: bool = False
) -> UnitParts:
    """``UnitParts`` of one layer: float64 ``[count]`` squared norms per variable, and with ``keep`` maybe ``G_u``.

    Args:
      rule, layer: the layer's rule and the layer.
      calls: ``(saved, grads)`` of each call of the layer, in call order.
      ids: ``[B]`` int32 unit of each row, in ``[0, count)``.
      count: the number of units ``U`` (an int or a scalar int32 tensor).
      keep: a clipped sum follows: the form may keep ``G_u`` for it.
    """
    form = GROUPED.get(type(rule))
    if form is None:
        parts = fallback_parts(rule, layer, calls, ids, count, keep)
        return UnitParts([tf.cast(n, WIDE) for n in parts.norms], parts.kept if keep else None)
    parts = form(rule, layer, calls, ids, count, keep)
    norms = [tf.cast(n, WIDE) for n in parts.norms]
    if any(n.dtype != WIDE for n in parts.norms):  # float32 products may overflow where the gradients do not
        norms = _overflow_recomputed(norms, lambda: fallback_parts(rule, layer, calls, ids, count, False).norms)
    return UnitParts(norms, parts.kept if keep else None)


def _overflow_recomputed(norms: list, exact: Callable[[], list]) -> list:
    """``norms`` (float64 ``[count]`` per variable), with each unit whose norms are not all finite given ``exact()``'s.

    A form's float32 products overflow (or give ``inf - inf``) for a unit
    whose gradient entries pass about 1.8e19, although its gradient is
    finite; ``exact`` is the fallback, which squares in float64 where float32
    would overflow (``widened``). It runs only for a batch with such a unit
    (a ``tf.cond``): a unit whose gradient is itself NaN or Inf stays
    non-finite, and the clipped sum leaves it out.
    """
    finite = tf.reduce_all(tf.stack([tf.math.is_finite(n) for n in norms]), axis=0)

    def recomputed():
        return [tf.where(finite, n, tf.cast(e, WIDE)) for n, e in zip(norms, exact())]

    return tf.cond(tf.reduce_all(finite), lambda: norms, recomputed)


def grouped_squared_norms(
    rule: LayerRule, layer, calls: Sequence[tuple[Any, Sequence[tf.Tensor]]], ids: tf.Tensor, count
) -> list:
    """``||G_u||^2`` per variable of ``rule.variables(layer)``: list of ``[count]`` float64 (module docstring)."""
    return grouped_parts(rule, layer, calls, ids, count).norms


def fallback_squared_norms(rule: LayerRule, layer, calls, ids: tf.Tensor, count) -> list:
    """The exact fallback's norms (``fallback_parts``)."""
    return fallback_parts(rule, layer, calls, ids, count, False).norms


def fallback_parts(rule: LayerRule, layer, calls, ids: tf.Tensor, count, keep: bool) -> UnitParts:
    """The exact fallback: ``per_example`` summed over calls, segment-summed into units, squared (``widened``).

    With ``keep``, the per-unit gradients are kept for the clipped sum when
    they are no larger than what the layer's calls hold until then anyway
    (``kept_fits``); otherwise the clipped sum is the rule's ``weighted_sum``.
    """
    total = None
    for saved, grads in calls:
        pe = [
            tf.convert_to_tensor(t) if isinstance(t, PerExampleSlices) else t
            for t in rule.per_example(layer, saved, grads)
        ]
        total = pe if total is None else [a + b for a, b in zip(total, pe)]
    per_unit = [tf.math.unsorted_segment_sum(t, ids, count) for t in total]
    norms = widened([squares_part(t) for t in per_unit])
    fits = keep and NATIVE_FORMS and kept_fits(calls, [t.shape[1:] for t in per_unit], ids, count)
    return UnitParts(norms, per_unit if fits else None)


def kept_fits(calls, shapes: Sequence[tf.TensorShape], ids: tf.Tensor, count) -> bool:
    """Whether ``U`` per-unit gradients of ``shapes`` hold no more elements than the calls' saved tensors and gradients.

    Those are held until the clipped sum anyway, so keeping ``G_u`` at most
    doubles this layer's memory (the example-level rule of ``rules.conv``,
    per unit). Sizes are static: with the batch size unknown when traced,
    ``U`` is taken to be the batch size (``U <= B`` when every unit has a
    row), and with any size unknown nothing is kept.
    """
    if not all(s.is_fully_defined() for s in shapes):
        return False
    per_unit = sum(s.num_elements() for s in shapes)
    held = 0
    for saved, grads in calls:
        for t in tf.nest.flatten((saved, list(grads))):
            if not tf.is_tensor(t) or t.shape.rank is None or t.shape.rank == 0:
                continue
            if not t.shape[1:].is_fully_defined():
                return False
            held += t.shape[1:].num_elements()
    b = ids.shape[0]
    if b is None or not isinstance(count, int):
        return per_unit <= held  # per example: U <= B taken
    return count * per_unit <= b * held


def unit_weighted_sum(factors: tf.Tensor, kept: tf.Tensor, dtype) -> tf.Tensor:
    """``[*var.shape]``: ``sum_u factors[u] G_u`` from kept ``[U, *var.shape]``, in ``dtype``."""
    return tf.cast(weighted_example_sum(tf.cast(factors, kept.dtype), kept), dtype)


# -- shared maths --------------------------------------------------------------


def _btf(t: tf.Tensor) -> tf.Tensor:
    """``[B, ..., f]`` -> ``[B, T, f]`` in the compute dtype, ``T`` (the product of the middle axes) static when known."""
    t = tf.cast(t, compute_dtype(t.dtype))
    positions, f = t.shape[1:-1], t.shape[-1]
    if positions.is_fully_defined() and f is not None:
        return tf.reshape(t, [-1, positions.num_elements(), f])
    return tf.reshape(t, [tf.shape(t)[0], -1, f if f is not None else tf.shape(t)[-1]])


def _nonnegative(t: tf.Tensor) -> tf.Tensor:
    return tf.maximum(t, tf.zeros_like(t))


class Layout(NamedTuple):
    """Where each row goes when each unit's rows are laid end to end (``_layout``).

    Attributes:
      r: scalar int32 ``R``, the most rows of any unit (at least 1).
      source: ``[U, R]`` int32, the row at each ``(unit, rank within the unit)``, -1 for padding.
    """

    r: tf.Tensor
    source: tf.Tensor

    def at_most_doubles(self, ids: tf.Tensor) -> tf.Tensor:
        """Scalar bool: the padded layout's ``U R`` slots are at most twice the ``B`` rows."""
        return tf.size(self.source) <= 2 * tf.shape(ids)[0]


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> {(ids, count): Layout}


def _layout(ids: tf.Tensor, count) -> Layout:
    """The ``Layout`` of units ``ids`` ``[B]`` in ``[0, count)``, built once per graph for every layer's grouped form."""
    if tf.executing_eagerly() or not tf.is_tensor(ids):
        return _new_layout(ids, count)
    layouts = _LAYOUTS.setdefault(tf.compat.v1.get_default_graph(), {})
    key = (ids.ref(), count.ref() if tf.is_tensor(count) else count)
    if key not in layouts:
        layouts[key] = _new_layout(ids, count)
    return layouts[key]


def _new_layout(ids: tf.Tensor, count) -> Layout:
    counts = tf.math.unsorted_segment_sum(tf.ones_like(ids), ids, count)
    order = tf.argsort(ids, stable=True)
    unit = tf.gather(ids, order)
    rank = tf.range(tf.shape(ids)[0]) - tf.gather(tf.cumsum(counts, exclusive=True), unit)
    r = tf.maximum(tf.reduce_max(tf.concat([counts, [0]], 0)), 1)
    source = tf.scatter_nd(tf.stack([unit, rank], 1), order + 1, tf.stack([tf.cast(count, tf.int32), r])) - 1
    return Layout(r, source)


def _padded_rows(flat: tf.Tensor, source: tf.Tensor) -> tf.Tensor:
    """``[*source.shape, F]``: ``flat[source]`` ``[B, F]``, zeros where ``source`` is -1 (one gather, no scatter)."""
    rows = tf.gather(_one_row_at_least(flat), tf.maximum(source, 0))
    return tf.where((source >= 0)[..., None], rows, tf.zeros([], rows.dtype))


def unit_examples(t: tf.Tensor, ids: tf.Tensor, count, layout: Layout | None = None) -> tf.Tensor:
    """``[B, P, ...]`` -> ``[U, R P, ...]``: each unit's examples laid end to end as the positions of one example.

    Examples keep their order within a unit; a unit with fewer than ``R``
    examples (``R`` the most of any unit) is padded with zeros. ``layout``:
    ``_layout(ids, count)`` when already computed.
    """
    layout = _layout(ids, count) if layout is None else layout
    rest = t.shape[2:]
    padded = _padded_rows(tf.reshape(t, [tf.shape(t)[0], -1]), layout.source)  # [U, R, P * prod(rest)]
    return tf.reshape(padded, tf.concat([[tf.shape(padded)[0], -1], tf.constant(rest.as_list(), tf.int32)], 0))


def kernel_squared_norms(
    pairs: Sequence[tuple[tf.Tensor, tf.Tensor]], ids: tf.Tensor, count, bias: bool = False
) -> list | None:
    """``[kernel's [U]]`` and with ``bias`` the bias's: ``||sum_{n in u} sum_c sum_t a_cnt^T g_cnt||^2``, ``||sum_{n in u} sum_c sum_t g_cnt||^2``.

    Over the calls ``c``, from ``(a [B, T_c, i], g [B, T_c, j])`` pairs;
    the bias's for a bias ``[j]`` added at every position (a Dense's, a
    convolution's). Three forms, the cheapest for the batch's units picked
    at run time (``tf.switch_case`` on their costs; ``N = B sum_c T_c``
    rows, ``R`` the most examples of any unit, ``S = R sum_c T_c`` a unit's
    padded positions):

    - the Gram matrices of all ``N`` rows masked to pairs of one unit:
      ``N^2 (i + j)``, only while ``N^2 <= GRAM_LIMIT`` (the best for very
      uneven units);
    - each unit's rows gathered as one padded example (``_unit_rows``) and
      the Gram form over its positions, padding masked out of the ``[U, S,
      S]`` products: ``U S^2 (i + j)``, memory ``U S^2``;
    - each unit's ``[i, j]`` kernel built from its zero-padded rows
      (``unit_examples``): ``U S i j``, and ``U i j`` memory counted twice
      (written and read).

    The Gram forms give the bias's as the sum of the ``g`` Gram matrix over
    the unit's pairs, ``sum_{r, s} g_r . g_s``. Under XLA (static shapes;
    ``R`` is known only at run time) only the masked Gram, where ``N`` is
    static and ``N^2 <= GRAM_LIMIT``; else None, and the caller takes the
    exact fallback. Also None when ``i`` or ``j`` is unknown.
    """
    i, j = pairs[0][0].shape[-1], pairs[0][1].shape[-1]
    if i is None or j is None:
        return None
    b = pairs[0][0].shape[0] if pairs[0][0].shape[0] is not None else ids.shape[0]
    positions = [a.shape[1] for a, _ in pairs]
    n_static = b * sum(positions) if b is not None and None not in positions else None
    masked_ok = n_static is None or n_static * n_static <= GRAM_LIMIT
    if in_xla_context():
        return _masked_gram(pairs, ids, count, bias) if n_static is not None and masked_ok else None
    if n_static is not None and not masked_ok:
        masked_cost = tf.constant(float("inf"), tf.float64)
    else:
        n = tf.cast(sum(tf.shape(a)[0] * tf.shape(a)[1] for a, _ in pairs), tf.float64)
        masked_cost = tf.where(n * n <= GRAM_LIMIT, n * n * (i + j), tf.constant(float("inf"), tf.float64))
    layout = _layout(ids, count)
    total_t = tf.cast(sum(tf.shape(a)[1] for a, _ in pairs), tf.float64)
    units, s = tf.cast(count, tf.float64), tf.cast(layout.r, tf.float64) * total_t
    costs = tf.stack([masked_cost, units * s * s * (i + j), units * s * i * j + 2 * units * i * j])
    choice = tf.argmin(costs, output_type=tf.int32)
    branches = [
        lambda: _unit_gram(pairs, ids, count, layout, bias),
        lambda: _unit_kernels(pairs, ids, count, layout, bias),
    ]
    if masked_ok:
        return tf.switch_case(choice, [lambda: _masked_gram(pairs, ids, count, bias)] + branches)
    return tf.switch_case(choice - 1, branches)


def _masked_gram(pairs, ids, count, bias: bool = False) -> list:
    """``[U]`` sums of ``(a_r . a_s)(g_r . g_s)`` (and ``g_r . g_s``) over pairs of rows (example, call, position) of one unit."""
    a = tf.concat([tf.reshape(a, [-1, a.shape[-1]]) for a, _ in pairs], 0)
    g = tf.concat([tf.reshape(g, [-1, g.shape[-1]]) for _, g in pairs], 0)
    row_ids = tf.concat([tf.repeat(ids, a.shape[1] if a.shape[1] is not None else tf.shape(a)[1]) for a, _ in pairs], 0)
    same = tf.equal(row_ids[:, None], row_ids[None, :])
    g_gram = tf.matmul(g, g, transpose_b=True)
    grams = [tf.matmul(a, a, transpose_b=True) * g_gram] + ([g_gram] if bias else [])
    # where, not a product with the mask: a NaN row stays in its unit
    return [
        _nonnegative(
            tf.math.unsorted_segment_sum(
                tf.reduce_sum(tf.where(same, m, tf.zeros([], m.dtype)), axis=1), row_ids, count
            )
        )
        for m in grams
    ]


def _one_row_at_least(t: tf.Tensor) -> tf.Tensor:
    """``t`` ``[B, ...]``, or one zero row when ``B = 0``, to gather padding from (Pad forwards its input when nothing is padded)."""
    extra = tf.cast(tf.equal(tf.shape(t)[0], 0), tf.int32)
    return tf.pad(t, tf.concat([[[0, extra]], tf.zeros([t.shape.rank - 1, 2], tf.int32)], 0))


def _unit_rows(pairs, count, layout: Layout) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """``(a [U, S, i], g [U, S, j], real [U, S] bool)``: every call's rows gathered unit by unit, calls end to end.

    Padding positions hold some row's values (no zeros written): ``real``
    marks the others, and the Gram forms mask their products with it.
    """
    real = layout.source >= 0  # [U, R]
    index = tf.maximum(layout.source, 0)
    u = tf.cast(count, tf.int32)
    a_parts, g_parts, real_parts = [], [], []
    for a, g in pairs:
        t = a.shape[1] if a.shape[1] is not None else tf.shape(a)[1]
        a_parts.append(tf.reshape(tf.gather(_one_row_at_least(a), index), [u, -1, a.shape[-1]]))
        g_parts.append(tf.reshape(tf.gather(_one_row_at_least(g), index), [u, -1, g.shape[-1]]))
        real_parts.append(tf.reshape(tf.repeat(real[:, :, None], t, axis=2), [u, -1]))
    if len(pairs) == 1:
        return a_parts[0], g_parts[0], real_parts[0]
    return tf.concat(a_parts, 1), tf.concat(g_parts, 1), tf.concat(real_parts, 1)


def _unit_gram(pairs, ids, count, layout, bias: bool = False) -> list:
    """The Gram form over each unit example's positions (``[U, S, S]``): the kernel's ``[U]`` (and with ``bias`` the bias's)."""
    a, g, real = _unit_rows(pairs, count, layout)
    pairs_real = tf.logical_and(real[:, :, None], real[:, None, :])
    g_gram = tf.matmul(g, g, transpose_b=True)
    grams = [tf.matmul(a, a, transpose_b=True) * g_gram] + ([g_gram] if bias else [])
    return [_nonnegative(tf.reduce_sum(tf.where(pairs_real, m, tf.zeros([], m.dtype)), axis=[1, 2])) for m in grams]


def _unit_kernels(pairs, ids, count, layout, bias: bool = False) -> list:
    """The squared norms of each unit's ``[i, j]`` kernel (and ``[j]`` bias), built from its zero-padded unit example."""
    a = tf.concat([unit_examples(a, ids, count, layout) for a, _ in pairs], 1)
    g = tf.concat([unit_examples(g, ids, count, layout) for _, g in pairs], 1)
    out = [tf.reduce_sum(tf.square(tf.matmul(a, g, transpose_a=True)), axis=[1, 2])]
    return out + ([tf.reduce_sum(tf.square(tf.reduce_sum(g, axis=1)), axis=1)] if bias else [])


def _bias_squares(biases: Sequence[tf.Tensor], ids: tf.Tensor, count) -> tf.Tensor:
    """``[U]``: ``||sum_{n in u} sum_c b_cn||^2`` from per-example ``[B, ...]`` parts of each call."""
    per_unit = tf.math.unsorted_segment_sum(tf.add_n(list(biases)), ids, count)
    return tf.reduce_sum(tf.square(per_unit), axis=list(range(1, per_unit.shape.rank)))


def _kernel_and_bias(rule, layer, calls, pairs, biases, ids, count) -> list:
    """``[kernel's [U], bias's [U]]`` (no bias: ``biases`` None), or the exact fallback where ``kernel_squared_norms`` gives None."""
    kernel = kernel_squared_norms(pairs, ids, count)
    if kernel is None:
        return fallback_squared_norms(rule, layer, calls, ids, count)
    return list(kernel) + ([] if biases is None else [_bias_squares(biases, ids, count)])


# -- Dense and EinsumDense -------------------------------------------


def _dense_norms(rule, layer, calls, ids, count):
    pairs = [(_btf(saved), _btf(grads[0])) for saved, grads in calls]
    # a Dense's bias is [j], added at every position: kernel_squared_norms gives its norm too
    norms = kernel_squared_norms(pairs, ids, count, bias=layer.bias is not None)
    return fallback_squared_norms(rule, layer, calls, ids, count) if norms is None else list(norms)


def _equation(equation: str, rank: int) -> tuple[str, str, str]:
    """``(input, kernel, output)`` subscripts of an EinsumDense equation, ``...`` spelled out for an input of ``rank``."""
    lhs, out = equation.replace(" ", "").split("->")
    inp, kern = lhs.split(",")
    if "..." in inp:
        free = [c for c in string.ascii_uppercase if c not in equation]
        ell = "".join(free[: rank - (len(inp) - 3)])
        inp, out = inp.replace("...", ell), out.replace("...", ell)
    return inp, kern, out


def _as_dense(layer, a: tf.Tensor, g: tf.Tensor):
    """``(a [B, M, C], g [B, M, K])`` when the equation is a Dense in disguise (``rules.einsum_dense``), else None."""
    inp, kern, out = _equation(layer.equation, a.shape.rank)
    b = inp[0]
    contracted = "".join(c for c in inp if c in kern)
    positions = "".join(c for c in inp[1:] if c not in kern)
    outputs = "".join(c for c in kern if c not in inp)
    if set(out[1:]) != set(positions) | set(outputs) or len(out) != 1 + len(positions) + len(outputs):
        return None
    dims = dict(zip(kern, layer.kernel.shape))
    a = tf.einsum(f"{inp}->{b}{positions}{contracted}", a)
    g = tf.einsum(f"{out}->{b}{positions}{outputs}", g)
    m = a.shape[1 : 1 + len(positions)].num_elements()  # static when known (the forms' costs use it)
    c, k = math.prod(dims[x] for x in contracted), math.prod(dims[x] for x in outputs)
    if m is not None:
        return tf.reshape(a, [-1, m, c]), tf.reshape(g, [-1, m, k])
    return tf.reshape(a, [tf.shape(a)[0], -1, c]), tf.reshape(g, [tf.shape(g)[0], -1, k])


def _einsum_dense_norms(rule, layer, calls, ids, count):
    pairs, biases = [], []
    for saved, grads in calls:
        dtype = compute_dtype(saved.dtype)
        g = tf.cast(grads[0], dtype)
        view = _as_dense(layer, tf.cast(saved, dtype), g)
        if view is None:
            return fallback_squared_norms(rule, layer, calls, ids, count)
        pairs.append(view)
        if layer.bias is not None:
            biases.append(sum_to_shape(g, layer.bias.shape))
    return _kernel_and_bias(rule, layer, calls, pairs, biases if layer.bias is not None else None, ids, count)


# -- Embedding ------------------------------------------------------------------


def embedding_squared_norms(
    flat_ids: tf.Tensor, rows: tf.Tensor, row_ids: tf.Tensor, vocabulary: int, count
) -> tf.Tensor:
    """``[U]``: ``sum_v ||sum_{r in u: x_r = v} g_r||^2`` from ``[N]`` ids, ``[N, D]`` rows and their ``[N]`` units.

    The rows are sorted by the key ``unit * vocabulary + id`` and summed per
    run of equal keys (sort and cumulative sum, no ``tf.unique``: XLA takes it too).
    """
    key = tf.cast(row_ids, tf.int64) * vocabulary + tf.cast(flat_ids, tf.int64)
    order = tf.argsort(key, stable=True)
    sorted_key = tf.gather(key, order)
    n = tf.shape(key)[0]
    first = tf.concat([tf.ones(tf.minimum(n, 1)[None], tf.bool), sorted_key[1:] != sorted_key[:-1]], 0)
    run = tf.cumsum(tf.cast(first, tf.int32)) - 1
    sums = tf.math.unsorted_segment_sum(tf.gather(rows, order), run, n)
    squares = tf.reduce_sum(tf.square(sums), axis=1)
    unit = tf.cast(sorted_key // vocabulary, tf.int32)
    return tf.math.unsorted_segment_sum(
        tf.where(first, tf.gather(squares, run), tf.zeros_like(squares[:1])), unit, count
    )


def unit_embedding_squared_norms(x: tf.Tensor, g: tf.Tensor, ids: tf.Tensor, count, layout=None) -> tf.Tensor:
    """``[U]``: ``sum_v ||sum_{r in u: x_r = v} g_r||^2`` from ids ``x`` ``[B, T]`` and rows ``g`` ``[B, T, D]``.

    Each unit's ids are laid end to end (``_layout``: ``[U, R T]``, padding
    positions given distinct negative ids, so that they never repeat) and
    sorted unit by unit (``repeated_rows``, as the example-level rule sorts
    each example's): only the rows whose id repeats within their unit are
    gathered and summed by group; every other row adds its own
    ``||g_r||^2``. Sorting ``U`` rows of ``R T`` ids costs about what the
    example-level sort of ``B`` rows of ``T`` does when units are even
    (``U R = B``), and nothing of size ``V`` or ``U R T D`` is built.
    """
    b, t = tf.shape(x)[0], tf.shape(x)[1]
    layout = _layout(ids, count) if layout is None else layout
    u = tf.cast(count, tf.int32)
    # 1 + the flat row n T + t of each unit position, 0 for padding
    rows = tf.reshape(tf.range(1, b * t + 1), [b, t])
    where = tf.reshape(_padded_rows(rows, layout.source), [u, -1])  # [U, R T]
    padding = -tf.reshape(tf.range(1, tf.size(where) + 1), [u, -1])
    unit_ids = tf.where(where > 0, tf.gather(tf.reshape(x, [-1]), tf.maximum(where, 1) - 1), padding)
    repeats = repeated_rows(unit_ids, only_repeated=True)
    source = tf.gather(tf.reshape(where, [-1]), repeats.rows) - 1  # the repeated rows' flat rows in g (never padding)
    flat = tf.reshape(g, [-1, tf.shape(g)[2]])  # [B T, D]
    n = tf.shape(source)[0]
    sums = tf.math.unsorted_segment_sum(tf.gather(flat, source), repeats.group, n)  # group k's sum in row k
    owner = tf.maximum(tf.math.unsorted_segment_max(repeats.example, repeats.group, n), 0)  # group k's unit
    grouped = tf.math.unsorted_segment_sum(tf.reduce_sum(tf.square(sums), axis=1), owner, count)
    repeated = tf.scatter_nd(source[:, None], tf.ones([n], flat.dtype), [b * t])
    alone = tf.reduce_sum(tf.reshape(tf.reduce_sum(tf.square(flat), axis=1) * (1 - repeated), [b, t]), axis=1)
    return tf.math.unsorted_segment_sum(alone, ids, count) + grouped


def _embedding_norms(rule, layer, calls, ids, count):
    """By the unit sort (``unit_embedding_squared_norms``) while the padded layout at most doubles the rows; else, and
    under XLA (static shapes), by one sort of all rows (``embedding_squared_norms``)."""
    flat, rows = [], []
    for (x, _), grads in calls:  # saved: (flat ids [B, T], repeats)
        flat.append(x)
        g = tf.reshape(grads[0], [tf.shape(x)[0], -1, layer.output_dim])
        rows.append(tf.cast(g, compute_dtype(g.dtype)))
    x, g = (flat[0], rows[0]) if len(calls) == 1 else (tf.concat(flat, 1), tf.concat(rows, 1))

    def by_one_sort():
        t = x.shape[1] if x.shape[1] is not None else tf.shape(x)[1]
        return embedding_squared_norms(
            tf.reshape(x, [-1]), tf.reshape(g, [-1, layer.output_dim]), tf.repeat(ids, t), layer.input_dim, count
        )

    if in_xla_context():
        return [by_one_sort()]
    layout = _layout(ids, count)
    return [
        tf.cond(
            layout.at_most_doubles(ids), lambda: unit_embedding_squared_norms(x, g, ids, count, layout), by_one_sort
        )
    ]


# -- ReversibleEmbedding: per-unit tables, or each unit's rows as one padded example --

REVERSIBLE_FORM = "auto"  # "tables" or "gram" force one form (tests); "auto": by cost (``_reversible_embedding_parts``)
TABLE_LIMIT = 1 << 26  # most elements of the per-example [B, V, D] projection gradients the table form builds


def _reversible_embedding_parts(rule, layer, calls, ids, count, keep):
    """The cheaper of the per-unit tables (``unit_tables``) and the Gram form on unit examples.

    Priced (``_reversible_costs``) with ``B`` rows, ``U`` units, ``S`` and
    ``T`` the reversed and looked-up positions per example, ``R`` the most
    rows of any unit: the tables cost ``B S V D`` multiply-adds and ``B V D``
    elements written, whatever the units; the Gram form ``U (R S)^2 (V +
    D)`` and ``U R^2 S T D``, plus, for a clipped sum, the rule's own
    ``B S V D`` contraction, which kept tables replace by ``U V D``. The
    choice is made when traced, with ``R = ceil(B / U)`` (even units: the
    Gram form's least cost), where the tables win or under XLA (the tables'
    shapes are static; the Gram form's are not) or with sizes unknown; else
    at run time (``tf.cond`` on ``R``, norms only: the clipped sum is then
    the rule's). The tables are built only while ``B V D <= TABLE_LIMIT``
    (else the Gram form; under XLA the exact fallback).
    """
    v, d = layer.input_dim, layer.output_dim
    b = ids.shape[0]
    s_total = _total([_positions(saved) for saved, _ in calls if saved[0] == rev.REVERSE])
    t_total = _total([_positions(saved) for saved, _ in calls if saved[0] == rev.LOOKUP])
    static = b is not None and isinstance(count, int) and count > 0 and None not in (s_total, t_total)
    fits = b is not None and b * v * d <= TABLE_LIMIT
    if not NATIVE_FORMS:
        return UnitParts(
            fallback_squared_norms(rule, layer, calls, ids, count)
            if in_xla_context()
            else _reversible_embedding_norms(rule, layer, calls, ids, count)
        )
    if REVERSIBLE_FORM == "tables" or (in_xla_context() and fits):
        form = "tables"
    elif in_xla_context():
        return fallback_parts(rule, layer, calls, ids, count, keep)
    elif REVERSIBLE_FORM == "gram" or not fits or not static:
        form = "gram" if REVERSIBLE_FORM == "gram" or not fits else "cond"
    else:
        tables, gram = _reversible_costs(b, count, -(-b // count), s_total, t_total, v, d, keep)
        form = "tables" if tables <= gram else "cond"
    if form == "tables":
        per_unit = unit_tables(rule, layer, calls, ids, count)
        return UnitParts(widened([squares_part(t) for t in per_unit]), per_unit if keep else None)
    if form == "gram":
        return UnitParts(_reversible_embedding_norms(rule, layer, calls, ids, count))
    counts = tf.math.unsorted_segment_sum(tf.ones_like(ids), ids, count)
    r = tf.cast(tf.reduce_max(tf.concat([counts, [1]], 0)), tf.float64)
    tables, gram = _reversible_costs(b, count, r, s_total, t_total, v, d, False)
    n = len(rule.variables(layer))

    def by_tables():
        return widened([squares_part(t) for t in unit_tables(rule, layer, calls, ids, count)])

    norms = tf.cond(
        tables <= gram,
        by_tables,
        lambda: [tf.cast(x, WIDE) for x in _reversible_embedding_norms(rule, layer, calls, ids, count)],
    )
    return UnitParts(list(norms)[:n])


def _total(sizes: list) -> int | None:
    return None if None in sizes else sum(sizes)


def _positions(saved) -> int | None:
    """A call's positions per example, static or None: a lookup's ``T`` (ids ``[B, T]``), a reversed call's ``S`` (``[B, ..., D]``)."""
    t = saved[1]
    inner = t.shape[1:] if saved[0] == rev.LOOKUP else t.shape[1:-1]
    return inner.num_elements() if inner.is_fully_defined() else None


def _reversible_costs(b, u, r, s, t, v, d, for_sum: bool):
    """``(tables, gram)``: the priced seconds of the two forms (``_reversible_embedding_parts``); ``r`` a number or a tensor.

    Multiply-adds at ``path_costs``' matrix rate, elements written and read at its copy rate.
    """
    m = path_costs.machine()
    flop, elements = 2.0 / m.flops, 2.0 * path_costs.BYTES / m.copy_bytes_s
    tables = flop * b * s * v * d + elements * (b * v * d + b * t * d + u * v * d)
    gram = flop * u * (r * s) * (r * s) * (v + d) + flop * u * r * s * r * t * d
    gram += elements * (b * s * (v + d) + b * t * d + u * (r * s) * (r * s + r * t))
    if for_sum:
        tables += elements * u * v * d
        gram += flop * b * s * v * d + elements * v * d
    return tables, gram


def _unit_projection(h: tf.Tensor, g: tf.Tensor, ids: tf.Tensor, count, layout) -> tf.Tensor:
    """``[U, V, D]``: ``sum_{n in u} g_n^T h_n`` from ``h`` ``[B, S, D]`` and ``g`` ``[B, S, V]``.

    Outside XLA (``layout`` given), while ``U R <= 2 B`` (``R`` the most rows
    of any unit: the padding at most doubles the work), one batched product
    over each unit's rows laid end to end (``unit_examples``: ``[U, R S,
    *]``); else, and under XLA (static shapes), every example's ``[V, D]``
    product, segment-summed into units.
    """

    def by_examples():
        return tf.math.unsorted_segment_sum(tf.matmul(g, h, transpose_a=True), ids, count)

    if layout is None:
        return by_examples()

    def by_units():
        return tf.matmul(unit_examples(g, ids, count, layout), unit_examples(h, ids, count, layout), transpose_a=True)

    return tf.cond(layout.at_most_doubles(ids), by_units, by_examples)


def unit_tables(rule, layer, calls, ids, count) -> list:
    """Per-unit gradients of a ReversibleEmbedding, ``[U, *var.shape]`` per variable of ``rule.variables(layer)``.

    The looked-up rows ``r_t`` (loss gradients at the lookup's outputs) are
    summed by (unit, id) into ``[U, V, D]``; each reversed call's per-example
    projection gradient ``g_n^T h'_n`` ``[B, V, D]`` (one batched product)
    is segment-summed into units (``_unit_projection``): into the table
    when tied, into ``reverse_embeddings``' ``[U, D, V]`` (transposed) when
    not.
    """
    v, d = layer.input_dim, layer.output_dim
    dtype = compute_dtype(layer.embeddings.dtype)
    table, reverse = None, None
    layout = None if in_xla_context() else _layout(ids, count)
    for saved, grads in calls:
        if saved[0] == rev.LOOKUP:
            x = saved[1]
            rows = tf.reshape(rule.lookup_rows(layer, saved, grads), [-1, d])
            positions = x.shape[1] if x.shape[1] is not None else tf.shape(x)[1]
            key = tf.repeat(tf.cast(ids, tf.int64), positions) * v + tf.cast(tf.reshape(x, [-1]), tf.int64)
            part = tf.reshape(tf.math.unsorted_segment_sum(rows, key, tf.cast(count, tf.int64) * v), [-1, v, d])
            table = part if table is None else table + part
            continue
        h, g = rule.projection_operands(layer, saved, grads)
        part = _unit_projection(h, g, ids, count, layout)  # [U, V, D]
        if layer.tie_weights:
            table = part if table is None else table + part
        else:
            part = tf.transpose(part, [0, 2, 1])
            reverse = part if reverse is None else reverse + part
    shape = tf.stack([tf.cast(count, tf.int32), v, d])
    table = tf.zeros(shape, dtype) if table is None else table
    if layer.tie_weights:
        return [table]
    return [table, tf.zeros(tf.stack([shape[0], d, v]), dtype) if reverse is None else reverse]


def _reversible_embedding_norms(rule, layer, calls, ids, count):
    """The rule's own ``shared_squared_norms`` on unit examples (``unit_examples``).

    A unit's gradient is the example-level gradient of the example made of
    its rows' positions: every part of the rule's form (rows grouped by id,
    the projection's Gram form over positions, the cross term) is a sum over
    positions, and a zero padding position (id 0 with a zero gradient, zero
    inputs and gradients for a reversed call) adds nothing to any of them.
    Cost: the projection's Gram form runs over ``R S`` positions per unit,
    ``U (R S)^2 (V + D)`` in all (``R`` times the example-level form's).
    Not under XLA (``R`` is known only at run time).
    """
    layout = _layout(ids, count)
    unit_examples_ = lambda t, ids, count: unit_examples(t, ids, count, layout)  # noqa: E731
    grouped = []
    for saved, grads in calls:
        if saved[0] == rev.LOOKUP:
            flat = unit_examples_(saved[1], ids, count)
            g = tf.reshape(grads[0], [tf.shape(saved[1])[0], -1, layer.output_dim])
            saved = (rev.LOOKUP, flat, repeated_rows(flat, only_repeated=not in_xla_context()))
            grouped.append((saved, [unit_examples_(g, ids, count)]))
        else:
            h = tf.reshape(saved[1], [tf.shape(saved[1])[0], -1, saved[1].shape[-1]])
            g = tf.reshape(grads[0], [tf.shape(grads[0])[0], -1, grads[0].shape[-1]])
            grouped.append(((rev.REVERSE, unit_examples_(h, ids, count)), [unit_examples_(g, ids, count)]))
    return rule.shared_squared_norms(layer, grouped)


register_grouped_parts(rev.ReversibleEmbeddingRule, _reversible_embedding_parts)
register_grouped_norms(DenseRule, _dense_norms)
register_grouped_norms(EinsumDenseRule, _einsum_dense_norms)
register_grouped_norms(EmbeddingRule, _embedding_norms)
