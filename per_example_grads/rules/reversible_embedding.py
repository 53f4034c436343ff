"""ReversibleEmbedding: a table used as the lookup and as the tied output projection.

KerasHub's language models (GPT-2, Gemma, Llama) call one
``ReversibleEmbedding`` twice: on the token ids (``h = E[x]``) and, with
``reverse=True``, on the last hidden states (``z = h' E^T``, the logits). The
engine records each call; for example n the table's gradient is the sum

    G_n = S_n + P_n,   S_n = sum_t e_{x_t} r_t^T,   P_n = sum_s g_s h'_s^T

with ``x`` ``[T]`` the ids, ``r`` ``[T, D]`` the loss gradient at the looked-up
rows, ``h'`` ``[S, D]`` the reversed call's input and ``g`` ``[S, V]`` the loss
gradient at its logits (before ``logit_soft_cap``, whose ``tanh`` is part of
the backward pass). Then, never building ``[B, V, D]``:

- ``||S_n||^2`` from the rows grouped by id (``per_example_slices``);
- ``||P_n||^2 = sum_{s,u} (g_s . g_u)(h'_s . h'_u)``, the Gram form over
  positions: ``O(S^2 (V + D))`` per example, memory ``[B, S, S]``;
- the cross term ``2 <S_n, P_n> = 2 sum_t r_t . P_n[x_t]``, which reads only
  the looked-up rows of ``P_n``: ``P_n[x_t] = sum_s g_s[x_t] h'_s``, so
  ``<S_n, P_n> = sum_{s,t} g_s[x_t] (h'_s . r_t)``, ``O(S T D)``.

A layer called several times in either direction sums every call's part (the
Gram form then runs over each pair of reversed calls). The clipped sum
``sum_n c_n G_n`` is the rows ``c_n r_t`` (``tf.IndexedSlices``) plus one
contraction ``sum_{n,s} c_n g_s h'_s^T`` for the projection; the engine adds
the two. Per-example gradients are the dense ``[B, V, D]``.

With ``tie_weights=False`` the reversed call uses its own kernel
``reverse_embeddings`` (``[D, V]``): each variable gets its own part and
there is no cross term. ``reverse_dtype`` casts both operands of the
projection, as the layer does. LoRA or quantization on the table go to the
exact layer-local fallback.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from per_example_grads._core.example_ops import WIDE, compute_dtype, widened
from per_example_grads._core.xla_context import in_xla_context
from per_example_grads.errors import EngineError
from per_example_grads.per_example_slices import PerExampleSlices, grouped_squared_norms, repeated_rows
from per_example_grads.rules import outer_products
from per_example_grads.rules.embedding import flat_ids
from per_example_grads.rules.rule import LayerRule, register_layer_rule, reparametrized

LOOKUP, REVERSE = "lookup", "reverse"


def _is_reverse(args: tuple, kwargs: dict) -> bool:
    """The call's ``reverse`` flag; a tensor whose value is unknown while tracing is refused, not guessed."""
    reverse = kwargs.get("reverse", args[1] if len(args) > 1 else False)
    if tf.is_tensor(reverse):
        value = tf.get_static_value(reverse)
        if value is None:
            raise EngineError(
                "the layer-wise engine cannot follow a ReversibleEmbedding whose `reverse` flag is known only "
                "at run time; method='auto' falls back to another engine"
            )
        reverse = value
    return bool(reverse)


class ReversibleEmbeddingRule(LayerRule):
    """Both call modes of a ``ReversibleEmbedding`` (see the module docstring)."""

    def unsupported(self, layer):
        if reparametrized(layer):
            return reparametrized(layer)
        if not hasattr(layer, "tie_weights"):
            return "not a ReversibleEmbedding with tie_weights"
        return None

    def variables(self, layer):
        return [layer.embeddings] + ([] if layer.tie_weights else [layer.reverse_embeddings])

    # -- forward -----------------------------------------------------------

    def forward(self, layer, call, args, kwargs):
        if not _is_reverse(args, kwargs):
            # The layer's own lookup (its keras mask included); the table's
            # gradient is g scattered into the looked-up rows.
            out = call(*args, **kwargs)
            flat = flat_ids(args[0])
            return out, (LOOKUP, flat, repeated_rows(flat, only_repeated=not in_xla_context())), [out]
        h = args[0]
        kernel = keras.ops.transpose(layer.embeddings) if layer.tie_weights else layer.reverse_embeddings
        if layer.reverse_dtype is not None:
            h, kernel = keras.ops.cast(h, layer.reverse_dtype), keras.ops.cast(kernel, layer.reverse_dtype)
        z = keras.ops.matmul(h, kernel)
        logits = z
        if layer.logit_soft_cap is not None:
            cap = layer.logit_soft_cap
            logits = keras.ops.multiply(keras.ops.tanh(keras.ops.divide(z, cap)), cap)
        return logits, (REVERSE, h), [z]

    # -- pieces ------------------------------------------------------------

    def _dtype(self, layer) -> tf.DType:
        return compute_dtype(layer.embeddings.dtype)

    def lookup_rows(self, layer, saved, grads) -> tf.Tensor:
        """``r``: ``[B, T, D]``, a lookup call's output gradient rows in the compute dtype, aligned with the flat ids."""
        _, ids, _ = saved
        return tf.cast(
            tf.reshape(grads[0], [-1, ids.shape[1] or tf.shape(ids)[1], layer.output_dim]), self._dtype(layer)
        )

    def projection_operands(self, layer, saved, grads) -> tuple[tf.Tensor, tf.Tensor]:
        """``(h', g)``: a reversed call's input ``[B, S, D]`` and output gradient ``[B, S, V]`` in the compute dtype."""
        dtype = self._dtype(layer)
        return tf.cast(outer_products.flat_positions(saved[1]), dtype), tf.cast(
            outer_products.flat_positions(grads[0]), dtype
        )

    def _no_rows(self, layer, b) -> PerExampleSlices:
        """An example's gradient with no rows (the lookup part of a reversed call)."""
        d = layer.output_dim
        return PerExampleSlices(
            tf.zeros([b, 0], tf.int32),
            tf.zeros([b, 0, d], layer.embeddings.dtype),
            tf.TensorShape(layer.embeddings.shape),
        )

    # -- per-example gradients --------------------------------------------

    def per_example(self, layer, saved, grads):
        if saved[0] == LOOKUP:
            rows = PerExampleSlices(
                saved[1],
                tf.cast(self.lookup_rows(layer, saved, grads), layer.embeddings.dtype),
                tf.TensorShape(layer.embeddings.shape),
            )
            if layer.tie_weights:
                return [rows]
            v = layer.reverse_embeddings
            return [rows, tf.zeros(tf.concat([tf.shape(saved[1])[:1], v.shape], 0), v.dtype)]
        h, g = self.projection_operands(layer, saved, grads)
        if layer.tie_weights:
            return [tf.cast(tf.einsum("bsv,bsd->bvd", g, h), layer.embeddings.dtype)]
        v = layer.reverse_embeddings
        return [self._no_rows(layer, tf.shape(h)[0]), tf.cast(tf.einsum("bsd,bsv->bdv", h, g), v.dtype)]

    # -- squared norms -----------------------------------------------------

    def squared_norms(self, layer, saved, grads, cache=None):
        return self.shared_squared_norms(layer, [(saved, grads)])

    def shared_squared_norms(self, layer, calls):
        """The norms in the compute dtype, the reversed calls' terms recomputed in float64 where a norm is not finite.

        The projection and cross terms hold the reversed calls' inputs ``h'``
        (activations: ``||P_n||^2`` overflows float32 for entries beyond
        about 1e19), so for a batch with a non-finite norm they are computed
        again in float64 (``widened``); the rows' part ``||S_n||^2`` (loss
        gradients grouped by id) is not.
        """
        dtype = self._dtype(layer)
        lookups = [(s, g) for s, g in calls if s[0] == LOOKUP]
        projections = [self.projection_operands(layer, s, g) for s, g in calls if s[0] == REVERSE]
        b = tf.shape((projections[0][0] if projections else lookups[0][1][0]))[0]

        # ||S||^2: the rows grouped by id (over every lookup call's ids at once).
        if len(lookups) == 1:
            ((saved, g),) = lookups
            ids, rows = saved[1], self.lookup_rows(layer, saved, g)
            table = grouped_squared_norms(rows, saved[2])
        elif lookups:
            ids = tf.concat([s[1] for s, _ in lookups], 1)
            rows = tf.concat([self.lookup_rows(layer, s, g) for s, g in lookups], 1)
            table = grouped_squared_norms(rows, repeated_rows(ids, only_repeated=not in_xla_context()))
        else:
            ids, rows, table = None, None, tf.zeros([b], dtype)

        def terms(pick, as_dtype):
            """The reversed calls' terms of the examples ``pick`` selects, in ``as_dtype``."""
            cast = lambda t: tf.cast(pick(t), as_dtype)  # noqa: E731
            picked = [(cast(h), cast(g)) for h, g in projections]
            k = tf.shape(picked[0][0] if picked else pick(table))[0]
            return self._projection_terms(
                layer, picked, None if ids is None else pick(ids), None if rows is None else cast(rows), k, as_dtype
            )

        projection, cross = terms(lambda t: t, dtype)
        narrow = dtype != WIDE
        if not layer.tie_weights:
            return widened([(table, None), (projection, (lambda pick: terms(pick, WIDE)[0]) if narrow else None)])

        def wide_total(pick):
            wide_projection, wide_cross = terms(pick, WIDE)
            return tf.cast(pick(table), WIDE) + wide_projection + 2 * wide_cross

        return widened([(table + projection + 2 * cross, wide_total if narrow else None)])

    @staticmethod
    def _projection_terms(layer, projections, ids, rows, b, dtype) -> tuple[tf.Tensor, tf.Tensor]:
        """``(||sum_j P_j||^2, <S, sum_j P_j>)`` ``[B]`` in ``dtype`` (the second 0 without a tied lookup)."""
        # ||sum_j P_j||^2 = sum_{j,k} sum_{s,u} (g_js . g_ku)(h_js . h_ku).
        projection = tf.zeros([b], dtype)
        for j, (hj, gj) in enumerate(projections):
            for k, (hk, gk) in enumerate(projections[j:], start=j):
                term = tf.reduce_sum(tf.einsum("bsv,buv->bsu", gj, gk) * tf.einsum("bsd,bud->bsu", hj, hk), axis=[1, 2])
                projection += term if k == j else 2 * term
        # <S, P_j> = sum_{s,t} g_js[x_t] (h_js . r_t).
        cross = tf.zeros([b], dtype)
        if layer.tie_weights and rows is not None:
            for h, g in projections:
                at_ids = tf.gather(g, ids, axis=2, batch_dims=1)  # [B, S, T]: g_s[x_t]
                cross += tf.reduce_sum(at_ids * tf.einsum("bsd,btd->bst", h, rows), axis=[1, 2])
        return projection, cross

    # -- clipped sums ------------------------------------------------------

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        """The lookup call: ``tf.IndexedSlices`` rows; the reversed call: one contraction, dense."""
        if saved[0] == LOOKUP:
            rows = PerExampleSlices(
                saved[1],
                tf.cast(self.lookup_rows(layer, saved, grads), layer.embeddings.dtype),
                tf.TensorShape(layer.embeddings.shape),
            )
            out = [rows.scale(weights).sum_examples()]
            if not layer.tie_weights:
                out.append(tf.zeros(layer.reverse_embeddings.shape, layer.reverse_embeddings.dtype))
            return out
        h, g = self.projection_operands(layer, saved, grads)
        # weighted_kernel_sum scales h ([B, T, D]), not g ([B, T, V], V >> D).
        if layer.tie_weights:
            return [tf.cast(outer_products.weighted_kernel_sum(g, h, weights), layer.embeddings.dtype)]
        v = layer.reverse_embeddings
        return [
            self._no_rows(layer, tf.shape(h)[0]).sum_examples(),
            tf.cast(outer_products.weighted_kernel_sum(h, g, weights), v.dtype),
        ]


REVERSIBLE_EMBEDDING_RULE = ReversibleEmbeddingRule()
if hasattr(keras.layers, "ReversibleEmbedding"):  # Keras's class, which KerasHub 0.32's subclasses
    register_layer_rule(keras.layers.ReversibleEmbedding, REVERSIBLE_EMBEDDING_RULE)
# KerasHub's own class (its own class before it subclassed Keras's), by name: no keras_hub import.
register_layer_rule("keras_hub.src.layers.modeling.reversible_embedding.ReversibleEmbedding", REVERSIBLE_EMBEDDING_RULE)
