"""Per-example maths of ``z = einsum("<in>,<kernel>-><out>", a, W)``, shared by EinsumDense and its LoRA form.

With the batch letter ``b`` leading ``<in>`` and ``<out>`` and ``g = dL/dz``,
example n's kernel gradient is ``einsum("<in>,<out>->b<kernel>", a, g)`` and
the weighted sum over examples is ``einsum("<in>,<out>-><kernel>", a, c * g)``.
When the equation is a Dense layer in disguise (input = batch + positions M +
contracted C, kernel = C + outputs K, output = batch + M + K, as in every
MultiHeadAttention projection), the norms use Dense's ``||a||^2 ||g||^2`` /
Gram forms (``outer_products``) on ``a`` reshaped to ``[B, |M|, |C|]`` and
``g`` to ``[B, |M|, |K|]``.
"""

from __future__ import annotations

import math
import string

import tensorflow as tf

from per_example_grads._core.example_ops import compute_dtype, graph_constant, squares_part
from per_example_grads.rules import outer_products
from per_example_grads.rules.rule import sum_to_shape


def split_equation(equation: str) -> tuple[str, str, str]:
    """``(input, kernel, output)`` letters of an EinsumDense equation, spaces removed."""
    lhs, out = equation.replace(" ", "").split("->")
    inp, kern = lhs.split(",")
    return inp, kern, out


def expand_equation(equation: str, a_rank: int) -> tuple[str, str, str]:
    """``split_equation`` with ``...`` replaced by explicit letters for an input of rank ``a_rank``."""
    inp, kern, out = split_equation(equation)
    if "..." in inp:
        free = [c for c in string.ascii_uppercase if c not in equation]
        ell = "".join(free[: a_rank - (len(inp) - 3)])
        inp, out = inp.replace("...", ell), out.replace("...", ell)
    return inp, kern, out


def unsupported_equation(equation: str) -> str | None:
    """Why ``equation`` has no per-example closed form (no leading batch axis, kernel-only axes), or None."""
    inp, kern, out = split_equation(equation)
    if "..." in kern or inp.startswith("...") != out.startswith("..."):
        return f"equation {equation!r} has no leading batch axis"
    if not inp.startswith("...") and (inp[0] != out[0] or inp[0] in kern):
        return f"equation {equation!r} has no leading batch axis"
    if not set(kern) <= set(inp) | set(out):
        return f"equation {equation!r} has kernel-only axes"
    return None


def in_compute_dtype(a: tf.Tensor, g: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``a`` and ``g`` cast to ``a``'s compute dtype (``example_ops.compute_dtype``)."""
    dtype = compute_dtype(a.dtype)
    return tf.cast(a, dtype), tf.cast(g, dtype)


def kernel_per_example(inp: str, kern: str, out: str, a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """``[B, *kernel]``: ``einsum("<in>,<out>->b<kernel>", a, g)``, the per-example kernel gradients."""
    return tf.einsum(f"{inp},{out}->{inp[0]}{kern}", a, g)


def kernel_weighted_sum(inp: str, kern: str, out: str, a: tf.Tensor, g: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
    """``[*kernel]``: ``sum_n weights[n] kernel_per_example(...)[n]``, one contraction."""
    gw = g * tf.reshape(tf.cast(weights, g.dtype), graph_constant([-1] + [1] * (g.shape.rank - 1)))
    return tf.einsum(f"{inp},{out}->{kern}", a, gw)


def bias_weighted_sum(g: tf.Tensor, weights: tf.Tensor, bias_shape) -> tf.Tensor:
    """``[*bias_shape]``: ``sum_n weights[n] sum_to_shape(g, bias_shape)[n]``."""
    gw = g * tf.reshape(tf.cast(weights, g.dtype), graph_constant([-1] + [1] * (g.shape.rank - 1)))
    return tf.reduce_sum(sum_to_shape(gw, bias_shape), axis=graph_constant(0))


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
    a_btf = _positions_rows(tf.einsum(f"{inp}->{b}{m}{c}", a), math.prod(dims[x] for x in c))
    g_btf = _positions_rows(tf.einsum(f"{out}->{b}{m}{k}", g), math.prod(dims[x] for x in k))
    if a_btf.shape[1] is None and a.shape[1:].is_fully_defined():
        a_btf = tf.ensure_shape(a_btf, [None, a.shape[1:].num_elements() // a_btf.shape[2], a_btf.shape[2]])
        g_btf = tf.ensure_shape(g_btf, [None, a_btf.shape[1], g_btf.shape[2]])
    return outer_products.kernel_part(a_btf, g_btf)


def _positions_rows(t: tf.Tensor, width: int) -> tf.Tensor:
    """``[B, ...]`` -> ``[B, T, width]``: the axes after the first flattened, ``width`` entries a row.

    With those axes static the target shape is one constant, ``[-1, T,
    width]`` (``example_ops._rows``); ``[tf.shape(t)[0], -1, width]`` took
    a shape, a slice and a pack more per tensor, two tensors per
    ``EinsumDense`` layer in every DP step's graph.
    """
    inner = t.shape[1:]
    if inner.is_fully_defined() and inner.num_elements() > 0:
        return tf.reshape(t, graph_constant([-1, inner.num_elements() // width, width]))
    return tf.reshape(t, [tf.shape(t)[0], -1, width])
