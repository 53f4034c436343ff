"""The compute/apply split: ``(gradient, variable)`` pairs from one pass, applied later or elsewhere.

``compute_gradients`` returns the pairs; applying them later is
``optimizer.apply_gradients(pairs)``; ``transfer.export_gradients`` carries
them across a process boundary.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from per_example_grads import transforms
from per_example_grads._core.problem import resolve_variables
from per_example_grads.clipping import clipped_gradients
from per_example_grads.gradients import per_example_gradients

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
      l2_norm_clip: the clip norm of ``mode="clipped_sum"``; refused with
        any other mode (``ValueError``), which would not clip.
      Others: as in ``per_example_gradients``.

    Returns:
      list of ``(gradient, variable)``; for the reduced modes,
      ``optimizer.apply_gradients(pairs)`` applies them.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}; got {mode!r}.")
    if l2_norm_clip is not None and mode != "clipped_sum":
        raise ValueError(
            f"l2_norm_clip is used only with mode='clipped_sum'; mode={mode!r} would return unclipped "
            "gradients. Pass mode='clipped_sum', or leave l2_norm_clip out."
        )
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
