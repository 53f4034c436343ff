"""Sparse per-example gradients of a table: each example's gradient is a few rows.

An embedding table ``W`` (``[V, D]``) looked up at ids ``x_n`` (``[T]``) by
example n gets the gradient ``G_n[v] = sum_{t: x_nt = v} g_nt``, where
``g_nt`` (``[D]``) is the loss gradient at the t-th looked-up row. Built
densely, the per-example gradients are ``[B, V, D]``: 655 MB for a 20k x 32
table at B = 256, nearly all zeros. ``PerExampleSlices`` holds the ``B T``
rows ``g_nt`` and their ids instead, as ``tf.IndexedSlices`` does for one
gradient.

Squared norms need the rows that share an id within an example, since those
add up before squaring:

- ``||G_n||^2 = sum_{t alone} ||g_nt||^2 + sum_{repeated v} ||S_n(v)||^2``,
  with ``S_n(v) = G_n[v]`` the sum of the rows of ``g_n`` with id ``v``: the
  rows whose id occurs once in ``x_n`` count as they are, and each id that
  repeats counts once, by its sum (``grouped_squared_norms``). Every term is
  a square, so nothing cancels: rows of one id that nearly cancel each other
  give a small ``||S||^2`` to float32 accuracy, where ``sum_t ||g_nt||^2``
  minus a correction would lose it.
- Which rows repeat, and their groups, depend on the ids alone
  (``repeated_rows``: a sort of each example's ``T`` ids). Cost ``O(B T D)``
  (one product per example, plus row norms in the examples that have a
  repeated id) and ``O(R D)`` for the ``R`` repeated rows, never ``V``.
  Under XLA, which needs static shapes, every row is treated as possibly
  repeated (``R = B T``; a group of one is its own row).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf

from per_example_grads._core.example_ops import compute_dtype, per_example_squared_norms
from per_example_grads._core.xla_context import in_xla_context


class RepeatedRows(NamedTuple):
    """Rows of a ``[B, T]`` id matrix grouped by (example, id).

    ``rows`` ``[R]`` int32: flat row indices ``n T + t``, rows of one group
    adjacent; ``group`` ``[R]`` int32: non-decreasing group index from 0;
    ``example`` ``[R]`` int32: the example ``n``. Either only the rows whose
    id repeats in their example, or every row (``every_row``; a group of one
    is its own row).
    """

    rows: tf.Tensor
    group: tf.Tensor
    example: tf.Tensor
    every_row: bool = False


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
    return RepeatedRows(rows, tf.cumsum(tf.cast(starts, tf.int32)) - 1, example, every_row=not only_repeated)


def grouped_squared_norms(g: tf.Tensor, repeats: RepeatedRows) -> tf.Tensor:
    """``[B]``: ``sum_v ||sum_{t: ids[n, t] = v} g[n, t]||^2`` from ``g`` ``[B, T, D]`` and ``repeated_rows(ids)``."""
    b = tf.shape(g)[0]
    flat = tf.reshape(g, [-1, tf.shape(g)[2]])  # [B T, D]
    mine = tf.gather(flat, repeats.rows)  # [R, D]
    r = tf.shape(mine)[0]
    sums = tf.math.unsorted_segment_sum(
        mine, repeats.group, r
    )  # [R, D]: group k's sum in row k, zeros after the last group
    owner = tf.maximum(
        tf.math.unsorted_segment_max(repeats.example, repeats.group, r), 0
    )  # group k's example (0: a zero row)
    grouped = tf.math.unsorted_segment_sum(per_example_squared_norms(sums), owner, b)
    if repeats.every_row:  # no row is alone
        return grouped
    # Rows alone: all rows of an example without a repeated id (one product over the example), and row by row
    # in the examples with one, leaving the repeated rows out (not adding their squares and taking them back).
    t = tf.shape(g)[1]
    repeated = tf.reshape(tf.scatter_nd(repeats.rows[:, None], tf.ones([r], grouped.dtype), [b * t]), [b, t])
    mixed = tf.where(tf.reduce_any(repeated > 0, axis=1))[:, 0]  # [E] examples with a repeated id
    row_norms = tf.reshape(per_example_squared_norms(tf.reshape(tf.gather(g, mixed), [-1, tf.shape(g)[2]])), [-1, t])
    alone = tf.reduce_sum(row_norms * (1 - tf.gather(repeated, mixed)), axis=1)  # [E]
    return tf.tensor_scatter_nd_update(per_example_squared_norms(g), mixed[:, None], alone) + grouped


class PerExampleSlices(tf.experimental.ExtensionType):
    """Per-example gradients of a ``[V, *row]`` table, as rows: ``G_n[v] = sum_{t: indices[n, t] = v} values[n, t]``.

    What ``per_example_gradients(..., sparse_embeddings=True)`` returns for
    an embedding table, in place of the dense ``[B, V, *row]`` tensor.
    Repeated ids within an example are repeated rows, which add up (as in
    ``tf.IndexedSlices``). It works inside ``tf.function`` and converts to the
    dense tensor wherever a tensor is expected (``tf.convert_to_tensor``, TF
    ops, ``np.asarray``), so nothing that expects dense gradients gets a wrong
    result. The transforms (``global_norms``, ``clip_by_global_norm``,
    ``sum_examples``, ``mean_examples``) work on the rows directly.

    Attributes:
      indices: ``[B, T]`` int32: the ids each example looked up.
      values: ``[B, T, *row]``: the gradient at each looked-up row.
      table_shape: ``[V, *row]``: the table's (the variable's) shape.

    Examples:
      >>> s = PerExampleSlices(tf.constant([[0, 0], [2, 1]]), tf.ones([2, 2, 1]), tf.TensorShape([3, 1]))
      >>> s.to_dense()[:, :, 0].numpy()
      array([[2., 0., 0.],
             [0., 1., 1.]], dtype=float32)
    """

    indices: tf.Tensor
    values: tf.Tensor
    table_shape: tf.TensorShape

    @property
    def shape(self) -> tf.TensorShape:
        """``[B, V, *row]``, as the dense per-example gradients'."""
        return self.values.shape[:1].concatenate(self.table_shape)

    @property
    def dtype(self) -> tf.DType:
        return self.values.dtype

    def to_dense(self) -> tf.Tensor:
        """``[B, V, *row]``: the dense per-example gradients."""
        b, v = tf.shape(self.indices)[0], self.table_shape[0]
        segments = tf.reshape(self.indices + tf.range(b)[:, None] * v, [-1])
        rows = tf.reshape(self.values, tf.concat([[-1], tf.shape(self.values)[2:]], 0))
        table = tf.math.unsorted_segment_sum(rows, segments, b * v)
        return tf.reshape(table, tf.concat([[b], tf.constant(self.table_shape.as_list(), tf.int32)], 0))

    def squared_norms(self) -> tf.Tensor:
        """``[B]``: ``||G_n||^2`` (float32, or float64 for float64 values), never building ``[B, V, *row]``."""
        dtype = compute_dtype(self.values.dtype)
        rows = tf.reshape(tf.cast(self.values, dtype), [tf.shape(self.values)[0], tf.shape(self.values)[1], -1])
        return grouped_squared_norms(rows, repeated_rows(self.indices, only_repeated=not in_xla_context()))

    def max_abs(self) -> tf.Tensor:
        """``[B]``: the largest ``|value|`` per example (an upper bound on ``max |G_n|`` up to repeats)."""
        flat = tf.reshape(self.values, [tf.shape(self.values)[0], -1])
        return tf.reduce_max(tf.abs(flat), axis=1)

    def scale(self, factors: tf.Tensor) -> "PerExampleSlices":
        """``G_n * factors[n]`` for ``factors`` ``[B]``."""
        f = tf.reshape(tf.cast(factors, self.values.dtype), [-1] + [1] * (self.values.shape.rank - 1))
        return PerExampleSlices(self.indices, tf.math.multiply_no_nan(self.values, f), self.table_shape)

    def sum_examples(self) -> tf.IndexedSlices:
        """``sum_n G_n`` as ``tf.IndexedSlices`` of dense shape ``[V, *row]`` (ids may repeat)."""
        rows = tf.reshape(self.values, tf.concat([[-1], tf.shape(self.values)[2:]], 0))
        shape = tf.constant(self.table_shape.as_list(), tf.int32)
        return tf.IndexedSlices(rows, tf.reshape(self.indices, [-1]), dense_shape=shape)

    def concat(self, other: "PerExampleSlices") -> "PerExampleSlices":
        """``G_n + H_n`` (both of one table): each example's rows side by side."""
        indices = tf.concat([self.indices, tf.cast(other.indices, self.indices.dtype)], 1)
        return PerExampleSlices(indices, tf.concat([self.values, other.values], 1), self.table_shape)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.to_dense().numpy(), dtype=dtype)


def _to_dense(value, dtype=None, name=None, as_ref=False):
    del dtype, name, as_ref  # TF checks the requested dtype against the result
    return value.to_dense()


tf.register_tensor_conversion_function(PerExampleSlices, _to_dense)
