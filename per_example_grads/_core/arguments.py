"""The one home of scalar argument checks: every error names the argument.

Importable without TensorFlow (``pegrad epsilon`` and the accountant use it
and never load TensorFlow): a value can only be a tensor once TensorFlow is
imported, so the tensor branches look TensorFlow up in ``sys.modules``.

Two families:

- **Accounting numbers** (``check_real``, ``check_noise_multiplier``,
  ``check_sampling_probability``, ``check_delta``, ``check_integer``,
  ``check_count``, ``check_choice``): Python or NumPy scalars only, returned
  as ``float``, ``int`` or ``str``.
- **DP step numbers** (``check_number``, ``check_clip``,
  ``check_dp_arguments``): every DP entry point (``private_gradients``,
  ``GradientAccumulator``, ``DPModel``, ``clipped_gradients``) takes its clip
  norm, noise multiplier and expected batch size through these, so they
  accept the same values and refuse the same ones with the same messages:

  - accepted: Python numbers, NumPy scalars and 0-d arrays, 0-d tensors;
  - refused, naming the argument: NaN, infinities, and values out of range
    (a clip norm or expected batch size ``<= 0``, a noise multiplier
    ``< 0``), booleans and anything that is not a number;
  - a symbolic tensor (inside ``tf.function``) cannot be checked when the
    function is traced, so it is returned with a run-time check attached
    (``tf.debugging``), which fails the step instead of, say, flipping the
    sign of every gradient with a negative clip norm.

Errors: ``TypeError`` for a value of the wrong kind, ``ValueError`` for one
out of range (NaN and infinities included).
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Mapping, Sequence

import numpy as np


def _tensorflow():
    """The TensorFlow module if something imported it, else None (then no value is a tensor)."""
    return sys.modules.get("tensorflow")


def _is_tensor(value: Any) -> bool:
    tf = _tensorflow()
    return tf is not None and (tf.is_tensor(value) or isinstance(value, tf.Variable))


# -- accounting numbers -----------------------------------------------------


def check_real(name: str, value: Any, *, expected: str = "a number") -> float:
    """``value`` as a finite float: a Python or NumPy real number, not a bool.

    Raises:
      TypeError: not a real number (``"{name} must be {expected}; got ..."``).
      ValueError: NaN or infinite.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected}; got {value!r}.")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value!r}.")
    return value


def check_noise_multiplier(value: Any, name: str = "noise_multiplier") -> float:
    """``sigma >= 0`` as a float (0 means no noise, epsilon = inf)."""
    sigma = check_real(name, value)
    if sigma < 0:
        raise ValueError(f"{name} must be >= 0 (0 means no noise, epsilon = inf); got {value!r}.")
    return sigma


def check_sampling_probability(value: Any, name: str = "sampling_probability") -> float:
    """``q`` in ``(0, 1]`` as a float."""
    q = check_real(name, value, expected="a number in (0, 1]")
    if not 0 < q <= 1:
        raise ValueError(f"{name} must be in (0, 1]; got {value!r}.")
    return q


def check_delta(value: Any, name: str = "delta") -> float:
    """``delta`` in ``(0, 1)`` as a float."""
    delta = check_real(name, value)
    if not 0 < delta < 1:
        raise ValueError(f"{name} must be in (0, 1); got {value!r}.")
    return delta


def check_integer(name: str, value: Any, *, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]``: a Python or NumPy integer, not a bool.

    The message says ``a positive integer`` for ``minimum=1``, ``a
    non-negative integer`` for 0, else ``an integer >= minimum``.

    Raises:
      TypeError: not an integer (a float such as ``2.0`` included).
      ValueError: out of range.
    """
    what = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {what}; got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be {what}; got {value!r}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum:.0e}; got {value!r}.")
    return int(value)


def check_positive_int(name: str, value: Any) -> int:
    """``check_integer(name, value, minimum=1)``."""
    return check_integer(name, value, minimum=1)


def check_count(name: str, value: Any, maximum: int | None = None) -> int:
    """A number of steps or events: ``check_integer(name, value, minimum=0, maximum=maximum)``."""
    return check_integer(name, value, minimum=0, maximum=maximum)


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else a ``ValueError`` listing them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}.")
    return value


# -- DP step numbers ----------------------------------------------------------


def check_number(name: str, value: Any, *, minimum: float = 0.0, inclusive: bool = False):
    """``value`` as a float (or a checked tensor): finite and ``> minimum`` (``>=`` if ``inclusive``).

    Raises:
      TypeError: ``value`` is not a number, a NumPy scalar or a 0-d tensor.
      ValueError: NaN, infinite or out of range, naming ``name``.
    """
    bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
    if _is_tensor(value):
        tf = _tensorflow()
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


def _checked_tensor(name, value, minimum, inclusive, bound):
    tf = _tensorflow()
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
    flat = list(clip.values()) if isinstance(clip, Mapping) else list(clip) if isinstance(clip, Sequence) else [clip]
    if all(isinstance(c, numbers.Real) for c in flat + [sigma]):
        std = float(sigma) * total_clip(clip)
        # A float32 normal draw reaches about 6.7 std (Box-Muller on 32-bit uniforms): past this it is inf.
        if std * 8.0 > float(np.finfo(np.float32).max):
            raise ValueError(
                f"noise_multiplier * l2_norm_clip = {std:g} is too large: float32 noise of that std overflows to "
                "inf and makes the weights NaN. Scale the loss down instead of the clip norm up."
            )
    return clip, sigma, expected_batch_size


def total_clip(l2_norm_clip):
    """The bound on one example's whole clipped gradient: ``C``, or ``sqrt(sum_l C_l^2)`` for per-layer clipping."""
    if isinstance(l2_norm_clip, Mapping):
        l2_norm_clip = list(l2_norm_clip.values())
    if isinstance(l2_norm_clip, Sequence):
        return math.sqrt(sum(float(c) ** 2 for c in l2_norm_clip))
    return l2_norm_clip
