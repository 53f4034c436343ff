"""EinsumDense (and through it MultiHeadAttention's projections).

For ``z = einsum("<in>,<kernel>-><out>", a, W)`` with batch letter ``b``
leading ``<in>`` and ``<out>``, example n's kernel gradient is
``einsum("<in>,<out>->b<kernel>", a, g)`` and the clipped sum is
``einsum("<in>,<out>-><kernel>", a, c * g)``. When the equation is a Dense
layer in disguise (input = batch + positions M + contracted C, kernel = C +
outputs K, output = batch + M + K, as in every MultiHeadAttention projection),
the norms use Dense's ``||a||^2 ||g||^2`` / Gram forms on ``a`` reshaped to
``[B, |M|, |C|]`` and ``g`` to ``[B, |M|, |K|]``.
"""

from __future__ import annotations

import math
import string

import keras
import tensorflow as tf

from per_example_grads.rules import outer_products as op
from per_example_grads._core.example_ops import squares_part, widened
from per_example_grads.rules.rule import LayerRule, register_layer_rule, reparametrized, sum_to_shape


def _split(equation: str) -> tuple[str, str, str]:
    lhs, out = equation.replace(" ", "").split("->")
    inp, kern = lhs.split(",")
    return inp, kern, out


def _expand(equation: str, a_rank: int) -> tuple[str, str, str]:
    """Replaces ``...`` with explicit letters for an input of rank ``a_rank``."""
    inp, kern, out = _split(equation)
    if "..." in inp:
        free = [c for c in string.ascii_uppercase if c not in equation]
        ell = "".join(free[: a_rank - (len(inp) - 3)])
        inp, out = inp.replace("...", ell), out.replace("...", ell)
    return inp, kern, out


def kernel_per_example(inp: str, kern: str, out: str, a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """``[B, *kernel]``: ``einsum("<in>,<out>->b<kernel>", a, g)``, the per-example kernel gradients."""
    return tf.einsum(f"{inp},{out}->{inp[0]}{kern}", a, g)


def kernel_weighted_sum(inp: str, kern: str, out: str, a: tf.Tensor, g: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
    """``[*kernel]``: ``sum_n weights[n] kernel_per_example(...)[n]``, one contraction."""
    gw = g * tf.reshape(tf.cast(weights, g.dtype), [-1] + [1] * (g.shape.rank - 1))
    return tf.einsum(f"{inp},{out}->{kern}", a, gw)


def kernel_part(inp: str, kern: str, out: str, kernel_shape, a: tf.Tensor, g: tf.Tensor) -> tuple:
    """``||kernel_per_example(...)[n]||^2``, by Dense's forms when the equation is a Dense in disguise.

    A part for ``example_ops.widened``: the value and its float64
    recomputation (``outer_products.kernel_part``). Otherwise (positions
    that are not shared by input and output) the per-example kernel
    gradients are built.
    """
    b = inp[0]
    contracted = [c for c in inp if c in kern]
    positions = [c for c in inp[1:] if c not in kern]
    outputs = [c for c in kern if c not in inp]
    if set(out[1:]) != set(positions) | set(outputs) or len(out) != 1 + len(positions) + len(outputs):
        return squares_part(kernel_per_example(inp, kern, out, a, g))
    dims = dict(zip(kern, kernel_shape))
    m, c, k = "".join(positions), "".join(contracted), "".join(outputs)
    a_btf = tf.reshape(tf.einsum(f"{inp}->{b}{m}{c}", a), [tf.shape(a)[0], -1, math.prod(dims[x] for x in c)])
    g_btf = tf.reshape(tf.einsum(f"{out}->{b}{m}{k}", g), [tf.shape(g)[0], -1, math.prod(dims[x] for x in k)])
    if a_btf.shape[1] is None and a.shape[1:].is_fully_defined():
        a_btf = tf.ensure_shape(a_btf, [None, a.shape[1:].num_elements() // a_btf.shape[2], a_btf.shape[2]])
        g_btf = tf.ensure_shape(g_btf, [None, a_btf.shape[1], g_btf.shape[2]])
    return op.kernel_part(a_btf, g_btf)


def _cast(a, g):
    dtype = op.compute_dtype(a.dtype)
    return tf.cast(a, dtype), tf.cast(g, dtype)


class EinsumDenseRule(LayerRule):
    def for_layer(self, layer):
        if getattr(layer, "lora_enabled", False):
            from per_example_grads.rules.lora import EINSUM_DENSE_LORA_RULE

            return EINSUM_DENSE_LORA_RULE
        return self

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
        a, g = _cast(saved, grads[0])
        inp, kern, out = _expand(layer.equation, a.shape.rank)
        result = [kernel_per_example(inp, kern, out, a, g)]
        if layer.bias is not None:
            result.append(sum_to_shape(g, layer.bias.shape))
        return [tf.cast(t, v.dtype) for t, v in zip(result, self.variables(layer))]

    def squared_norms(self, layer, saved, grads, cache=None):
        a, g = _cast(saved, grads[0])
        inp, kern, out = _expand(layer.equation, a.shape.rank)
        parts = [kernel_part(inp, kern, out, layer.kernel.shape, a, g)]
        if layer.bias is not None:
            parts.append(squares_part(sum_to_shape(g, layer.bias.shape)))
        return widened(parts)

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        a, g = _cast(saved, grads[0])
        inp, kern, out = _expand(layer.equation, a.shape.rank)
        result = [kernel_weighted_sum(inp, kern, out, a, g, weights)]
        if layer.bias is not None:
            gw = g * tf.reshape(tf.cast(weights, g.dtype), [-1] + [1] * (g.shape.rank - 1))
            result.append(tf.reduce_sum(sum_to_shape(gw, layer.bias.shape), axis=0))
        return [tf.cast(t, v.dtype) for t, v in zip(result, self.variables(layer))]


def unsupported_equation(equation: str) -> str | None:
    """Why ``equation`` has no per-example closed form (no leading batch axis, kernel-only axes), or None."""
    inp, kern, out = _split(equation)
    if "..." in kern or inp.startswith("...") != out.startswith("..."):
        return f"equation {equation!r} has no leading batch axis"
    if not inp.startswith("...") and (inp[0] != out[0] or inp[0] in kern):
        return f"equation {equation!r} has no leading batch axis"
    if not set(kern) <= set(inp) | set(out):
        return f"equation {equation!r} has kernel-only axes"
    return None


register_layer_rule(keras.layers.EinsumDense, EinsumDenseRule())
