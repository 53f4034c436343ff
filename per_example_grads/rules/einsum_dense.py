"""EinsumDense (and through it MultiHeadAttention's projections), and its LoRA form.

The closed forms are ``einsum_forms``': for ``z = einsum("<in>,<kernel>-><out>",
a, W)`` example n's kernel gradient is ``einsum("<in>,<out>->b<kernel>", a,
g)``, the clipped sum one contraction, and the norms Dense's forms when the
equation is a Dense layer in disguise. A LoRA-enabled EinsumDense goes to
``EinsumDenseLoraRule`` (maths in ``lora_forms``).
"""

from __future__ import annotations

import string

import keras
import tensorflow as tf

from per_example_grads._core.example_ops import squares_part, widened
from per_example_grads.rules.einsum_forms import (
    bias_weighted_sum,
    expand_equation,
    in_compute_dtype,
    kernel_part,
    kernel_per_example,
    kernel_weighted_sum,
    split_equation,
    unsupported_equation,
)
from per_example_grads.rules.lora_forms import has_trainable_bias, lora_scale, lora_variables, unsupported_lora
from per_example_grads.rules.rule import LayerRule, register_layer_rule, reparametrized, sum_to_shape

__all__ = [
    "EINSUM_DENSE_LORA_RULE",
    "EinsumDenseLoraRule",
    "EinsumDenseRule",
    "kernel_part",
    "kernel_per_example",
    "kernel_weighted_sum",
    "unsupported_equation",
]  # the einsum forms stay importable from here, where they were first defined


class EinsumDenseRule(LayerRule):
    def for_layer(self, layer):
        return EINSUM_DENSE_LORA_RULE if getattr(layer, "lora_enabled", False) else self

    def unsupported(self, layer):
        if reparametrized(layer):
            return reparametrized(layer)
        return unsupported_equation(layer.equation)

    def variables(self, layer):
        return [layer.kernel] + ([layer.bias] if layer.bias is not None else [])

    def forward(self, layer, call, args, kwargs):
        a = args[0]
        z = keras.ops.einsum(layer.equation, a, layer.kernel)
        if layer.bias is not None:
            z = keras.ops.add(z, layer.bias)
        out = layer.activation(z) if layer.activation is not None else z
        return out, a, [z]

    def per_example(self, layer, saved, grads):
        a, g = in_compute_dtype(saved, grads[0])
        inp, kern, out = expand_equation(layer.equation, a.shape.rank)
        result = [kernel_per_example(inp, kern, out, a, g)]
        if layer.bias is not None:
            result.append(sum_to_shape(g, layer.bias.shape))
        return result

    def squared_norms(self, layer, saved, grads, cache=None):
        a, g = in_compute_dtype(saved, grads[0])
        inp, kern, out = expand_equation(layer.equation, a.shape.rank)
        parts = [kernel_part(inp, kern, out, layer.kernel.shape, a, g)]
        if layer.bias is not None:
            parts.append(squares_part(sum_to_shape(g, layer.bias.shape)))
        return widened(parts)

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        a, g = in_compute_dtype(saved, grads[0])
        inp, kern, out = expand_equation(layer.equation, a.shape.rank)
        result = [kernel_weighted_sum(inp, kern, out, a, g, weights)]
        if layer.bias is not None:
            result.append(bias_weighted_sum(g, weights, layer.bias.shape))
        return result


class EinsumDenseLoraRule(EinsumDenseRule):
    """A LoRA-enabled ``keras.layers.EinsumDense`` (``lora_forms``): the einsum forms on two pairs of factors."""

    def for_layer(self, layer):
        return self

    def unsupported(self, layer):
        why = unsupported_lora(layer) or unsupported_equation(layer.equation)
        if why:
            return why
        inp, kern, out = split_equation(layer.equation)
        last = kern[-1]
        if last not in out or last in inp:
            return f"LoRA on equation {layer.equation!r}: the kernel's last axis is not an output axis"
        return None

    def variables(self, layer):
        return lora_variables(layer)

    def _pieces(self, layer, saved, grads):
        """The two EinsumDense problems ``(inp, kernel, out, kernel_shape, x, y)`` of ``A`` and ``B``, and ``g``."""
        a, g = in_compute_dtype(saved, grads[0])
        inp, kern, out = expand_equation(layer.equation, a.shape.rank)
        r = next(c for c in string.ascii_letters if c not in inp + kern + out)
        k0, k = kern[:-1], kern[-1]
        out_r = out.replace(k, r)
        lora_a, lora_b = tf.cast(layer.lora_kernel_a, a.dtype), tf.cast(layer.lora_kernel_b, a.dtype)
        s = tf.constant(lora_scale(layer), a.dtype)
        u = tf.einsum(f"{inp},{k0}{r}->{out_r}", a, lora_a)
        g_u = s * tf.einsum(f"{out},{r}{k}->{out_r}", g, lora_b)
        return [
            (inp, k0 + r, out_r, layer.lora_kernel_a.shape, a, g_u),
            (out_r, r + k, out, layer.lora_kernel_b.shape, u, s * g),
        ], g

    def per_example(self, layer, saved, grads):
        pieces, g = self._pieces(layer, saved, grads)
        result = [kernel_per_example(i, k, o, x, y) for i, k, o, _, x, y in pieces]
        if has_trainable_bias(layer):
            result.append(sum_to_shape(g, layer.bias.shape))
        return result

    def squared_norms(self, layer, saved, grads, cache=None):
        pieces, g = self._pieces(layer, saved, grads)
        parts = [kernel_part(i, k, o, shape, x, y) for i, k, o, shape, x, y in pieces]
        if has_trainable_bias(layer):
            parts.append(squares_part(sum_to_shape(g, layer.bias.shape)))
        return widened(parts)

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        pieces, g = self._pieces(layer, saved, grads)
        result = [kernel_weighted_sum(i, k, o, x, y, weights) for i, k, o, _, x, y in pieces]
        if has_trainable_bias(layer):
            result.append(bias_weighted_sum(g, weights, layer.bias.shape))
        return result


EINSUM_DENSE_LORA_RULE = EinsumDenseLoraRule()
register_layer_rule(keras.layers.EinsumDense, EinsumDenseRule())
