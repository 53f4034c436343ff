"""Embedding: per-example gradients are scatter-adds of ``g`` into the looked-up rows.

For example n with token ids ``x_n`` (``[T]``) and output gradient ``g_n``
(``[T, D]``), the gradient of the ``[V, D]`` table is
``G_n[v] = sum_{t: x_nt = v} g_nt``. Then:

- per-example gradients are ``[B, V, D]`` scatter-adds of ``g``, or with
  ``sparse_embeddings=True`` the rows themselves (``PerExampleSlices``:
  ``x`` and ``g``, nothing of size ``V``);
- squared norms come from ``g`` and the rows whose id repeats within an
  example, found by sorting the ids during the forward pass, where that work
  runs alongside the model's own (the maths is in
  ``per_example_grads.per_example_slices``); cost ``O(B T D)``, never ``V``.
  They stay float32 (unlike the dense rules', recomputed in float64 where
  they overflow): the rows are loss gradients, not activations, and the
  float64 recomputation of the grouping would double this rule's graph;
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

import keras
import tensorflow as tf

from per_example_grads._core.example_ops import compute_dtype
from per_example_grads._core.xla_context import in_xla_context
from per_example_grads.per_example_slices import PerExampleSlices, grouped_squared_norms, repeated_rows
from per_example_grads.rules.rule import LayerRule, register_layer_rule, reparametrized


def flat_ids(ids: tf.Tensor) -> tf.Tensor:
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
        table = layer.embeddings.value
        # A sparse read (ResourceGather) of a tf.Variable: a dense read copies the whole table at every step once
        # the optimizer has updated it sparsely (TensorFlow then keeps the variable in copy-on-read mode).
        rows = (
            tf.gather(table, ids) if isinstance(table, tf.Variable) else keras.ops.take(layer.embeddings, ids, axis=0)
        )
        out = keras.ops.cast(rows, layer.compute_dtype)
        flat = flat_ids(ids)
        # Only squared_norms uses the repeats (graph mode prunes them otherwise).
        return out, (flat, repeated_rows(flat, only_repeated=not in_xla_context())), [out]

    @staticmethod
    def _slices(layer, saved, grads) -> PerExampleSlices:
        """The per-example gradients as rows: ``g`` reshaped to ``[B, T, D]`` like the flat ids, in the table's dtype."""
        ids, _ = saved
        g = tf.reshape(grads[0], [-1, ids.shape[1] or tf.shape(ids)[1], layer.output_dim])
        return PerExampleSlices(ids, tf.cast(g, layer.embeddings.dtype), tf.TensorShape(layer.embeddings.shape))

    def per_example(self, layer, saved, grads):
        return [self._slices(layer, saved, grads)]

    def squared_norms(self, layer, saved, grads, cache=None):
        _, repeats = saved
        values = self._slices(layer, saved, grads).values
        return [grouped_squared_norms(tf.cast(values, compute_dtype(values.dtype)), repeats)]

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        """``[tf.IndexedSlices]`` of dense shape ``[V, D]``: ``sum_n weights[n] G_n``."""
        return [self._slices(layer, saved, grads).scale(weights).sum_examples()]


register_layer_rule(keras.layers.Embedding, EmbeddingRule())
