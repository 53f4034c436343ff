"""Checking and packing the ``(x, y, sample_weight)`` a user passes in.

A *batch* here is a dict ``{"x": ..., "y": ..., "sample_weight": ...}``
(absent entries left out) whose leaves are tensors sharing one leading axis
``B``. Engines map over that axis, so every leaf must have it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from per_example_grads import model_inspection

Batch = dict


def make_batch(model: Any, x: Any, y: Any = None, sample_weight: Any = None) -> Batch:
    """Converts and validates the inputs; returns a ``Batch``.

    Args:
      model: the model, used to check declared input dtypes.
      x: a tensor, array or nested structure of them, each ``[B, ...]``.
      y: ``None`` or the same kind of structure, each ``[B, ...]``.
      sample_weight: ``None`` or ``[B]`` real numbers.

    Raises:
      TypeError: for non-numeric inputs, or non-float ``x`` where the model
        declares a float input.
      ValueError: for leaves without a batch axis, mismatched leading
        dimensions, or a ``sample_weight`` that is not ``[B]``.
    """
    batch = {"x": _to_tensors("x", x)}
    if y is not None:
        batch["y"] = _to_tensors("y", y)
    if sample_weight is not None:
        sw = _to_tensors("sample_weight", sample_weight)
        if not isinstance(sw, tf.Tensor):
            raise TypeError("sample_weight must be one [B] tensor or array, not a structure.")
        if sw.dtype.is_complex or sw.dtype == tf.string:
            raise TypeError(f"sample_weight must be real numbers, shape [B]; got dtype {sw.dtype.name}.")
        if sw.shape.rank != 1:
            raise ValueError(f"sample_weight must have shape [B]; got shape {sw.shape}.")
        batch["sample_weight"] = tf.cast(sw, tf.float32) if not sw.dtype.is_floating else sw
    _check_float_inputs(model, batch["x"])
    _check_leading_dims(batch)
    return batch


def batch_size(batch: Batch) -> tf.Tensor | int:
    """``B``: a Python int when static, else a scalar int32 tensor."""
    first = tf.nest.flatten(batch["x"])[0]
    static = first.shape[0]
    return static if static is not None else tf.shape(first)[0]


def add_batch_axis(example: Batch) -> Batch:
    """``[...]`` leaves of one example -> ``[1, ...]``."""
    return tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), example)


def _to_tensors(name: str, value: Any):
    leaves = tf.nest.flatten(value)
    converted = [
        _to_tensor(name if len(leaves) == 1 else f"{name}[{i}]", leaf)
        for i, leaf in enumerate(leaves)
    ]
    return tf.nest.pack_sequence_as(value, converted)


def _to_tensor(label: str, leaf: Any) -> tf.Tensor:
    if leaf is None:
        raise TypeError(f"{label} is None; expected a tensor or array of shape [B, ...].")
    if isinstance(leaf, (tf.Tensor, tf.Variable)):
        t = tf.convert_to_tensor(leaf)
    else:
        arr = np.asarray(leaf)
        if arr.dtype == object or arr.dtype.kind in "USV":
            raise TypeError(
                f"{label} must be numeric, shape [B, ...]; got an array of dtype {arr.dtype}."
            )
        t = tf.convert_to_tensor(arr)
    if t.dtype == tf.string or t.dtype.is_complex:
        raise TypeError(f"{label} must be real numbers, shape [B, ...]; got dtype {t.dtype.name}.")
    if t.shape.rank == 0:
        raise ValueError(f"{label} must have a leading batch axis, shape [B, ...]; got a scalar.")
    return t


def _check_float_inputs(model: Any, x) -> None:
    declared = model_inspection.declared_input_dtypes(model)
    leaves = tf.nest.flatten(x)
    if declared is None or len(declared) != len(leaves):
        return
    for i, (want, leaf) in enumerate(zip(declared, leaves)):
        if tf.as_dtype(want).is_floating and not leaf.dtype.is_floating:
            where = "x" if len(leaves) == 1 else f"x (input {i})"
            raise TypeError(
                f"{where} has dtype {leaf.dtype.name}, but the model declares a "
                f"{want} input there; pass floats (e.g. x.astype('{want}'))."
            )


def _check_leading_dims(batch: Batch) -> None:
    named = []
    for name in ("x", "y", "sample_weight"):
        if name in batch:
            leaves = tf.nest.flatten(batch[name])
            for i, leaf in enumerate(leaves):
                named.append((name if len(leaves) == 1 else f"{name}[{i}]", leaf))
    ref_name, ref = named[0]
    for name, leaf in named[1:]:
        a, b = ref.shape[0], leaf.shape[0]
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"All inputs must share the leading batch dimension B: {ref_name} "
                f"has B={a} but {name} has B={b}."
            )
        if a is None or b is None:
            tf.debugging.assert_equal(
                tf.shape(ref)[0],
                tf.shape(leaf)[0],
                message=f"{ref_name} and {name} must share the leading batch dimension B",
            )
