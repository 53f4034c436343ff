"""Gradients across a process boundary: to and from ``{variable.path: numpy array}``.

To carry ``(gradient, variable)`` pairs (from ``compute_gradients``) to a
parameter-server-style worker, a file or a queue, ``export_gradients`` turns
them into ``{variable.path: numpy array}``, and ``import_gradients`` checks
such a dict against a model's variables by name, shape and dtype before
pairing them up again. Real multi-machine training should go through
``tf.distribute``; this is for the simple cases.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import tensorflow as tf


def export_gradients(grads_and_vars: Sequence[tuple[Any, Any]]) -> dict[str, np.ndarray]:
    """``{variable.path: gradient as numpy}``, e.g. for ``np.savez`` or pickling."""
    out = {}
    for g, v in grads_and_vars:
        name = _name(v)
        if name in out:
            raise ValueError(f"two variables share the name {name!r}; cannot export by name.")
        out[name] = np.asarray(tf.convert_to_tensor(g))
    return out


def import_gradients(arrays: Mapping[str, np.ndarray], variables: Sequence) -> list[tuple[tf.Tensor, Any]]:
    """Pairs exported arrays with ``variables``, checking names, shapes and dtypes.

    Args:
      arrays: ``{variable.path: array}`` from ``export_gradients``.
      variables: the receiving model's variables (e.g.
        ``model.trainable_variables``).

    Raises:
      ValueError: listing missing or unexpected names, or mismatched shapes
        or dtypes.
    """
    names = [_name(v) for v in variables]
    problems = []
    missing = [n for n in names if n not in arrays]
    extra = [n for n in arrays if n not in names]
    if missing:
        problems.append(f"missing gradients for {missing}")
    if extra:
        problems.append(f"gradients for unknown variables {extra}")
    pairs = []
    for n, v in zip(names, variables):
        if n not in arrays:
            continue
        a = np.asarray(arrays[n])
        if tuple(a.shape) != tuple(v.shape):
            problems.append(f"{n!r}: gradient shape {tuple(a.shape)} != variable shape {tuple(v.shape)}")
        elif a.dtype != np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype):
            problems.append(f"{n!r}: gradient dtype {a.dtype} != variable dtype {tf.as_dtype(v.dtype).name}")
        else:
            pairs.append((tf.convert_to_tensor(a), v))
    if problems:
        raise ValueError("Cannot import gradients: " + "; ".join(problems) + ".")
    return pairs


def _name(v) -> str:
    return getattr(v, "path", None) or v.name
