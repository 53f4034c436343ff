"""KerasHub's ViT and DeiT patch embeddings: a patch convolution, tokens and a position table, in closed form.

Registered by full class name, so importing this module never imports
``keras_hub``. Both layers compute, on images ``a`` ``[B, H, W, C]``
(channels_last),

    y = concat([tokens..., reshape(conv(a), [B, N, D])], axis=1) + P        [B, k + N, D]

with ``conv`` a ``keras.layers.Conv2D`` (``patch_embedding``: kernel and
strides the patch size, ``"valid"``, ``N = (H / p_h)(W / p_w)`` patches),
``k`` learned tokens each tiled over the batch (ViT: ``class_token`` when
``use_class_token``; DeiT: ``class_token`` then ``distillation_token``), all
``[1, 1, D]``, and ``P`` the position table added to every example (ViT: a
``keras.layers.Embedding`` ``[k + N, D]`` looked up at ``arange(k + N)``, each
row once; DeiT: a variable ``[1, k + N, D]``). DeiT then applies its
``Dropout``. With ``g = dL/dy`` (for DeiT, the gradient at the dropout's
input, which the rule taps inside the layer: the dropout's mask is in it),
example n's gradients are

- token j: ``g[n, j]`` (``[1, 1, D]``);
- position table: ``g[n]`` (``[k + N, D]``; DeiT ``[1, k + N, D]``);
- the convolution's kernel and bias: those of a Conv2D whose output gradient
  is ``g[n, k:]`` reshaped to ``[h, w, D]``, which is the convolution rule's
  closed form (``rules.conv``: per-example kernels, Gram or materialized
  norms, and the clipped sum as one kernel VJP of the batch) at that
  gradient;
- DeiT's ``mask_token`` (when ``use_mask_token``): 0, as the layer does not
  use it without ``bool_masked_pos``.

The rule runs the layer's own call (the model computes what it computes
without the engine, bit for bit). A call with ``bool_masked_pos`` (DeiT),
channels_first images, or a quantized or LoRA sublayer uses the exact
layer-local fallback.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from per_example_grads._core.example_ops import compute_dtype, squares_part, weighted_example_sum, widened
from per_example_grads._core.model_inspection import replaced_calls
from per_example_grads.rules.conv import PATCHES_RULE
from per_example_grads.rules.local import LOCAL_RULE
from per_example_grads.rules.rule import LayerRule, register_layer_rule, reparametrized

VIT_PATCHING = "keras_hub.src.models.vit.vit_layers.ViTPatchingAndEmbedding"
DEIT_EMBEDDINGS = "keras_hub.src.models.deit.deit_layers.DeiTEmbeddings"


class PatchEmbeddingRule(LayerRule):
    """ViT's ``ViTPatchingAndEmbedding`` (module docstring); ``DeiTEmbeddingsRule`` adapts it to DeiT.

    ``saved`` is ``("closed", a)`` with ``a`` the images, or ``("local",
    saved)`` for a call that goes to the layer-local rule.
    """

    def tokens(self, layer) -> list:
        """The ``[1, 1, D]`` token variables, in the order they are concatenated before the patches."""
        return [layer.class_token] if layer.use_class_token else []

    def position_table(self, layer):
        """The position variable: ``[k + N, D]`` for ViT."""
        return layer.position_embedding.embeddings

    def unused(self, layer) -> list:
        """Variables the layer holds but does not use on this path (their gradients are 0)."""
        return []

    def position_gradients(self, layer, g: tf.Tensor) -> tf.Tensor:
        """Per-example gradients of ``position_table`` from ``g`` ``[B, k + N, D]``."""
        return g

    def unsupported(self, layer):
        conv = getattr(layer, "patch_embedding", None)
        if not isinstance(conv, keras.layers.Conv2D) or type(conv).call is not keras.layers.Conv2D.call:
            return f"'{layer.name}''s patch_embedding is not a keras.layers.Conv2D"
        if getattr(layer, "data_format", "channels_last") != "channels_last":
            return "channels_first patch embeddings use the layer-local fallback"
        why = PATCHES_RULE.unsupported(conv) or reparametrized(conv)
        if why:
            return why
        position = getattr(layer, "position_embedding", None)
        if isinstance(position, keras.layers.Layer):
            return reparametrized(position)
        return None

    def _all(self, layer) -> list:
        conv = layer.patch_embedding
        return [*self.tokens(layer), *PATCHES_RULE.variables(conv), self.position_table(layer), *self.unused(layer)]

    def variables(self, layer):
        return [v for v in self._all(layer) if v.trainable]

    def _keep(self, layer, values: list) -> list:
        return [t for t, v in zip(values, self._all(layer)) if v.trainable]

    def local_call(self, layer, args, kwargs) -> bool:
        """Whether this call goes to the layer-local rule."""
        return False

    def output_gradient_tap(self, layer, call, args, kwargs):
        """``(outputs, tap)``: the layer's call and the tensor whose gradient is ``g`` (ViT: the output)."""
        y = call(*args, **kwargs)
        return y, y

    def forward(self, layer, call, args, kwargs):
        if self.local_call(layer, args, kwargs):
            outputs, saved, taps = LOCAL_RULE.forward(layer, call, args, kwargs)
            return outputs, ("local", saved), taps
        outputs, tap = self.output_gradient_tap(layer, call, args, kwargs)
        return outputs, ("closed", args[0]), [tap]

    def _conv_operands(self, layer, a, grads) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """``(a, [g_conv])``: the convolution's input and its output gradient ``[B, h, w, D]``."""
        g = grads[0]
        k = len(self.tokens(layer))
        conv = layer.patch_embedding
        out_shape = conv.compute_output_shape(tuple(a.shape.as_list()))
        h = out_shape[1] if out_shape[1] is not None else tf.shape(a)[1] // conv.strides[0]
        w = out_shape[2] if out_shape[2] is not None else tf.shape(a)[2] // conv.strides[1]
        return a, [tf.reshape(g[:, k:], [-1, h, w, g.shape[-1]])]

    def _small_parts(self, layer, g) -> tuple[list, tf.Tensor]:
        """Per-example gradients of the tokens (``[B, 1, 1, D]`` each) and of the position table."""
        tokens = [tf.reshape(g[:, j], [-1, 1, 1, g.shape[-1]]) for j in range(len(self.tokens(layer)))]
        return tokens, self.position_gradients(layer, g)

    def per_example(self, layer, saved, grads):
        kind, value = saved
        if kind == "local":
            return LOCAL_RULE.per_example(layer, value, grads, variables=self.variables(layer))
        conv = layer.patch_embedding
        g = grads[0]
        tokens, position = self._small_parts(layer, g)
        conv_parts = PATCHES_RULE.per_example(conv, *self._conv_operands(layer, value, grads))
        unused = [tf.zeros(tf.concat([tf.shape(g)[:1], v.shape], 0), v.dtype) for v in self.unused(layer)]
        values = [*tokens, *conv_parts, position, *unused]
        return self._keep(layer, values)

    def squared_norms(self, layer, saved, grads, cache=None):
        kind, value = saved
        if kind == "local":
            return LayerRule.squared_norms(self, layer, saved, grads, cache)
        conv = layer.patch_embedding
        g = grads[0]
        tokens, position = self._small_parts(layer, g)
        conv_cache = None if cache is None else cache.setdefault("conv", {})
        conv_norms = PATCHES_RULE.squared_norms(conv, *self._conv_operands(layer, value, grads), conv_cache)
        small = widened([squares_part(tf.cast(t, compute_dtype(t.dtype))) for t in [*tokens, position]])
        unused = [tf.zeros_like(small[0]) for _ in self.unused(layer)]
        return self._keep(layer, [*small[: len(tokens)], *conv_norms, small[-1], *unused])

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        kind, value = saved
        if kind == "local":
            return LayerRule.weighted_sum(self, layer, saved, grads, weights, cache)
        conv = layer.patch_embedding
        g = grads[0]
        tokens, position = self._small_parts(layer, g)
        conv_cache = None if cache is None else cache.get("conv")
        conv_sums = PATCHES_RULE.weighted_sum(conv, *self._conv_operands(layer, value, grads), weights, conv_cache)
        dtype = compute_dtype(g.dtype)
        w = tf.cast(weights, dtype)
        small = [weighted_example_sum(w, tf.cast(t, dtype)) for t in [*tokens, position]]
        unused = [tf.zeros(v.shape, v.dtype) for v in self.unused(layer)]
        values = [*small[: len(tokens)], *conv_sums, small[-1], *unused]
        return self._keep(layer, values)


class DeiTEmbeddingsRule(PatchEmbeddingRule):
    """DeiT's ``DeiTEmbeddings``: class and distillation tokens, a ``[1, k + N, D]`` position variable, a dropout."""

    def tokens(self, layer):
        return [layer.class_token, layer.distillation_token]

    def position_table(self, layer):
        return layer.position_embedding

    def unused(self, layer):
        return [layer.mask_token] if getattr(layer, "use_mask_token", False) else []

    def position_gradients(self, layer, g):
        return g[:, None]

    def unsupported(self, layer):
        if not isinstance(getattr(layer, "dropout", None), keras.layers.Dropout):
            return f"'{layer.name}' has no keras.layers.Dropout 'dropout' (not the DeiTEmbeddings this rule was written for)"
        return super().unsupported(layer)

    def local_call(self, layer, args, kwargs):
        masked = kwargs.get("bool_masked_pos", args[1] if len(args) > 1 else None)
        return masked is not None

    def output_gradient_tap(self, layer, call, args, kwargs):
        """The call, with the dropout's input tapped (an identity that the dropout alone consumes)."""
        taps = []
        dropout = layer.dropout
        inner = dropout.call

        def tapped(inputs, *a, **kw):
            inputs = tf.identity(inputs)
            taps.append(inputs)
            return inner(inputs, *a, **kw)

        with replaced_calls([(dropout, tapped)]):
            y = call(*args, **kwargs)
        if len(taps) != 1:
            raise NotImplementedError(
                f"DeiTEmbeddings '{layer.name}' called its dropout {len(taps)} times; expected once"
            )
        return y, taps[0]


PATCH_EMBEDDING_RULE = PatchEmbeddingRule()
DEIT_EMBEDDINGS_RULE = DeiTEmbeddingsRule()
register_layer_rule(VIT_PATCHING, PATCH_EMBEDDING_RULE)
register_layer_rule(DEIT_EMBEDDINGS, DEIT_EMBEDDINGS_RULE)
