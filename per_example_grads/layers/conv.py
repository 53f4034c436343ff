"""Convolutions.

Conv1D and Conv2D (channels_last, ``groups=1``) have a closed form for norms
and clipped sums: a convolution is a Dense layer applied to every input patch. With the patches
``p = extract_patches(a)`` of shape ``[B, positions, kh*kw*c_in]`` (strides,
dilation and padding as the layer's, causal padding included) and the
pre-activation gradient ``g`` ``[B, positions, c_out]``, example n's kernel
gradient is ``sum_t p_nt^T g_nt``: ``outer_products`` then gives the norms
(Gram form or materialized, whichever is cheaper) and the clipped sum as one
contraction. Materialized per-example kernels come from the layer-local VJP
instead (measured as fast as ``tf.vectorized_map`` and faster than the patch
contraction, whose patches cost more than they save there).

Every other convolution (Conv3D, grouped, channels_first, depthwise,
separable) uses the exact layer-local VJP of the layer's own convolution on
each example, tapped before the fused activation.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from per_example_grads.layers import outer_products as op
from per_example_grads.layers.local import LocalRule, without_activation
from per_example_grads.layerwise.rule import LayerRule, register_layer_rule, reparametrized


class ConvPatchesRule(LayerRule):
    def unsupported(self, layer):
        if layer.rank not in (1, 2):
            return "only 1-D and 2-D convolutions have the patches closed form"
        if layer.groups != 1 or layer.data_format != "channels_last":
            return "grouped or channels_first convolutions use the layer-local fallback"
        return reparametrized(layer)

    def variables(self, layer):
        return [layer.kernel] + ([layer.bias] if layer.use_bias else [])

    def forward(self, layer, call, args, kwargs):
        with without_activation(layer, True):
            z = call(*args, **kwargs)
        out = layer.activation(z) if layer.activation is not None else z
        return out, (args, kwargs), [z]  # the layer-local rule's format, for per_example

    def _patches(self, layer, a: tf.Tensor) -> tf.Tensor:
        """``[B, positions, prod(kernel_size) * c_in]`` in the compute dtype."""
        a = tf.cast(a, op.compute_dtype(a))
        padding = layer.padding
        if layer.rank == 1:
            if padding == "causal":
                left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
                a = tf.pad(a, [[0, 0], [left, 0], [0, 0]])
                padding = "valid"
            a = a[:, None]  # [B, 1, T, C]: a 1 x k 2-D patch
            sizes, strides, rates = [1, 1, layer.kernel_size[0], 1], [1, 1, layer.strides[0], 1], [1, 1, layer.dilation_rate[0], 1]
        else:
            sizes = [1, *layer.kernel_size, 1]
            strides = [1, *layer.strides, 1]
            rates = [1, *layer.dilation_rate, 1]
        patches = tf.image.extract_patches(a, sizes=sizes, strides=strides, rates=rates, padding=padding.upper())
        return op.as_btf(patches)

    def per_example(self, layer, saved, grads):
        return LOCAL_CONV_RULE.per_example(layer, saved, grads, variables=self.variables(layer))

    def squared_norms(self, layer, saved, grads):
        p, g = self._patches(layer, saved[0][0]), op.as_btf(grads[0])
        out = [op.kernel_squared_norms(p, g)]
        if layer.use_bias:
            out.append(tf.reduce_sum(tf.square(tf.reduce_sum(g, axis=1)), axis=1))
        return out

    def weighted_sum(self, layer, saved, grads, weights):
        p, g = self._patches(layer, saved[0][0]), op.as_btf(grads[0])
        out = [tf.reshape(op.weighted_kernel_sum(p, g, weights), layer.kernel.shape)]
        if layer.use_bias:
            out.append(tf.einsum("btj,b->j", g, tf.cast(weights, g.dtype)))
        return [tf.cast(t, v.dtype) for t, v in zip(out, self.variables(layer))]


LOCAL_CONV_RULE = LocalRule(preactivation=True)
PATCHES_RULE = ConvPatchesRule()

register_layer_rule(keras.layers.Conv1D, PATCHES_RULE)
register_layer_rule(keras.layers.Conv2D, PATCHES_RULE)
for _cls in (
    keras.layers.Conv3D,
    keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D,
    keras.layers.SeparableConv1D,
    keras.layers.SeparableConv2D,
):
    register_layer_rule(_cls, LOCAL_CONV_RULE)
