"""Dense: closed forms from the layer input ``a`` and the pre-activation gradient ``g``.

``z = a @ W + b`` with ``a`` ``[B, ..., i]``: the per-example kernel gradient
is ``sum_t a_t^T g_t`` over the positions ``t`` of a sequence input (see
``outer_products``) and the bias gradient is ``sum_t g_t``. Norms use
``||a||^2 ||g||^2`` (or the Gram form for sequences), and the clipped sum is
one contraction: nothing of size ``B x P`` is built for either.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from per_example_grads.rules import outer_products as op
from per_example_grads._core.example_ops import widened
from per_example_grads.rules.rule import LayerRule, register_layer_rule, reparametrized


class DenseRule(LayerRule):
    def for_layer(self, layer):
        if getattr(layer, "lora_enabled", False):
            from per_example_grads.rules.lora import DENSE_LORA_RULE

            return DENSE_LORA_RULE
        return self

    def unsupported(self, layer):
        return reparametrized(layer)

    def variables(self, layer):
        return [layer.kernel] + ([layer.bias] if layer.bias is not None else [])

    def forward(self, layer, call, args, kwargs):
        a = args[0]
        z = keras.ops.matmul(a, layer.kernel)
        if layer.bias is not None:
            z = keras.ops.add(z, layer.bias)
        out = layer.activation(z) if layer.activation is not None else z
        return out, a, [z]

    def per_example(self, layer, saved, grads):
        a, g = op.as_btf(saved), op.as_btf(grads[0])
        out = [op.per_example_kernel(a, g)]
        if layer.bias is not None:
            out.append(tf.reduce_sum(g, axis=1))
        return [tf.cast(t, v.dtype) for t, v in zip(out, self.variables(layer))]

    def squared_norms(self, layer, saved, grads, cache=None):
        a, g = op.as_btf(saved), op.as_btf(grads[0])
        return widened(op.kernel_and_bias_parts(a, g) if layer.bias is not None else [op.kernel_part(a, g)])

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        a, g = op.as_btf(saved), op.as_btf(grads[0])
        out = [op.weighted_kernel_sum(a, g, weights)]
        if layer.bias is not None:
            out.append(op.weighted_bias_sum(g, weights))
        return [tf.cast(t, v.dtype) for t, v in zip(out, self.variables(layer))]


    def outer_factors(self, layer, saved, grads):
        """``(a, g)`` for the kernel (``a_n g_n^T``) and ``(None, g)`` for the bias, for a rank-2 input."""
        if saved.shape.rank != 2:
            return None  # a sequence: sum_t a_t g_t^T is no single outer product
        return [(saved, grads[0])] + ([(None, grads[0])] if layer.bias is not None else [])


register_layer_rule(keras.layers.Dense, DenseRule())
