"""The compute/apply split: gradients computed in one place, applied in another.

``compute_gradients`` returns ``(gradient, variable)`` pairs from one pass;
applying them later is ``optimizer.apply_gradients(pairs)``. To carry them
across a process boundary (a parameter-server-style worker, a file, a queue),
``export_gradients`` turns them into ``{variable.path: numpy array}`` and
``import_gradients`` checks such a dict against a model's variables by name,
shape and dtype before pairing them up again. Real multi-machine training
should go through ``tf.distribute``; this is for the simple cases.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import tensorflow as tf

from per_example_grads import transforms
from per_example_grads.clipping import clipped_gradients
from per_example_grads.gradients import per_example_gradients
from per_example_grads._core.problem import resolve_variables

MODES = ("mean", "sum", "per_example", "clipped_sum")


def compute_gradients(
    model: Any,
    loss_fn: Any,
    x: Any,
    y: Any = None,
    *,
    mode: str = "mean",
    l2_norm_clip: Any = None,
    sample_weight: Any = None,
    variables: Sequence | None = None,
    method: str = "auto",
    training: bool = False,
) -> list[tuple[tf.Tensor, Any]]:
    """``(gradient, variable)`` pairs for every variable, from one pass.

    Args:
      mode: ``"mean"`` (gradient of the mean loss, ``[*var.shape]``),
        ``"sum"`` (of the summed loss), ``"per_example"`` (``[B, *var.shape]``)
        or ``"clipped_sum"`` (needs ``l2_norm_clip``; see ``clipped_gradients``).
      Others: as in ``per_example_gradients``.

    Returns:
      list of ``(gradient, variable)``; for the reduced modes,
      ``optimizer.apply_gradients(pairs)`` applies them.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}; got {mode!r}.")
    variables = list(resolve_variables(model, variables))
    common = dict(sample_weight=sample_weight, variables=variables, method=method, training=training)
    if mode == "clipped_sum":
        if l2_norm_clip is None:
            raise ValueError("mode='clipped_sum' needs l2_norm_clip.")
        grads = clipped_gradients(model, loss_fn, x, y, l2_norm_clip=l2_norm_clip, **common)
    else:
        grads = per_example_gradients(model, loss_fn, x, y, **common)
        if mode == "sum":
            grads = transforms.sum_examples(grads)
        elif mode == "mean":
            grads = transforms.mean_examples(grads)
    return list(zip(grads, variables))


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
