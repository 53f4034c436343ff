"""Closed forms for KerasHub's RMS normalizations and learned position embeddings.

Registered by full class name, so importing this module never imports
``keras_hub``.

RMS normalizations (Gemma's ``RMSNormalization``, ``LlamaLayerNorm``,
``MistralLayerNormalization``, ``Phi3LayerNorm``,
``keras_hub.layers.RMSNormalization``): with
``xh = x / sqrt(mean(x^2 over the last axis) + eps)`` (in float32) the output
is ``y = xh * (c + scale)``, ``c = 1`` for Gemma and 0 for the others, so with
``g = dL/dy`` example n's gradient is

    dL_n/dscale = sum over the axes between batch and features of g_n * xh_n,   [B, D]

whatever ``c``. The rule runs the layer's own ``call`` for the output (the
model computes exactly what it computed before) and keeps its own ``xh``.

``PositionEmbedding`` (GPT-2, BERT, RoBERTa, DistilBERT): a table ``E`` of
``[L, D]``; ``call(inputs, start_index=s)`` returns ``E[s : s + T]``
broadcast to ``inputs``' shape ``[B, ..., T, D]``. Example n's gradient is
``g_n`` summed over its broadcast axes, ``[T, D]``, placed at rows
``s .. s + T - 1`` of an ``[L, D]`` zero table. Norms and clipped sums use the
``[B, T, D]`` rows alone (never the ``[B, L, D]`` padded tables). Explicit
``positions=`` (vLLM serving) raise ``NotImplementedError`` (``auto`` then
falls back to another engine).
"""

from __future__ import annotations

import tensorflow as tf

from per_example_grads._core.example_ops import wide_squared_norms
from per_example_grads.rules.rule import LayerRule, register_layer_rule

RMS_NORMALIZATIONS = (
    "keras_hub.src.models.gemma.rms_normalization.RMSNormalization",
    "keras_hub.src.models.llama.llama_layernorm.LlamaLayerNorm",
    "keras_hub.src.models.mistral.mistral_layer_norm.MistralLayerNormalization",
    "keras_hub.src.models.phi3.phi3_layernorm.Phi3LayerNorm",
    "keras_hub.src.layers.modeling.rms_normalization.RMSNormalization",
)
POSITION_EMBEDDING = "keras_hub.src.layers.modeling.position_embedding.PositionEmbedding"

# keras_hub.layers.RMSNormalization has no ``epsilon`` attribute; it adds 1e-6.
_DEFAULT_EPSILON = 1e-6


class RMSNormRule(LayerRule):
    """``scale`` ``[D]`` of an RMS normalization over the last axis: ``[B, D]`` per-example gradients."""

    def variables(self, layer):
        return [layer.scale]

    def forward(self, layer, call, args, kwargs):
        y = call(*args, **kwargs)
        x = tf.cast(args[0], tf.float32)  # every KerasHub RMS norm computes in float32
        eps = getattr(layer, "epsilon", _DEFAULT_EPSILON)
        xh = x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=-1, keepdims=True) + eps)
        return y, xh, [y]

    @staticmethod
    def _middle_axes(xh: tf.Tensor) -> list[int]:
        return list(range(1, xh.shape.rank - 1))

    def per_example(self, layer, saved, grads):
        xh = saved
        gx = tf.cast(grads[0], xh.dtype) * xh  # [B, ..., D]
        axes = self._middle_axes(xh)
        per = tf.reduce_sum(gx, axis=axes) if axes else gx
        return [tf.cast(per, layer.scale.dtype)]

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        if cache and "per_example" in cache:
            return super().weighted_sum(layer, saved, grads, weights, cache)
        xh = saved
        g = tf.cast(grads[0], xh.dtype)
        w = tf.reshape(tf.cast(weights, xh.dtype), [-1] + [1] * (xh.shape.rank - 1))
        summed = tf.reduce_sum(w * g * xh, axis=[0] + self._middle_axes(xh))
        return [tf.cast(summed, layer.scale.dtype)]


class PositionEmbeddingRule(LayerRule):
    """``position_embeddings`` ``[L, D]`` read as rows ``s .. s+T-1``: per-example gradients ``[B, L, D]``."""

    def variables(self, layer):
        return [layer.position_embeddings]

    def forward(self, layer, call, args, kwargs):
        if kwargs.get("positions") is not None:
            raise NotImplementedError(
                f"PositionEmbedding '{layer.name}' called with positions= has no closed form here"
            )
        y = call(*args, **kwargs)
        start = kwargs.get("start_index", args[1] if len(args) > 1 else 0)
        return y, start, [y]

    @staticmethod
    def _rows(grad: tf.Tensor) -> tf.Tensor:
        """``g`` ``[B, ..., T, D]`` summed over its broadcast axes: ``[B, T, D]``."""
        axes = list(range(1, grad.shape.rank - 2))
        return tf.reduce_sum(grad, axis=axes) if axes else grad

    @staticmethod
    def _place(rows: tf.Tensor, start, length) -> tf.Tensor:
        """Zero-pads the ``T`` rows (second-to-last axis) of ``rows`` to ``length`` rows, the first at ``start``."""
        t = tf.shape(rows)[-2]
        start = tf.cast(start, tf.int32)
        after = length - start - t
        paddings = tf.concat(
            [tf.zeros([rows.shape.rank - 2, 2], tf.int32), [[start, after]], [[0, 0]]], axis=0
        )
        return tf.pad(rows, paddings)

    def per_example(self, layer, saved, grads):
        table = layer.position_embeddings
        rows = tf.cast(self._rows(grads[0]), table.dtype)
        placed = self._place(rows, saved, table.shape[0])
        return [tf.ensure_shape(placed, [None, *table.shape])]

    def squared_norms(self, layer, saved, grads, cache=None):
        return [wide_squared_norms(self._rows(grads[0]))]

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        table = layer.position_embeddings
        rows = self._rows(grads[0])
        summed = tf.tensordot(tf.cast(weights, rows.dtype), rows, axes=1)  # [T, D]
        return [tf.ensure_shape(tf.cast(self._place(summed, saved, table.shape[0]), table.dtype), table.shape)]


RMS_NORM_RULE = RMSNormRule()
POSITION_EMBEDDING_RULE = PositionEmbeddingRule()
for _name in RMS_NORMALIZATIONS:
    register_layer_rule(_name, RMS_NORM_RULE)
register_layer_rule(POSITION_EMBEDDING, POSITION_EMBEDDING_RULE)
