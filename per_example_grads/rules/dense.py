"""Dense: closed forms from the layer input ``a`` and the pre-activation gradient ``g``.

``z = a @ W + b`` with ``a`` ``[B, ..., i]``: the per-example kernel gradient
is ``sum_t a_t^T g_t`` over the positions ``t`` of a sequence input (see
``outer_products``) and the bias gradient is ``sum_t g_t``. Norms use
``||a||^2 ||g||^2`` (or the Gram form for sequences), and the clipped sum is
one contraction: nothing of size ``B x P`` is built for either. A
LoRA-enabled Dense goes to ``DenseLoraRule`` (maths in ``lora_forms``).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from per_example_grads._core.example_ops import squares_part, widened
from per_example_grads.rules import outer_products
from per_example_grads.rules.lora_forms import has_trainable_bias, lora_scale, lora_variables, unsupported_lora
from per_example_grads.rules.rule import LayerRule, register_layer_rule, reparametrized


class DenseRule(LayerRule):
    def for_layer(self, layer):
        return DENSE_LORA_RULE if getattr(layer, "lora_enabled", False) else self

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
        a, g = outer_products.flat_positions(saved), outer_products.flat_positions(grads[0])
        out = [outer_products.per_example_kernel(a, g)]
        if layer.bias is not None:
            out.append(tf.reduce_sum(g, axis=1))
        return out

    def squared_norms(self, layer, saved, grads, cache=None):
        a, g = outer_products.flat_positions(saved), outer_products.flat_positions(grads[0])
        if layer.bias is not None:
            return widened(outer_products.kernel_and_bias_parts(a, g))
        return widened([outer_products.kernel_part(a, g)])

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        a, g = outer_products.flat_positions(saved), outer_products.flat_positions(grads[0])
        out = [outer_products.weighted_kernel_sum(a, g, weights)]
        if layer.bias is not None:
            out.append(outer_products.weighted_bias_sum(g, weights))
        return out

    def outer_factors(self, layer, saved, grads):
        """``(a, g)`` for the kernel (``a_n g_n^T``) and ``(None, g)`` for the bias, for a rank-2 input."""
        if saved.shape.rank != 2:
            return None  # a sequence: sum_t a_t g_t^T is no single outer product
        return [(saved, grads[0])] + ([(None, grads[0])] if layer.bias is not None else [])


class DenseLoraRule(DenseRule):
    """A LoRA-enabled ``keras.layers.Dense`` (``lora_forms``): the Dense forms on two pairs of factors."""

    def for_layer(self, layer):
        return self

    def unsupported(self, layer):
        return unsupported_lora(layer)

    def variables(self, layer):
        return lora_variables(layer)

    def _pairs(self, layer, saved, grads):
        """``[(a, s g B^T), (u, s g)]``, ``[B, T, *]`` in the compute dtype, and ``g``."""
        a, g = outer_products.flat_positions(saved), outer_products.flat_positions(grads[0])
        lora_a, lora_b = tf.cast(layer.lora_kernel_a, a.dtype), tf.cast(layer.lora_kernel_b, a.dtype)
        s = tf.constant(lora_scale(layer), a.dtype)
        u = tf.einsum("bti,ir->btr", a, lora_a)
        return [(a, s * tf.einsum("btj,rj->btr", g, lora_b)), (u, s * g)], g

    def per_example(self, layer, saved, grads):
        pairs, g = self._pairs(layer, saved, grads)
        out = [outer_products.per_example_kernel(x, y) for x, y in pairs]
        if has_trainable_bias(layer):
            out.append(tf.reduce_sum(g, axis=1))
        return out

    def squared_norms(self, layer, saved, grads, cache=None):
        pairs, g = self._pairs(layer, saved, grads)
        parts = [outer_products.kernel_part(x, y) for x, y in pairs]
        if has_trainable_bias(layer):
            parts.append(squares_part(tf.reduce_sum(g, axis=1)))
        return widened(parts)

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        pairs, g = self._pairs(layer, saved, grads)
        out = [outer_products.weighted_kernel_sum(x, y, weights) for x, y in pairs]
        if has_trainable_bias(layer):
            out.append(outer_products.weighted_bias_sum(g, weights))
        return out

    def outer_factors(self, layer, saved, grads):
        return None


DENSE_LORA_RULE = DenseLoraRule()
register_layer_rule(keras.layers.Dense, DenseRule())
