"""Transposed convolutions: Conv1DTranspose, Conv2DTranspose, Conv3DTranspose (channels_last).

A transposed convolution is the adjoint of a convolution. Keras computes
``z = conv_transpose(x, W) + b`` with TensorFlow's ``conv_transpose``: for the
convolution ``A_W`` of the layer's kernel size, strides, dilation and padding
on inputs of the output's size ``[*spatial_out, F]`` (``F`` the layer's
``filters``), ``conv_transpose(x, W) = A_W^T x``, the input gradient of that
convolution at ``x`` ``[B, *spatial_in, C]``. The layer's kernel
``W`` ``[*kernel_size, F, C]`` is that convolution's kernel (``F`` in, ``C``
out). With ``g = dL/dz`` ``[B, *spatial_out, F]``, example n's loss depends on
``W`` through ``<g_n, A_W^T x_n> = <A_W g_n, x_n>``, so

    dL_n/dW = d<A_W g_n, x_n>/dW,

the kernel gradient of the convolution ``A_W`` with input ``g_n`` and output
gradient ``x_n``: the roles of the input and the output gradient swap, and
every closed form of ``conv.py`` applies to ``(a, g) = (g, x)`` (norms by the
Gram form or the per-example kernels, per offset or from patches; the clipped
sum as one weight-gradient op at ``(g, c * x)``, or from the kept kernels).
``output_padding`` adds output positions no kernel offset of ``A_W`` meets
(TensorFlow checks the sizes agree), so they drop out. The bias gradient is
``sum_t g_n[t]``, as for a convolution.

Per-example gradients are the same kernels, ``conv.per_example_kernels`` at
``(g, x)``; channels_first layers use the exact layer-local VJP for everything.
"""

from __future__ import annotations

import keras

from per_example_grads.rules.conv import ConvPatchesRule, channels_last_only
from per_example_grads.rules.rule import register_layer_rule


class ConvTransposeRule(ConvPatchesRule):
    """``z = conv_transpose(x, W) + b``, then the fused activation: ``conv.py``'s forms with input and gradient swapped."""

    def unsupported(self, layer):
        return channels_last_only(layer, "transposed")

    def convolution_operands(self, saved, grads):
        return grads[0], saved


CONV_TRANSPOSE_RULE = ConvTransposeRule()

register_layer_rule(keras.layers.Conv1DTranspose, CONV_TRANSPOSE_RULE)
register_layer_rule(keras.layers.Conv2DTranspose, CONV_TRANSPOSE_RULE)
register_layer_rule(keras.layers.Conv3DTranspose, CONV_TRANSPOSE_RULE)
