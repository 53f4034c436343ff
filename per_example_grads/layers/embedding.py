"""Embedding: per-example gradients are scatter-adds of ``g`` into the looked-up rows.

For example n with token ids ``x_n`` (``[T]``) and output gradient ``g_n``
(``[T, D]``), the gradient of the ``[V, D]`` table is
``G_n[v] = sum_{t: x_nt = v} g_nt``. Then:

- ``||G_n||^2 = sum_t g_nt . S_n(x_nt)`` where ``S_n(v) = G_n[v]`` is the sum
  of the rows of ``g_n`` with id ``v``. A row whose id occurs once in ``x_n``
  contributes ``||g_nt||^2``; a row with a repeated id adds
  ``g_nt . (S_n(x_nt) - g_nt)`` on top. So ``||G_n||^2 = sum_t ||g_nt||^2 +
  sum_{repeated t} g_nt . (S_n(x_nt) - g_nt)``: one pass over ``g`` plus a
  ``segment_sum`` over the repeated rows only.
  Which rows repeat, and their groups, depend on the ids alone
  (``repeated_rows``: a sort of each example's ``T`` ids), so the rule finds
  them during the forward pass, where they run alongside the model's own
  work instead of after the backward pass. Cost ``O(B T D)`` after the
  backward pass plus ``O(R D)`` for the ``R`` repeated rows, never ``V``;
  exact (the correction is a sum of dot products, not a difference of
  norms). Under XLA, which needs static shapes, every row is treated as
  possibly repeated (``R = B T``; a group of one adds exactly 0).
- ``sum_n c_n G_n`` is returned as ``tf.IndexedSlices`` (values ``c_n g_nt``,
  ``[B T, D]``; indices ``x_nt``; dense shape ``[V, D]``), as ``tape.gradient``
  returns an embedding table's gradient: nothing of size ``V`` is built.
  Repeated ids are repeated rows (``tf.convert_to_tensor`` or an optimizer's
  sparse update adds them up).

Padding ids from ``mask_zero`` need no special case: whatever the downstream
layers do with the mask is already in ``g`` (padding rows are repeats of id
0, grouped like any other).
"""

from __future__ import annotations

from typing import NamedTuple

import keras
import tensorflow as tf

from per_example_grads.layerwise.rule import LayerRule, register_layer_rule, reparametrized
from per_example_grads.xla_context import in_xla_context


class RepeatedRows(NamedTuple):
    """Rows of a ``[B, T]`` id matrix grouped by (example, id).

    ``rows`` ``[R]`` int32: flat row indices ``n T + t``, rows of one group
    adjacent; ``group`` ``[R]`` int32: non-decreasing group index from 0;
    ``example`` ``[R]`` int32: the example ``n``. Either only the rows whose
    id repeats in their example, or every row (a group of one adds nothing
    to ``grouped_squared_norms``' correction).
    """

    rows: tf.Tensor
    group: tf.Tensor
    example: tf.Tensor


def repeated_rows(ids: tf.Tensor, only_repeated: bool = True) -> RepeatedRows:
    """``RepeatedRows`` of ``ids`` ``[B, T]`` (int32 or int64), by sorting each example's ids.

    ``only_repeated=False`` keeps every row, so that every shape is static (``R = B T``), as XLA needs.
    """
    b, t = tf.shape(ids)[0], tf.shape(ids)[1]
    order = tf.argsort(ids, axis=1, stable=True)  # [B, T]
    ordered = tf.gather(ids, order, batch_dims=1)
    same = tf.equal(ordered[:, 1:], ordered[:, :-1])  # [B, T - 1]
    edge = tf.zeros([b, 1], tf.bool)
    as_previous = tf.concat([edge, same], 1)  # [B, T]: same id as the sorted row before
    if only_repeated:
        where = tf.where(tf.logical_or(as_previous, tf.concat([same, edge], 1)))  # [R, 2] (n, s), row-major
        example = tf.cast(where[:, 0], tf.int32)
        rows = example * t + tf.gather_nd(order, where)
        starts = tf.logical_not(tf.gather_nd(as_previous, where))
    else:
        example = tf.repeat(tf.range(b), t)
        rows = tf.reshape(order + tf.range(b)[:, None] * t, [-1])
        starts = tf.reshape(tf.logical_not(as_previous), [-1])
    return RepeatedRows(rows, tf.cumsum(tf.cast(starts, tf.int32)) - 1, example)


def grouped_squared_norms(g: tf.Tensor, repeats: RepeatedRows) -> tf.Tensor:
    """``[B]``: ``sum_v ||sum_{t: ids[n, t] = v} g[n, t]||^2`` from ``g`` ``[B, T, D]`` and ``repeated_rows(ids)``."""
    flat = tf.reshape(g, [-1, tf.shape(g)[2]])
    mine = tf.gather(flat, repeats.rows)  # [R, D]
    sums = tf.math.unsorted_segment_sum(mine, repeats.group, tf.shape(mine)[0])  # groups first; XLA has no SegmentSum
    others = tf.gather(sums, repeats.group) - mine  # the rest of each row's group (exactly 0 for a group of one)
    cross = tf.math.unsorted_segment_sum(tf.reduce_sum(mine * others, axis=1), repeats.example, tf.shape(g)[0])
    return tf.reduce_sum(tf.square(g), axis=[1, 2]) + cross


def _flat_ids(ids: tf.Tensor) -> tf.Tensor:
    """``ids`` ``[B, *positions]`` -> ``[B, T]`` int32, T static when known."""
    positions = ids.shape[1:]
    t = positions.num_elements() if positions.is_fully_defined() else -1
    b = -1 if t != -1 else tf.shape(ids)[0]
    return tf.reshape(tf.cast(ids, tf.int32), [b, t])


class EmbeddingRule(LayerRule):
    def unsupported(self, layer):
        return reparametrized(layer)

    def variables(self, layer):
        return [layer.embeddings]

    def forward(self, layer, call, args, kwargs):
        ids = args[0]
        if ids.dtype not in (tf.int32, tf.int64):
            ids = tf.cast(ids, tf.int32)
        out = keras.ops.cast(keras.ops.take(layer.embeddings, ids, axis=0), layer.compute_dtype)
        flat = _flat_ids(ids)
        # Only squared_norms uses the repeats (graph mode prunes them otherwise).
        return out, (flat, repeated_rows(flat, only_repeated=not in_xla_context())), [out]

    @staticmethod
    def _flat_grads(layer, ids, g):
        """``g`` -> ``[B, T, D]`` float32, shaped like the flat ``ids``."""
        return tf.reshape(tf.cast(g, tf.float32), [-1, ids.shape[1] or tf.shape(ids)[1], layer.output_dim])

    def per_example(self, layer, saved, grads):
        ids, _ = saved
        g = self._flat_grads(layer, ids, grads[0])
        b, v = tf.shape(ids)[0], layer.input_dim
        segments = tf.reshape(ids + tf.range(b)[:, None] * v, [-1])
        table = tf.math.unsorted_segment_sum(tf.reshape(g, [-1, layer.output_dim]), segments, b * v)
        return [tf.cast(tf.reshape(table, [b, v, layer.output_dim]), layer.embeddings.dtype)]

    def squared_norms(self, layer, saved, grads):
        ids, repeats = saved
        return [grouped_squared_norms(self._flat_grads(layer, ids, grads[0]), repeats)]

    def weighted_sum(self, layer, saved, grads, weights):
        """``[tf.IndexedSlices]`` of dense shape ``[V, D]``: ``sum_n weights[n] G_n``."""
        ids, _ = saved
        g = self._flat_grads(layer, ids, grads[0])
        weighted = g * tf.cast(weights, g.dtype)[:, None, None]
        values = tf.cast(tf.reshape(weighted, [-1, layer.output_dim]), layer.embeddings.dtype)
        shape = tf.constant([layer.input_dim, layer.output_dim], tf.int32)
        return [tf.IndexedSlices(values, tf.reshape(ids, [-1]), dense_shape=shape)]


register_layer_rule(keras.layers.Embedding, EmbeddingRule())
