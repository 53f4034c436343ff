"""Embedding: per-example gradients are scatter-adds of ``g`` into the looked-up rows.

For example n with token ids ``x_n`` (``[T]``) and output gradient ``g_n``
(``[T, D]``), the gradient of the ``[V, D]`` table is
``G_n[v] = sum_{t: x_nt = v} g_nt``. Then:

- ``||G_n||^2 = sum_v ||G_n[v]||^2`` over the ids ``v`` that occur in ``x_n``:
  the rows ``g_nt`` are grouped by the key ``k_nt = n V + x_nt``, each group
  summed and the groups' squared norms added per example. Most keys occur
  once, so the grouping is split by a hash ``h(k) = k mod M`` (``M = 4 B T +
  1``, counts of each bucket by one scatter-add): a row whose bucket holds only
  it has a key no other row has, so it is a group of one and contributes
  ``||g_nt||^2`` as it is (this part runs under XLA, one fused pass over
  ``g``). The remaining rows (true repeats and hash collisions, about
  ``1 - e^{-1/4}`` of distinct keys) are grouped exactly by one sort of their
  keys and a ``segment_sum``. Grouping the whole batch by one sort
  (``O(B T log(B T))``) was measured 1.5x slower at ``B T = 16384``. The
  result is exact whatever ``M``: a hash only decides which rows skip the
  sort. Cost ``O(B T D + M)`` plus the sort of the rest, never ``V``.
  For short sequences (``T <= GRAM_MAX_T``) the Gram form
  ``sum_{t,s} [x_nt = x_ns] (g_nt . g_ns)`` (``B T^2 D``, no sort) is used.
- ``sum_n c_n G_n`` is returned as ``tf.IndexedSlices`` (values ``c_n g_nt``,
  ``[B T, D]``; indices ``x_nt``; dense shape ``[V, D]``), as ``tape.gradient``
  returns an embedding table's gradient: nothing of size ``V`` is built.
  Repeated ids are repeated rows (``tf.convert_to_tensor`` or an optimizer's
  sparse update adds them up).

Padding ids from ``mask_zero`` need no special case: whatever the downstream
layers do with the mask is already in ``g``.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from per_example_grads.layerwise.rule import LayerRule, register_layer_rule, reparametrized

GRAM_MAX_T = 16
NORMS_JIT_COMPILE = True
HASH_TABLE_FACTOR = 4


def _hash_singletons(ids: tf.Tensor, g: tf.Tensor, vocabulary_size: int, table_factor: int):
    """``(norms, single, keys)``: ``sum_t [single_nt] ||g_nt||^2`` ``[B]``, ``single`` ``[B, T]`` and ``keys`` ``[B T]``.

    ``single_nt``: no other row's key ``n V + ids[n, t]`` falls in its bucket
    ``k mod (table_factor B T + 1)``, so no other row shares its key.
    """
    b = tf.shape(ids)[0]
    keys = tf.reshape(tf.cast(ids, tf.int64) + tf.cast(tf.range(b)[:, None], tf.int64) * vocabulary_size, [-1])
    m = table_factor * tf.size(keys) + 1
    bucket = tf.cast(keys % tf.cast(m, tf.int64), tf.int32)
    count = tf.math.unsorted_segment_sum(tf.ones_like(bucket), bucket, m)
    single = tf.reshape(tf.equal(tf.gather(count, bucket), 1), tf.shape(ids))
    norms = tf.reduce_sum(tf.where(single[:, :, None], tf.square(g), tf.zeros_like(g)), axis=[1, 2])
    return norms, single, keys


_hash_singletons_xla = tf.function(_hash_singletons, jit_compile=True, reduce_retracing=True)


def grouped_squared_norms(ids: tf.Tensor, g: tf.Tensor, vocabulary_size: int, table_factor: int | None = None) -> tf.Tensor:
    """``[B]``: ``sum_v ||sum_{t: ids[n, t] = v} g[n, t]||^2`` from ``ids`` ``[B, T]`` and ``g`` ``[B, T, D]``.

    Rows alone in their hash bucket are added as ``||g_nt||^2``; the rest are
    grouped by sorting their keys (module docstring). ``table_factor``
    (default ``HASH_TABLE_FACTOR``) sizes the hash table; any value >= 1 gives
    the same result.
    """
    b = tf.shape(ids)[0]
    singletons = _hash_singletons_xla if NORMS_JIT_COMPILE else _hash_singletons
    norms, single, keys = singletons(ids, g, vocabulary_size, table_factor or HASH_TABLE_FACTOR)
    rest = tf.reshape(tf.where(tf.logical_not(tf.reshape(single, [-1]))), [-1])  # [R] flat row indices
    rest_keys = tf.gather(keys, rest)
    order = tf.argsort(rest_keys, stable=True)
    sorted_keys = tf.gather(rest_keys, order)
    starts = tf.not_equal(sorted_keys, tf.concat([[-1], sorted_keys[:-1]], 0))  # keys are >= 0
    group = tf.cumsum(tf.cast(starts, tf.int32)) - 1  # [R], non-decreasing
    rows = tf.gather(tf.reshape(g, [-1, g.shape[-1]]), tf.gather(rest, order))
    sums = tf.math.segment_sum(rows, group)  # [groups, D]
    example = tf.cast(tf.boolean_mask(sorted_keys, starts) // vocabulary_size, tf.int32)  # [groups]
    return norms + tf.math.unsorted_segment_sum(tf.reduce_sum(tf.square(sums), axis=1), example, b)


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
        return out, ids, [out]

    @staticmethod
    def _flat(layer, ids, g):
        """``ids`` -> ``[B, T]`` int32, ``g`` -> ``[B, T, D]`` float32, T static when known."""
        positions = ids.shape[1:]
        t = positions.num_elements() if positions.is_fully_defined() else -1
        b = -1 if t != -1 else tf.shape(ids)[0]
        ids = tf.reshape(tf.cast(ids, tf.int32), [b, t])
        g = tf.reshape(tf.cast(g, tf.float32), [b, t, layer.output_dim])
        return ids, g

    def per_example(self, layer, saved, grads):
        ids, g = self._flat(layer, saved, grads[0])
        b, v = tf.shape(ids)[0], layer.input_dim
        segments = tf.reshape(ids + tf.range(b)[:, None] * v, [-1])
        table = tf.math.unsorted_segment_sum(tf.reshape(g, [-1, layer.output_dim]), segments, b * v)
        var = layer.embeddings
        return [tf.cast(tf.reshape(table, [b, v, layer.output_dim]), var.dtype)]

    def squared_norms(self, layer, saved, grads):
        ids, g = self._flat(layer, saved, grads[0])
        t = ids.shape[1]
        if t is not None and t <= GRAM_MAX_T:
            same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), g.dtype)
            return [tf.reduce_sum(same * tf.einsum("btd,bsd->bts", g, g), axis=[1, 2])]
        return [grouped_squared_norms(ids, g, layer.input_dim)]

    def weighted_sum(self, layer, saved, grads, weights):
        """``[tf.IndexedSlices]`` of dense shape ``[V, D]``: ``sum_n weights[n] G_n``."""
        ids, g = self._flat(layer, saved, grads[0])
        weighted = g * tf.cast(weights, g.dtype)[:, None, None]
        values = tf.cast(tf.reshape(weighted, [-1, layer.output_dim]), layer.embeddings.dtype)
        shape = tf.constant([layer.input_dim, layer.output_dim], tf.int32)
        return [tf.IndexedSlices(values, tf.reshape(ids, [-1]), dense_shape=shape)]


register_layer_rule(keras.layers.Embedding, EmbeddingRule())
