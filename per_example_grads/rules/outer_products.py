"""Per-example maths of ``z = a @ W``, shared by Dense and EinsumDense.

With ``a`` of shape ``[B, T, i]`` (T positions: 1 for a plain vector input)
and the loss gradient ``g = dL/dz`` of shape ``[B, T, j]``, example n's kernel
gradient is ``G_n = sum_t a_nt^T g_nt`` (``[i, j]``). Then:

- ``||G_n||^2 = sum_{t,s} (a_nt . a_ns)(g_nt . g_ns)`` (the Gram form, cost
  ``T^2 (i + j)``), which for ``T = 1`` is ``||a_n||^2 ||g_n||^2``; the
  alternative, materializing ``G_n``, costs ``T i j``. ``kernel_part``
  picks the cheaper as ``path_costs.dense_gram_cheaper`` prices them.
- ``sum_n c_n G_n = a^T (c * g)``, one contraction over ``B`` and ``T``.

All of it runs in float32 (float64 for float64 inputs); the norms come with
their float64 recomputation, for the rare batches whose float32 norms
overflow (``kernel_part``, ``example_ops.widened``).
"""

from __future__ import annotations

import functools

import tensorflow as tf

from per_example_grads._core.example_ops import (
    WIDE,
    compute_dtype,
    example_column,
    graph_constant,
    per_example_squared_norms,
    squares_part,
    weighted_example_sum,
    wide_sum_of_squares,
)
from per_example_grads.rules import path_costs


def flat_positions(t: tf.Tensor) -> tf.Tensor:
    """``[B, ..., f]`` -> ``[B, T, f]`` in the compute dtype: every axis between the first and the last flattened into one of positions."""
    t = tf.cast(t, compute_dtype(t.dtype))
    positions = t.shape[1:-1]
    f = t.shape[-1] if t.shape[-1] is not None else tf.shape(t)[-1]  # unknown when traced after some Keras ops
    if positions.is_fully_defined():  # keep T static: it picks the norm formula
        shape = [-1, positions.num_elements(), f]
        return tf.reshape(t, graph_constant(shape) if isinstance(f, int) else shape)
    return tf.reshape(t, [tf.shape(t)[0], -1, f])


as_btf = flat_positions  # deprecated name of flat_positions


def per_example_kernel(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """``[B, i, j]``: ``sum_t a[:, t, :]^T g[:, t, :]``, from ``[B, T, i]`` and ``[B, T, j]``.

    For ``T = 1`` an outer product, taken as a broadcast multiply (each entry
    one rounded product, as in the batched matrix product, which on CPU is
    slower at writing the same ``B i j`` floats).
    """
    if a.shape[1] == 1 and g.shape[1] == 1:
        return a[:, 0, :, None] * g[:, 0, None, :]
    return tf.einsum("bti,btj->bij", a, g)


def kernel_part(a: tf.Tensor, g: tf.Tensor) -> tuple:
    """``||per_example_kernel(a, g)[n]||^2`` without building it when cheaper, as a part for ``example_ops.widened``.

    ``(value, its float64 recomputation)``: the value is ``||a_n||^2
    ||g_n||^2``, the Gram form or the built kernel's sum of squares, in the
    inputs' dtype; the recomputation, the same in float64 (where
    ``||a_n||^2`` of activations beyond about 1.8e19 is finite) for the
    examples ``widened`` picks; None for float64 inputs.
    """
    t, i, j = a.shape[1], a.shape[2], g.shape[2]
    narrow = a.dtype != WIDE
    if t == 1:
        product = per_example_squared_norms(a) * per_example_squared_norms(g)
        return product, (lambda pick: wide_sum_of_squares(pick(a)) * wide_sum_of_squares(pick(g))) if narrow else None
    if t is not None and i is not None and j is not None and _gram_cheaper(a.shape[0], t, i, j):
        gram = _gram_squared_norms(a, g)
        return gram, (
            lambda pick: _gram_squared_norms(tf.cast(pick(a), WIDE), tf.cast(pick(g), WIDE))
        ) if narrow else None
    return squares_part(per_example_kernel(a, g))


def _gram_cheaper(b: int | None, t: int, i: int, j: int) -> bool:
    """Whether ``path_costs`` prices the Gram form below building ``G_n`` (an unknown batch priced as 64 examples)."""
    return path_costs.dense_gram_cheaper(b if b is not None else 64, t, i, j, path_costs.machine())


def kernel_and_bias_parts(a: tf.Tensor, g: tf.Tensor) -> list[tuple]:
    """``[kernel_part(a, g), the bias's]`` (``sum_t g_nt``, a Dense bias's gradient) for ``example_ops.widened``.

    For ``T = 1`` the bias's squared norm is ``||g_n||^2``, the kernel's
    factor: computed once, as is its float64 recomputation.
    """
    if a.shape[1] != 1:
        return [kernel_part(a, g), squares_part(tf.reduce_sum(g, axis=1))]
    norms_a, norms_g = per_example_squared_norms(a), per_example_squared_norms(g)
    if a.dtype == WIDE:
        return [(norms_a * norms_g, None), (norms_g, None)]
    wide = functools.cache(lambda pick: (wide_sum_of_squares(pick(a)), wide_sum_of_squares(pick(g))))
    return [(norms_a * norms_g, lambda pick: wide(pick)[0] * wide(pick)[1]), (norms_g, lambda pick: wide(pick)[1])]


def _gram_squared_norms(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """``[B]``: ``sum_{t,s} (a_t . a_s)(g_t . g_s)``, in the inputs' dtype."""
    aa = tf.einsum("bti,bsi->bts", a, a)
    gg = tf.einsum("btj,bsj->bts", g, g)
    return tf.reduce_sum(aa * gg, axis=graph_constant([1, 2]))


def weighted_kernel_sum(a: tf.Tensor, g: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
    """``[i, j]``: ``sum_n weights[n] * per_example_kernel(a, g)[n]``.

    One matrix product of ``[B T, i]`` and ``[B T, j]``. The weights scale the
    smaller of ``a`` and ``g`` (a vocabulary projection's ``g`` is
    ``[B, T, V]`` against ``a``'s ``[B, T, D]``).
    """
    i, j = a.shape[-1], g.shape[-1]
    if i is not None and j is not None and i < j:
        a = a * example_column(weights, a.dtype, 3)
    else:
        g = g * example_column(weights, g.dtype, 3)
    rows = lambda t, n: tf.reshape(t, graph_constant([-1, n]) if n is not None else [-1, tf.shape(t)[-1]])  # [B T, n]
    return tf.linalg.matmul(rows(a, i), rows(g, j), transpose_a=True)


def weighted_bias_sum(g: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
    """``[j]``: ``sum_n weights[n] sum_t g[n, t]``, a bias's weighted sum, from ``[B, T, j]``.

    The positions are summed first, then one matrix-vector product over the
    examples (faster on CPU than the equivalent ``einsum``, ``benchmarks/RESULTS.md``).
    """
    return weighted_example_sum(weights, tf.reduce_sum(g, axis=graph_constant(1)))
