"""Closed forms for KerasHub's RMS normalizations, learned position embeddings and DeBERTa's relative embedding.

Registered by full class name, so importing this module never imports
``keras_hub``. Every rule here runs the layer's own ``call`` for the output
(the model computes exactly, bit for bit, what it computed before) and taps
that output; what a closed form needs beside it (``xh`` below) is computed
next to the call, by the layer's own formula.

RMS normalizations (``RMS_NORMALIZATIONS``: Gemma's, Gemma 3's and Gemma 4's
``RMSNormalization``, ``LlamaLayerNorm``, ``MistralLayerNormalization``,
``MixtralLayerNormalization``, ``Phi3LayerNorm``, ``QwenLayerNorm``,
``Qwen3LayerNorm`` (also on ``[B, T, heads, head_dim]`` queries and keys),
``Qwen3_5LayerNorm``, ``QwenMoeLayerNorm``, ``Qwen3MoeLayerNorm``,
``GptOssLayerNormalization``, ``RoformerNorm``, ``T5LayerNorm``,
``Gemma3nRMSNorm`` and ``keras_hub.layers.RMSNormalization``): with

    xh = x / sqrt(mean(x^2 over the last axis) + eps)

(each class's own ops: ``rsqrt``, ``1 / sqrt`` or ``power(., -0.5)``; in
float32 for the classes that cast to it, else in the input's dtype, at least
float32) the output is ``y = xh * (c + s)`` with the scale ``s`` ``[D]``
(``layer.scale``, T5's ``layer.weight``) and ``c = 1`` (Gemma, Gemma 3,
Qwen 3.5) or 0 (the others). With ``g = dL/dy``, example n's gradient is

    dL_n/ds = sum over the axes between batch and features of g_n * xh_n,   [B, D]

whatever ``c``; the clipped sum is ``sum_n w_n dL_n/ds``, ``[D]``.
(``keras.layers.RMSNormalization``, Keras's own, is in ``rules.normalization``.)

``PositionEmbedding`` (GPT-2, BERT, RoBERTa, DistilBERT, BART): a table ``E`` of
``[L, D]``; ``call(inputs, start_index=s)`` returns ``E[s : s + T]``
broadcast to ``inputs``' shape ``[B, ..., T, D]``. Example n's gradient is
``g_n`` summed over its broadcast axes, ``[T, D]``, placed at rows
``s .. s + T - 1`` of an ``[L, D]`` zero table. Norms and clipped sums use the
``[B, T, D]`` rows alone (never the ``[B, L, D]`` padded tables). Explicit
``positions=`` (vLLM serving) raise ``NotImplementedError`` (``auto`` then
falls back to another engine).

DeBERTa's ``RelativeEmbedding``: a table ``E`` ``[2K, D]`` normalized by the
layer's own ``LayerNormalization`` (per row: ``y_r = LN(E)_r``, ``gamma``
and ``beta`` ``[D]``) and repeated for every example: ``out_n = LN(E)``,
``[B, 2K, D]``. The examples share the input ``E``, so with ``g_n = dL/dout_n``
example n's gradients are the VJPs of one ``LN`` at ``E``:

    dL_n/dE = VJP_E(LN)(g_n)                [B, 2K, D]  (one batched VJP of LN on B copies of E)
    dL_n/dgamma = sum_r g_nr * xh_r,        dL_n/dbeta = sum_r g_nr     [B, D]

(``xh = (E - mean) / sqrt(var + eps)`` per row). The VJP is linear in
``g``, so the clipped sum is one VJP of ``LN`` at the weighted cotangent
``sum_n w_n g_n`` (``[2K, D]``), with respect to ``E``, ``gamma`` and
``beta`` together; the norms square the ``[B, 2K, D]`` gradients, no larger
than ``g``.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from per_example_grads._core.example_ops import compute_dtype, wide_squared_norms
from per_example_grads._core.tape import watch_variables
from per_example_grads.rules.rule import LayerRule, register_layer_rule, sum_to_shape


@dataclasses.dataclass(frozen=True)
class RMSForm:
    """How one RMS normalization class computes ``xh`` (the module docstring), and where its scale is.

    Attributes:
      variable: the attribute holding the scale ``[D]`` (``"scale"``; T5's ``"weight"``).
      epsilon: the attribute holding ``eps``, or None for a class that adds ``default_epsilon``.
      default_epsilon: ``eps`` when the attribute is missing.
      float32: the class casts its input to float32 (else it normalizes in the input's dtype).
      square: ``"power"`` (``ops.power(x, 2)``) or ``"square"`` (``ops.square(x)``).
      inverse_root: ``"rsqrt"``, ``"reciprocal_sqrt"`` (``1 / sqrt``) or ``"power"`` (``power(., -0.5)``).
    """

    variable: str = "scale"
    epsilon: str | None = "epsilon"
    default_epsilon: float = 1e-6
    float32: bool = True
    square: str = "power"
    inverse_root: str = "rsqrt"

    def normalized(self, layer, x: tf.Tensor) -> tf.Tensor:
        """``xh`` of ``x`` ``[B, ..., D]`` by the class's ops (float32, or at least float32)."""
        ops = keras.ops
        x = tf.cast(x, tf.float32 if self.float32 else compute_dtype(x.dtype))
        eps = getattr(layer, self.epsilon, self.default_epsilon) if self.epsilon else self.default_epsilon
        squares = ops.power(x, 2) if self.square == "power" else ops.square(x)
        var = ops.mean(squares, axis=-1, keepdims=True) + eps
        if self.inverse_root == "rsqrt":
            inv = ops.rsqrt(var)
        elif self.inverse_root == "reciprocal_sqrt":
            inv = ops.reciprocal(ops.sqrt(var))
        else:
            inv = ops.power(var, -0.5)
        return x * inv


_HUB = "keras_hub.src"
RMS_NORMALIZATIONS: dict[str, RMSForm] = {
    f"{_HUB}.models.gemma.rms_normalization.RMSNormalization": RMSForm(square="square", inverse_root="reciprocal_sqrt"),
    f"{_HUB}.models.gemma3.gemma3_layers.RMSNormalization": RMSForm(square="square", inverse_root="reciprocal_sqrt"),
    f"{_HUB}.models.gemma4.gemma4_layers.RMSNormalization": RMSForm(square="square", inverse_root="power"),
    f"{_HUB}.models.gemma3n.rms_normalization.Gemma3nRMSNorm": RMSForm(epsilon="eps", float32=False, square="square"),
    f"{_HUB}.models.llama.llama_layernorm.LlamaLayerNorm": RMSForm(),
    f"{_HUB}.models.mistral.mistral_layer_norm.MistralLayerNormalization": RMSForm(),
    f"{_HUB}.models.mixtral.mixtral_layer_norm.MixtralLayerNormalization": RMSForm(),
    f"{_HUB}.models.phi3.phi3_layernorm.Phi3LayerNorm": RMSForm(),
    f"{_HUB}.models.qwen.qwen_layernorm.QwenLayerNorm": RMSForm(),
    f"{_HUB}.models.qwen3.qwen3_layernorm.Qwen3LayerNorm": RMSForm(),
    f"{_HUB}.models.qwen3_5.qwen3_5_layers.Qwen3_5LayerNorm": RMSForm(),
    f"{_HUB}.models.qwen_moe.qwen_moe_layernorm.QwenMoeLayerNorm": RMSForm(),
    f"{_HUB}.models.qwen3_moe.qwen3_moe_layernorm.Qwen3MoeLayerNorm": RMSForm(),
    f"{_HUB}.models.gpt_oss.gpt_oss_layer_norm.GptOssLayerNormalization": RMSForm(),
    f"{_HUB}.models.roformer_v2.roformer_v2_attention.RoformerNorm": RMSForm(),
    f"{_HUB}.models.t5.t5_layer_norm.T5LayerNorm": RMSForm(variable="weight", float32=False, square="square"),
    # keras_hub.layers.RMSNormalization has no ``epsilon`` attribute; it adds 1e-6.
    f"{_HUB}.layers.modeling.rms_normalization.RMSNormalization": RMSForm(epsilon=None, square="square"),
}
POSITION_EMBEDDING = f"{_HUB}.layers.modeling.position_embedding.PositionEmbedding"
RELATIVE_EMBEDDING = f"{_HUB}.models.deberta_v3.relative_embedding.RelativeEmbedding"


class RMSNormRule(LayerRule):
    """The scale ``[D]`` of an RMS normalization over the last axis: ``[B, D]`` per-example gradients.

    ``form`` says how the class computes ``xh`` and names its scale
    (``RMSForm``); None (the built-in rule, ``RMS_NORM_RULE``) looks the
    layer's class up in ``RMS_NORMALIZATIONS``. ``saved`` is ``xh``, ``[B, ..., D]``.
    """

    def __init__(self, form: RMSForm | None = None):
        self.form = form

    def form_of(self, layer) -> RMSForm:
        """``self.form``, or the ``RMSForm`` of the nearest class in ``type(layer)``'s MRO that has one."""
        if self.form is not None:
            return self.form
        for cls in type(layer).__mro__:
            form = RMS_NORMALIZATIONS.get(f"{cls.__module__}.{cls.__qualname__}")
            if form is not None:
                return form
        return RMSForm()

    def _scale(self, layer):
        return getattr(layer, self.form_of(layer).variable, None)

    def unsupported(self, layer):
        if not isinstance(self._scale(layer), keras.Variable):
            return f"'{layer.name}' has no scale variable '{self.form_of(layer).variable}' (nothing to differentiate)"
        return None

    def variables(self, layer):
        return [self._scale(layer)]

    def forward(self, layer, call, args, kwargs):
        y = call(*args, **kwargs)
        return y, self.normalized(layer, args[0]), [y]

    def normalized(self, layer, x: tf.Tensor) -> tf.Tensor:
        """``xh``: what the layer multiplies by its scale."""
        return self.form_of(layer).normalized(layer, x)

    def per_example(self, layer, saved, grads):
        xh, scale = saved, self._scale(layer)
        per = sum_to_shape(tf.cast(grads[0], xh.dtype) * xh, scale.shape)  # the broadcast's gradient
        return [tf.cast(per, scale.dtype)]

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        if cache and "per_example" in cache:
            return super().weighted_sum(layer, saved, grads, weights, cache)
        xh, scale = saved, self._scale(layer)
        w = tf.reshape(tf.cast(weights, xh.dtype), [-1] + [1] * (xh.shape.rank - 1))
        summed = tf.reduce_sum(sum_to_shape(w * tf.cast(grads[0], xh.dtype) * xh, scale.shape), axis=0)
        return [tf.cast(summed, scale.dtype)]


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
        paddings = tf.concat([tf.zeros([rows.shape.rank - 2, 2], tf.int32), [[start, after]], [[0, 0]]], axis=0)
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


class RelativeEmbeddingRule(LayerRule):
    """DeBERTa's ``RelativeEmbedding``: ``rel_embeddings`` ``[2K, D]`` and its LayerNormalization's ``gamma``, ``beta``.

    The maths is in the module docstring. ``saved`` is None: everything the
    rule needs is the layer's own variables and ``g``. Requires its
    ``layer_norm`` to normalize each row over the last axis only (DeBERTa's);
    any other configuration goes to the layer-local fallback.
    """

    def unsupported(self, layer):
        norm = getattr(layer, "layer_norm", None)
        if not isinstance(norm, keras.layers.LayerNormalization) or not isinstance(
            getattr(layer, "rel_embeddings", None), keras.Variable
        ):
            return f"'{layer.name}' is not the RelativeEmbedding this rule was written for (rel_embeddings and a LayerNormalization)"
        axis = norm.axis if isinstance(norm.axis, (list, tuple)) else [norm.axis]
        if [a % 3 for a in axis] != [2]:
            return f"'{layer.name}''s LayerNormalization normalizes over axes {norm.axis}, not the last one"
        return None

    def _all(self, layer) -> list:
        norm = layer.layer_norm
        return [layer.rel_embeddings] + [v for v in (norm.gamma, norm.beta) if v is not None]

    def variables(self, layer):
        return [v for v in self._all(layer) if v.trainable]

    def forward(self, layer, call, args, kwargs):
        y = call(*args, **kwargs)
        return y, None, [y]

    def _keep(self, layer, values: list) -> list:
        """``values`` aligned with ``_all(layer)`` -> those of the trainable variables."""
        return [t for t, v in zip(values, self._all(layer)) if v.trainable]

    def per_example(self, layer, saved, grads):
        norm, table = layer.layer_norm, layer.rel_embeddings
        g = grads[0]
        copies = tf.broadcast_to(tf.convert_to_tensor(table)[None], tf.concat([tf.shape(g)[:1], table.shape], 0))
        with tf.GradientTape() as tape:
            tape.watch(copies)
            y = norm(copies)  # LN is per row: the copies' VJPs are the examples' own
        d_table = tape.gradient(y, copies, output_gradients=tf.cast(g, y.dtype))
        out = [d_table]
        dtype = compute_dtype(g.dtype)
        g = tf.cast(g, dtype)
        if norm.gamma is not None:
            xh = keras.ops.layer_normalization(
                tf.cast(table, dtype), None, None, -1, norm.epsilon, rms_scaling=norm.rms_scaling
            )
            out.append(tf.einsum("brd,rd->bd", g, xh))
        if norm.beta is not None:
            out.append(tf.reduce_sum(g, axis=1))
        return self._keep(layer, out)

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        norm, table = layer.layer_norm, layer.rel_embeddings
        g = grads[0]
        summed = tf.tensordot(
            tf.cast(weights, compute_dtype(g.dtype)), tf.cast(g, compute_dtype(g.dtype)), axes=1
        )  # [2K, D]
        variables = self._all(layer)
        with tf.GradientTape() as tape:
            watch_variables(tape, variables)
            y = norm(tf.convert_to_tensor(table)[None])
        out = tape.gradient(y, variables, output_gradients=tf.cast(summed, y.dtype)[None])
        return self._keep(layer, [tf.zeros(v.shape, v.dtype) if t is None else t for t, v in zip(out, variables)])


RMS_NORM_RULE = RMSNormRule()
POSITION_EMBEDDING_RULE = PositionEmbeddingRule()
RELATIVE_EMBEDDING_RULE = RelativeEmbeddingRule()
for _name in RMS_NORMALIZATIONS:
    register_layer_rule(_name, RMS_NORM_RULE)
register_layer_rule(POSITION_EMBEDDING, POSITION_EMBEDDING_RULE)
register_layer_rule(RELATIVE_EMBEDDING, RELATIVE_EMBEDDING_RULE)
