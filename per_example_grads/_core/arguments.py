"""Checking the numbers a DP step is configured with.

Every DP entry point (``private_gradients``, ``GradientAccumulator``,
``DPModel``, ``clipped_gradients``) takes its clip norm, noise multiplier and
expected batch size through these functions, so they accept the same values
and refuse the same ones with the same messages:

- accepted: Python numbers, NumPy scalars and 0-d arrays, 0-d tensors;
- refused, naming the argument: NaN, infinities, and values out of range
  (a clip norm or expected batch size ``<= 0``, a noise multiplier ``< 0``),
  booleans and anything that is not a number;
- a symbolic tensor (inside ``tf.function``) cannot be checked when the
  function is traced, so it is returned with a run-time check attached
  (``tf.debugging``), which fails the step instead of, say, flipping the
  sign of every gradient with a negative clip norm.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Sequence

import numpy as np
import tensorflow as tf


def check_number(name: str, value: Any, *, minimum: float = 0.0, inclusive: bool = False):
    """``value`` as a float (or a checked tensor): finite and ``> minimum`` (``>=`` if ``inclusive``).

    Raises:
      TypeError: ``value`` is not a number, a NumPy scalar or a 0-d tensor.
      ValueError: NaN, infinite or out of range, naming ``name``.
    """
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
    if tf.is_tensor(value) or isinstance(value, tf.Variable):
        if value.shape.rank not in (0, None):
            raise ValueError(f"{name} must be a scalar; got a tensor of shape {value.shape}.")
        if not (value.dtype.is_floating or value.dtype.is_integer):
            raise TypeError(f"{name} must be a number; got a {value.dtype.name} tensor.")
        if tf.executing_eagerly() and not isinstance(value, tf.Variable):
            return check_number(name, value.numpy().item(), minimum=minimum, inclusive=inclusive)
        return _checked_tensor(name, value, minimum, inclusive, bound)
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number {bound}; got {type(value).__name__} {value!r}.")
    value = float(value)
    if not math.isfinite(value) or not (value >= minimum if inclusive else value > minimum):
        raise ValueError(f"{name} must be a finite number {bound}; got {value!r}.")
    return value


def _checked_tensor(name, value, minimum, inclusive, bound) -> tf.Tensor:
    value = tf.cast(value, tf.float32)
    ok = tf.logical_and(
        tf.math.is_finite(value),
        value >= minimum if inclusive else value > minimum,
    )
    check = tf.debugging.Assert(ok, [f"{name} must be a finite number {bound}; got", value])
    with tf.control_dependencies([check]):
        return tf.identity(value)


def check_clip(l2_norm_clip: Any, name: str = "l2_norm_clip"):
    """A flat clip norm (number or scalar tensor), a ``{layer_name: C}`` dict, or a list of them, each checked."""
    if isinstance(l2_norm_clip, Mapping):
        if not l2_norm_clip:
            raise ValueError(f"{name} is an empty dict; give one clip norm per layer name.")
        return {k: check_number(f"{name}[{k!r}]", v) for k, v in l2_norm_clip.items()}
    if isinstance(l2_norm_clip, Sequence) and not isinstance(l2_norm_clip, str):
        return [check_number(f"{name}[{i}]", c) for i, c in enumerate(l2_norm_clip)]
    return check_number(name, l2_norm_clip)


def check_dp_arguments(l2_norm_clip: Any, noise_multiplier: Any, expected_batch_size: Any = None):
    """``(clip, sigma, expected_batch_size)`` checked: ``C > 0``, ``sigma >= 0``, ``expected_batch_size > 0`` or None."""
    clip = check_clip(l2_norm_clip)
    sigma = check_number("noise_multiplier", noise_multiplier, inclusive=True)
    if expected_batch_size is not None:
        expected_batch_size = check_number("expected_batch_size", expected_batch_size)
    return clip, sigma, expected_batch_size


def total_clip(l2_norm_clip):
    """The bound on one example's whole clipped gradient: ``C``, or ``sqrt(sum_l C_l^2)`` for per-layer clipping."""
    if isinstance(l2_norm_clip, Mapping):
        l2_norm_clip = list(l2_norm_clip.values())
    if isinstance(l2_norm_clip, Sequence):
        return math.sqrt(sum(float(c) ** 2 for c in l2_norm_clip))
    return l2_norm_clip
