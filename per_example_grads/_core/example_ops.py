"""Reductions over the example axis of a ``[B, ...]`` tensor, shared by the rules, the engines and the transforms.

They import nothing from the package but ``xla_context`` (which imports
nothing), so any module may use them.
"""

from __future__ import annotations

import tensorflow as tf

from per_example_grads._core.xla_context import in_xla_context


def compute_dtype(dtype) -> tf.DType:
    """The one rule for the dtype of norms, clip factors and reductions: float64 for float64, else float32.

    Half-precision gradients are reduced in float32 (their squares overflow
    and their sums lose digits), float64 ones keep their precision, so every
    layer of a model gives norms of one dtype that add up.
    """
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


def in_dtype(value, dtype) -> tf.Tensor:
    """``value`` as a tensor of ``dtype``; a Python number is converted directly (``tf.cast`` of one goes
    through float32 first, which turns 0.05 into 0.050000000745 in a float64 computation)."""
    return tf.cast(value, dtype) if tf.is_tensor(value) else tf.constant(value, dtype)


def per_example_squared_norms(t: tf.Tensor) -> tf.Tensor:
    """``[B]``: ``sum(t[n] ** 2)`` over all axes but the first, in float32 (float64 for float64 ``t``).

    One fused reduction (``reduce_euclidean_norm``, squared): it never holds
    a squared copy of ``t`` (for an output gradient ``g`` that copy is as
    large as ``g``, which the clipped sum keeps alive until every norm is
    known), and on CPU it is 1.5-3x faster than ``reduce_sum(square(t))`` and
    2-6x faster than a batched dot product of each row with itself
    (``benchmarks/RESULTS.md``). Squaring the norm costs at most two roundings.
    XLA has no such kernel; it fuses ``reduce_sum(square(t))`` into one instead.
    """
    t = tf.cast(t, compute_dtype(t.dtype))
    rows = tf.reshape(t, [tf.shape(t)[0], -1])
    if in_xla_context():
        return tf.reduce_sum(tf.square(rows), axis=1)
    return tf.square(tf.math.reduce_euclidean_norm(rows, axis=1))


def weighted_example_sum(weights: tf.Tensor, t: tf.Tensor) -> tf.Tensor:
    """``sum_i weights[i] * t[i]``: ``[*t.shape[1:]]`` from ``[B]`` weights and ``[B, ...]`` ``t``.

    One matrix-vector product on ``t`` viewed as ``[B, n]``; ``tf.tensordot``
    builds the same from a dozen shape ops, which cost more than the product
    on small layers.
    """
    flat = tf.reshape(t, [tf.shape(t)[0], -1])
    total = tf.linalg.matvec(flat, tf.cast(weights, t.dtype), transpose_a=True)
    return tf.reshape(total, t.shape[1:] if t.shape[1:].is_fully_defined() else tf.shape(t)[1:])
