"""Small composable transforms on materialized per-example gradients.

Every function takes ``grads``, a list whose k-th entry has shape
``[B, *var_k.shape]`` (what ``per_example_gradients`` returns; an entry may be
a ``PerExampleSlices``, which they use as rows, never densely), and works
eagerly, inside ``tf.function`` and under XLA. Norms are computed in float32
(or float64 for float64 gradients), whatever the gradients' dtype.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from per_example_grads._core.arguments import check_number
from per_example_grads._core.example_ops import compute_dtype, in_dtype
from per_example_grads.per_example_slices import PerExampleSlices


def per_variable_norms(grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """L2 norm of each example's gradient, per variable.

    ``norms[k][i] = ||grads[k][i]||_2``.

    Args:
      grads: list of ``[B, *var_k.shape]``.

    Returns:
      list of ``[B]`` tensors.

    Examples:
      >>> g = [tf.constant([[3.0, 4.0], [0.0, 1.0]])]
      >>> per_variable_norms(g)[0].numpy()
      array([5., 1.], dtype=float32)
    """
    return [tf.sqrt(s) for s in _per_variable_squared_norms(gradient_list(grads))]


def global_norms(grads: Sequence[tf.Tensor]) -> tf.Tensor:
    """L2 norm of each example's whole gradient, across all variables.

    ``norms[i] = sqrt(sum_k ||grads[k][i]||^2)``.

    Args:
      grads: list of ``[B, *var_k.shape]``.

    Returns:
      ``[B]``.

    Examples:
      >>> g = [tf.constant([[3.0], [0.0]]), tf.constant([[4.0], [2.0]])]
      >>> global_norms(g).numpy()
      array([5., 2.], dtype=float32)
    """
    if not gradient_list(grads):
        raise ValueError("grads is empty: expected a list of [B, *var.shape] tensors.")
    # Scaling by the largest entry keeps squares of huge gradients (1e20 and
    # up in float32) from overflowing to inf.
    scale = _max_abs(grads)
    return scale * tf.sqrt(tf.add_n(_per_variable_squared_norms(grads, scale)))


def clip_by_global_norm(grads: Sequence[tf.Tensor], l2_norm_clip: float) -> tuple[list[tf.Tensor], tf.Tensor]:
    """Scales each example's gradient to global L2 norm at most ``l2_norm_clip``.

    With ``n_i = global_norms(grads)[i]`` and ``C = l2_norm_clip``:
    ``clipped[k][i] = grads[k][i] * C / max(n_i, C)``, so examples with
    ``n_i <= C`` are unchanged and the others get norm exactly ``C``.

    Args:
      grads: list of ``[B, *var_k.shape]``.
      l2_norm_clip: ``C > 0``, a Python float or scalar tensor.

    Returns:
      ``(clipped, norms)``: clipped is a list shaped like ``grads``; norms is
      ``[B]``, the norms before clipping.

    Examples:
      >>> g = [tf.constant([[3.0, 4.0], [0.3, 0.4]])]
      >>> clipped, norms = clip_by_global_norm(g, 1.0)
      >>> clipped[0].numpy()
      array([[0.6, 0.8],
             [0.3, 0.4]], dtype=float32)
    """
    l2_norm_clip = check_number("l2_norm_clip", l2_norm_clip)
    norms = global_norms(gradient_list(grads))
    factors = clip_factors(norms, l2_norm_clip)
    clipped = [scale_examples(g, factors) for g in grads]
    return clipped, norms


def clip_factors(norms: tf.Tensor, l2_norm_clip) -> tf.Tensor:
    """``C / max(n_i, C)`` per example: ``[B]`` scale factors that bring norms ``n`` to at most ``C``.

    An example whose norm is NaN or Inf gets factor 0: it contributes nothing
    (still at most ``C``, so clipping's sensitivity bound holds), instead of
    making every sum it enters NaN.
    """
    clip = in_dtype(l2_norm_clip, norms.dtype)
    return tf.where(tf.math.is_finite(norms), clip / tf.maximum(norms, clip), tf.zeros_like(norms))


def scale_examples(g, factors: tf.Tensor):
    """``g[i] * factors[i]`` for one entry ``g`` (``[B, *var.shape]`` or ``PerExampleSlices``) and ``[B]`` factors."""
    if isinstance(g, PerExampleSlices):
        return g.scale(factors)
    g = tf.convert_to_tensor(g)
    # multiply_no_nan: a factor of 0 gives 0 even for a NaN or Inf gradient.
    return tf.math.multiply_no_nan(g, tf.cast(_expand_to(factors, g), g.dtype))


def sum_examples(grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """``sum_i grads[k][i]``: list of ``[*var_k.shape]``, the summed-loss gradient.

    A ``PerExampleSlices`` entry sums to ``tf.IndexedSlices``, as
    ``tape.gradient`` returns for an embedding table.
    """
    return [
        g.sum_examples() if isinstance(g, PerExampleSlices) else tf.reduce_sum(g, axis=0) for g in gradient_list(grads)
    ]


def mean_examples(grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """``mean_i grads[k][i]``: list of ``[*var_k.shape]``; zeros when B == 0."""
    out = []
    for g, total in zip(grads, sum_examples(grads)):
        count = tf.shape(g.values if isinstance(g, PerExampleSlices) else g)[0]
        out.append(divide_no_nan(total, count))
    return out


def divide_no_nan(total, count):
    """``total / count`` for a tensor or ``tf.IndexedSlices`` ``total``; zeros when ``count`` is 0."""
    if isinstance(total, tf.IndexedSlices):
        values = tf.math.divide_no_nan(total.values, tf.cast(count, total.dtype))
        return tf.IndexedSlices(values, total.indices, total.dense_shape)
    return tf.math.divide_no_nan(total, tf.cast(count, total.dtype))


def gradient_list(grads) -> list:
    """``grads`` as a list, or a ``TypeError`` for one tensor, which would be read as a list of its rows.

    Every transform takes one ``[B, *var.shape]`` entry per variable; given a
    single tensor, iterating it would treat each example as a variable.
    """
    if tf.is_tensor(grads) or isinstance(grads, (PerExampleSlices, np.ndarray, tf.Variable)):
        raise TypeError(
            f"grads must be a list with one [B, *var.shape] entry per variable (as per_example_gradients "
            f"returns); got one {type(grads).__name__} of shape {tuple(grads.shape)}. For a single "
            "variable, pass [grads]."
        )
    return list(grads)


def _per_variable_squared_norms(grads: Sequence[tf.Tensor], scale=None) -> list[tf.Tensor]:
    """``||grads[k][i] / scale[i]||^2`` per variable: list of ``[B]``."""
    out = []
    for g in grads:
        if isinstance(g, PerExampleSlices):
            g = PerExampleSlices(g.indices, tf.cast(g.values, compute_dtype(g.dtype)), g.table_shape)
            out.append((g if scale is None else g.scale(1 / scale)).squared_norms())
            continue
        g = tf.convert_to_tensor(g)
        g = tf.cast(g, compute_dtype(g.dtype))
        flat = tf.reshape(g, [tf.shape(g)[0], -1])
        if scale is not None:
            flat = flat / tf.cast(scale[:, None], flat.dtype)
        out.append(tf.reduce_sum(tf.square(flat), axis=1))
    return out


def _max_abs(grads: Sequence[tf.Tensor]) -> tf.Tensor:
    """``max_k max |grads[k][i]|`` per example, ``[B]``; 1 where that is 0 or not finite."""
    per_var = []
    for g in grads:
        if isinstance(g, PerExampleSlices):
            per_var.append(g.max_abs())
            continue
        g = tf.convert_to_tensor(g)
        g = tf.cast(g, compute_dtype(g.dtype))
        per_var.append(tf.reduce_max(tf.abs(tf.reshape(g, [tf.shape(g)[0], -1])), axis=1))
    m = tf.reduce_max(tf.stack([tf.cast(p, compute_dtype(p.dtype)) for p in per_var]), axis=0)
    usable = tf.logical_and(m > 0, tf.math.is_finite(m))
    return tf.where(usable, m, tf.ones_like(m))


def _expand_to(factors: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """``[B]`` -> ``[B, 1, ..., 1]`` broadcastable against ``like``."""
    return tf.reshape(factors, [-1] + [1] * (like.shape.rank - 1))
