"""Grouped forms of the rules: squared norms of each *unit's* gradient, one layer at a time.

A unit is a group of rows of the batch (a user's examples). With ``ids``
``[B]`` int32 in ``[0, count)``, unit ``u``'s gradient of a variable is
``G_u = sum_{n: ids[n] = u} grad_n``, the sum of its rows' (weighted)
gradients, and ``grouped_squared_norms`` gives ``||G_u||^2`` per variable
(``[count]`` each) from what the rule's ``forward`` saved and the loss
gradients at its taps, over every call of the layer (a layer called several
times adds its calls' gradients before the square). Units with no rows get 0.

A rule's grouped form is registered for its class (``register_grouped_norms``);
a rule without one gets the exact fallback: its ``per_example`` gradients,
summed over the calls, segment-summed into units and squared (this layer
only: ``B x (layer's parameters)`` for the time of that layer). That is what
the normalization, scale, bias-like and other small rules use (their
per-example gradients are as small as the layer's outputs per example, so a
closed form would save nothing), and what convolutions, recurrent layers and
the layer-local fallback use.

Grouped forms (never ``[B, *var.shape]``):

- Dense, and EinsumDense equations that are a Dense in disguise
  (``rules.einsum_dense``): with the rows ``r = (n, t)`` (example, position)
  of ``a`` ``[B, T, i]`` and ``g`` ``[B, T, j]`` over every call,
  ``||G_u||^2 = sum_{r, s in u} (a_r . a_s)(g_r . g_s)``, by the cheapest
  of three forms for the batch's units (``kernel_squared_norms``): the Gram
  matrices of all ``N = B T`` rows masked to pairs of one unit, the Gram
  form within each unit's rows laid out as one padded example (``[U, R, i]``,
  ``R`` the most rows of any unit), or each unit's ``[i, j]`` kernel built
  from those. The bias's is the unit's summed ``g``, ``[U, j]``.
- Conv1D/2D/3D (``groups = 1``, channels last): the Dense form on the
  input patches (``rules.conv.patches``: ``[B, positions, kh kw c_in]``), up
  to ``PATCH_LIMIT`` elements of patches; larger ones take the fallback.
- Embedding: ``||G_u||^2 = sum_v ||sum_{r in u: x_r = v} g_r||^2``, the rows
  grouped by (unit, id) by one sort of ``B T`` keys, cost ``O(B T D)``.
- ReversibleEmbedding (a table used as lookup and tied output projection):
  each unit's rows laid end to end as the positions of one example
  (``unit_examples``), and the rule's own example-level form on those.

They are computed in the rules' compute dtype (float32, or float64 for
float64 layers) and returned as float64; unlike the example-level forms they
have no float64 recomputation for float32 overflow (a unit whose squared
norm overflows gets an infinite norm, and the clipped sum leaves it out,
with a warning). Squared norms that rounding drives below zero (a Gram form
over rows whose gradients cancel) are returned as 0.

The forms live in this one module, registered per rule class, rather than
beside each rule: the rule modules stay as they are, and a rule's grouped
form reads only what its ``forward`` saves (for Dense, the input; for
Embedding, the flat ids).
"""

from __future__ import annotations

import math
import string
from typing import Any, Callable, Sequence

import tensorflow as tf

from per_example_grads._core.example_ops import WIDE, compute_dtype, squares_part, widened
from per_example_grads._core.xla_context import in_xla_context
from per_example_grads.per_example_slices import PerExampleSlices, repeated_rows
from per_example_grads.rules import conv
from per_example_grads.rules import reversible_embedding as rev
from per_example_grads.rules.dense import DenseRule
from per_example_grads.rules.einsum_dense import EinsumDenseRule
from per_example_grads.rules.embedding import EmbeddingRule
from per_example_grads.rules.rule import LayerRule, sum_to_shape

# (rule, layer, calls, ids, count) -> list of [count] squared norms aligned with rule.variables(layer)
GroupedNorms = Callable[[LayerRule, Any, Sequence[tuple[Any, Sequence[tf.Tensor]]], tf.Tensor, Any], list]

GROUPED: dict[type, GroupedNorms] = {}

GRAM_LIMIT = 1 << 22  # most entries of a masked [N, N] row Gram matrix (16 MiB in float32)
PATCH_LIMIT = 1 << 25  # most elements of a convolution's patches [B, positions, f] (128 MiB in float32)


def register_grouped_norms(rule_class: type, fn: GroupedNorms) -> None:
    """Registers ``fn`` as the grouped form of ``rule_class`` (exactly that class, not its subclasses).

    ``fn(rule, layer, calls, ids, count)`` returns ``||G_u||^2`` per variable
    of ``rule.variables(layer)``, ``[count]`` each (any float dtype), for
    ``calls`` a list of ``(saved, grads)``, one per call of the layer.
    Subclasses are not covered: one that changes ``per_example`` needs its
    own form, and gets the exact fallback until it has one.
    """
    if not (isinstance(rule_class, type) and issubclass(rule_class, LayerRule)):
        raise TypeError(f"rule_class must be a LayerRule subclass; got {rule_class!r}.")
    GROUPED[rule_class] = fn


def has_grouped_form(rule: LayerRule) -> bool:
    """Whether ``rule`` has a registered grouped form (else ``grouped_squared_norms`` materializes this layer)."""
    return type(rule) in GROUPED


def grouped_squared_norms(rule: LayerRule, layer, calls: Sequence[tuple[Any, Sequence[tf.Tensor]]], ids: tf.Tensor, count) -> list:
    """``||G_u||^2`` per variable of ``rule.variables(layer)``: list of ``[count]`` float64 (module docstring).

    Args:
      rule, layer: the layer's rule and the layer.
      calls: ``(saved, grads)`` of each call of the layer, in call order.
      ids: ``[B]`` int32 unit of each row, in ``[0, count)``.
      count: the number of units ``U`` (an int or a scalar int32 tensor).
    """
    form = GROUPED.get(type(rule))
    norms = form(rule, layer, calls, ids, count) if form is not None else fallback_squared_norms(rule, layer, calls, ids, count)
    return [tf.cast(n, WIDE) for n in norms]


def fallback_squared_norms(rule: LayerRule, layer, calls, ids: tf.Tensor, count) -> list:
    """The exact fallback: ``per_example`` summed over calls, segment-summed into units, squared (``widened``)."""
    total = None
    for saved, grads in calls:
        pe = [tf.convert_to_tensor(t) if isinstance(t, PerExampleSlices) else t for t in rule.per_example(layer, saved, grads)]
        total = pe if total is None else [a + b for a, b in zip(total, pe)]
    return widened([squares_part(tf.math.unsorted_segment_sum(t, ids, count)) for t in total])


# -- shared maths --------------------------------------------------------------


def _rows(t: tf.Tensor) -> tf.Tensor:
    """``[B, ..., f]`` -> ``[B T, f]`` in the compute dtype (``T`` the product of the middle axes)."""
    t = tf.cast(t, compute_dtype(t.dtype))
    return tf.reshape(t, [-1, t.shape[-1] if t.shape[-1] is not None else tf.shape(t)[-1]])


def _row_ids(t: tf.Tensor, ids: tf.Tensor) -> tf.Tensor:
    """``[B T]``: each row's unit, for ``t`` ``[B, ..., f]`` flattened by ``_rows``."""
    positions = t.shape[1:-1]
    per = positions.num_elements() if positions.is_fully_defined() else tf.reduce_prod(tf.shape(t)[1:-1])
    return tf.repeat(ids, per)


def _nonnegative(t: tf.Tensor) -> tf.Tensor:
    return tf.maximum(t, tf.zeros_like(t))


def _layout(row_ids: tf.Tensor, count):
    """``(scatter indices [N, 2], order [N], R)``: where each row goes in a ``[U, R, ...]`` padded layout, ``R`` the most rows of any unit."""
    n = tf.shape(row_ids)[0]
    counts = tf.math.unsorted_segment_sum(tf.ones_like(row_ids), row_ids, count)
    order = tf.argsort(row_ids, stable=True)
    unit = tf.gather(row_ids, order)
    rank = tf.range(n) - tf.gather(tf.cumsum(counts, exclusive=True), unit)
    r = tf.maximum(tf.reduce_max(tf.concat([counts, [0]], 0)), 1)
    return tf.stack([unit, rank], 1), order, r


def padded_units(rows: tf.Tensor, row_ids: tf.Tensor, count, layout=None) -> tf.Tensor:
    """``[U, R, f]``: each unit's rows in order, zeros after its last (``R`` the most rows of any unit).

    ``rows`` ``[N, f]``, ``row_ids`` ``[N]`` int32 in ``[0, count)``;
    ``layout``: ``_layout(row_ids, count)`` when already computed.
    """
    index, order, r = _layout(row_ids, count) if layout is None else layout
    shape = tf.stack([tf.cast(count, tf.int32), r, tf.shape(rows)[1]])
    return tf.scatter_nd(index, tf.gather(rows, order), shape)


def kernel_squared_norms(a_rows: tf.Tensor, g_rows: tf.Tensor, row_ids: tf.Tensor, count) -> tf.Tensor:
    """``[U]``: ``||sum_{r in u} a_r^T g_r||^2`` from ``[N, i]`` and ``[N, j]`` rows.

    Three forms, the cheapest for the batch's units picked at run time
    (``tf.switch_case`` on their costs; ``R`` the most rows of any unit):

    - the Gram matrices of all ``N`` rows masked to pairs of one unit:
      ``N^2 (i + j)``, only while ``N^2 <= GRAM_LIMIT`` (the best for very
      uneven units);
    - each unit's rows as one padded example and the Gram form within it:
      ``U R^2 (i + j)``, memory ``U R^2``;
    - each unit's ``[i, j]`` kernel built from its padded rows, then squared:
      ``U R i j`` and ``U i j`` memory, counted twice (written and read).
    """
    i, j = a_rows.shape[1], g_rows.shape[1]
    layout = _layout(row_ids, count)
    if i is None or j is None:
        return _unit_kernels(a_rows, g_rows, row_ids, count, layout)
    n = tf.cast(tf.shape(row_ids)[0], tf.float64)
    r = tf.cast(layout[2], tf.float64)
    units = tf.cast(count, tf.float64)
    masked = tf.where(n * n <= GRAM_LIMIT, n * n * (i + j), tf.constant(float("inf"), tf.float64))
    unit_gram = units * r * r * (i + j)
    kernels = units * r * i * j + 2 * units * i * j
    choice = tf.argmin(tf.stack([masked, unit_gram, kernels]), output_type=tf.int32)
    return tf.switch_case(choice, [
        lambda: _masked_gram(a_rows, g_rows, row_ids, count),
        lambda: _unit_gram(a_rows, g_rows, row_ids, count, layout),
        lambda: _unit_kernels(a_rows, g_rows, row_ids, count, layout),
    ])


def _masked_gram(a_rows, g_rows, row_ids, count) -> tf.Tensor:
    """``[U]``: ``sum_{r, s in u} (a_r . a_s)(g_r . g_s)``, the row Gram matrices masked to pairs of one unit."""
    same = tf.equal(row_ids[:, None], row_ids[None, :])
    gram = tf.matmul(a_rows, a_rows, transpose_b=True) * tf.matmul(g_rows, g_rows, transpose_b=True)
    per_row = tf.reduce_sum(tf.where(same, gram, tf.zeros_like(gram)), axis=1)
    return _nonnegative(tf.math.unsorted_segment_sum(per_row, row_ids, count))


def _unit_gram(a_rows, g_rows, row_ids, count, layout) -> tf.Tensor:
    """``[U]``: the Gram form within each unit's padded rows (``[U, R, R]``)."""
    a_units, g_units = padded_units(a_rows, row_ids, count, layout), padded_units(g_rows, row_ids, count, layout)
    gram = tf.matmul(a_units, a_units, transpose_b=True) * tf.matmul(g_units, g_units, transpose_b=True)
    return _nonnegative(tf.reduce_sum(gram, axis=[1, 2]))


def _unit_kernels(a_rows, g_rows, row_ids, count, layout) -> tf.Tensor:
    """``[U]``: the squared norms of each unit's ``[i, j]`` kernel, built from its padded rows."""
    a_units, g_units = padded_units(a_rows, row_ids, count, layout), padded_units(g_rows, row_ids, count, layout)
    kernels = tf.matmul(a_units, g_units, transpose_a=True)  # [U, i, j]
    return tf.reduce_sum(tf.square(kernels), axis=[1, 2])


def _segment_squares(t: tf.Tensor, row_ids: tf.Tensor, count) -> tf.Tensor:
    """``[U]``: ``||sum_{r in u} t_r||^2`` of ``[N, ...]`` rows."""
    per_unit = tf.math.unsorted_segment_sum(t, row_ids, count)
    return tf.reduce_sum(tf.square(per_unit), axis=list(range(1, per_unit.shape.rank)))


# -- Dense and EinsumDense ----------------------------------------------------


def _dense_norms(rule, layer, calls, ids, count):
    a = [_rows(saved) for saved, _ in calls]
    g = [_rows(grads[0]) for _, grads in calls]
    row_ids = tf.concat([_row_ids(saved, ids) for saved, _ in calls], 0)
    a, g = tf.concat(a, 0), tf.concat(g, 0)
    out = [kernel_squared_norms(a, g, row_ids, count)]
    if layer.bias is not None:
        out.append(_segment_squares(g, row_ids, count))
    return out


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
    a = tf.reshape(a, [tf.shape(a)[0], -1, math.prod(dims[x] for x in contracted)])
    g = tf.reshape(g, [tf.shape(g)[0], -1, math.prod(dims[x] for x in outputs)])
    return a, g


def _einsum_dense_norms(rule, layer, calls, ids, count):
    views = []
    for saved, grads in calls:
        dtype = compute_dtype(saved.dtype)
        view = _as_dense(layer, tf.cast(saved, dtype), tf.cast(grads[0], dtype))
        if view is None:
            return fallback_squared_norms(rule, layer, calls, ids, count)
        views.append((view, grads[0]))
    a = tf.concat([_rows(va) for (va, _), _ in views], 0)
    g = tf.concat([_rows(vg) for (_, vg), _ in views], 0)
    row_ids = tf.concat([tf.repeat(ids, tf.shape(va)[1]) for (va, _), _ in views], 0)
    out = [kernel_squared_norms(a, g, row_ids, count)]
    if layer.bias is not None:
        bias = tf.concat([sum_to_shape(tf.cast(raw, a.dtype), layer.bias.shape) for _, raw in views], 0)
        out.append(_segment_squares(bias, tf.tile(ids, [len(views)]), count))
    return out


def _conv_norms(rule, layer, calls, ids, count):
    """A convolution as the Dense layer it is on its input patches (``rules.conv``): ``kernel_squared_norms`` on those rows.

    Patches beyond ``PATCH_LIMIT`` elements (or of unknown size) take the exact fallback.
    """
    spec = conv.ConvSpec.of(layer)
    a_rows, g_rows, row_ids, bias_rows, bias_ids = [], [], [], [], []
    for saved, grads in calls:
        a, g = rule.convolution_operands(saved, grads)
        p = conv.patches(spec, a)  # [B, positions, f]
        per_example, b = p.shape[1:].num_elements(), p.shape[0] if p.shape[0] is not None else ids.shape[0]
        if per_example is None or b is None or per_example * b > PATCH_LIMIT:
            return fallback_squared_norms(rule, layer, calls, ids, count)
        g = tf.cast(g, p.dtype)
        a_rows.append(_rows(p))
        g_rows.append(_rows(g))
        row_ids.append(_row_ids(p, ids))
        bias_rows.append(tf.reduce_sum(tf.reshape(g, [tf.shape(g)[0], -1, g.shape[-1]]), axis=1))
        bias_ids.append(ids)
    out = [kernel_squared_norms(tf.concat(a_rows, 0), tf.concat(g_rows, 0), tf.concat(row_ids, 0), count)]
    if layer.use_bias:
        out.append(_segment_squares(tf.concat(bias_rows, 0), tf.concat(bias_ids, 0), count))
    return out


# -- Embedding ------------------------------------------------------------------


def embedding_squared_norms(flat_ids: tf.Tensor, rows: tf.Tensor, row_ids: tf.Tensor, vocabulary: int, count) -> tf.Tensor:
    """``[U]``: ``sum_v ||sum_{r in u: x_r = v} g_r||^2`` from ``[N]`` ids, ``[N, D]`` rows and their ``[N]`` units.

    The rows are sorted by the key ``unit * vocabulary + id`` and summed per
    run of equal keys (sort and cumulative sum, no ``tf.unique``: XLA takes it too).
    """
    key = tf.cast(row_ids, tf.int64) * vocabulary + tf.cast(flat_ids, tf.int64)
    order = tf.argsort(key, stable=True)
    sorted_key = tf.gather(key, order)
    first = tf.concat([tf.ones([1], tf.bool), sorted_key[1:] != sorted_key[:-1]], 0)
    run = tf.cumsum(tf.cast(first, tf.int32)) - 1
    n = tf.shape(key)[0]
    sums = tf.math.unsorted_segment_sum(tf.gather(rows, order), run, n)
    squares = tf.reduce_sum(tf.square(sums), axis=1)
    unit = tf.cast(sorted_key // vocabulary, tf.int32)
    return tf.math.unsorted_segment_sum(tf.where(first, tf.gather(squares, run), tf.zeros_like(squares[:1])), unit, count)


def _embedding_norms(rule, layer, calls, ids, count):
    flat, rows, row_ids = [], [], []
    for (x, _), grads in calls:  # saved: (flat ids [B, T], repeats)
        t = x.shape[1] if x.shape[1] is not None else tf.shape(x)[1]
        flat.append(tf.reshape(x, [-1]))
        g = tf.reshape(grads[0], [-1, layer.output_dim])
        rows.append(tf.cast(g, compute_dtype(g.dtype)))
        row_ids.append(tf.repeat(ids, t))
    return [embedding_squared_norms(tf.concat(flat, 0), tf.concat(rows, 0), tf.concat(row_ids, 0), layer.input_dim, count)]


# -- ReversibleEmbedding: each unit's rows as one padded example ----------------


def unit_examples(t: tf.Tensor, ids: tf.Tensor, count) -> tf.Tensor:
    """``[B, P, ...]`` -> ``[U, R P, ...]``: each unit's rows laid end to end as the positions of one example.

    Rows keep their order within a unit; a unit with fewer than ``R`` rows
    (``R`` the most of any unit) is padded with zero rows.
    """
    rest = t.shape[2:]
    flat = tf.reshape(t, [tf.shape(t)[0], -1])
    padded = padded_units(flat, ids, count)  # [U, R, P * prod(rest)]
    return tf.reshape(padded, tf.concat([[tf.shape(padded)[0], -1], tf.constant(rest.as_list(), tf.int32)], 0))


def _reversible_embedding_norms(rule, layer, calls, ids, count):
    """The rule's own ``shared_squared_norms`` on unit examples (``unit_examples``).

    A unit's gradient is the example-level gradient of the example made of
    its rows' positions: every part of the rule's form (rows grouped by id,
    the projection's Gram form over positions, the cross term) is a sum over
    positions, and a zero padding position (id 0 with a zero gradient, zero
    inputs and gradients for a reversed call) adds nothing to any of them.
    Cost: the projection's Gram form runs over ``R S`` positions per unit,
    ``U (R S)^2 (V + D)`` in all (``R`` times the example-level form's).
    """
    grouped = []
    for saved, grads in calls:
        if saved[0] == rev._LOOKUP:
            flat = unit_examples(saved[1], ids, count)
            g = tf.reshape(grads[0], [tf.shape(saved[1])[0], -1, layer.output_dim])
            saved = (rev._LOOKUP, flat, repeated_rows(flat, only_repeated=not in_xla_context()))
            grouped.append((saved, [unit_examples(g, ids, count)]))
        else:
            h = tf.reshape(saved[1], [tf.shape(saved[1])[0], -1, saved[1].shape[-1]])
            g = tf.reshape(grads[0], [tf.shape(grads[0])[0], -1, grads[0].shape[-1]])
            grouped.append(((rev._REVERSE, unit_examples(h, ids, count)), [unit_examples(g, ids, count)]))
    return rule.shared_squared_norms(layer, grouped)


register_grouped_norms(rev.ReversibleEmbeddingRule, _reversible_embedding_norms)
register_grouped_norms(DenseRule, _dense_norms)
register_grouped_norms(conv.ConvPatchesRule, _conv_norms)
register_grouped_norms(EinsumDenseRule, _einsum_dense_norms)
register_grouped_norms(EmbeddingRule, _embedding_norms)
