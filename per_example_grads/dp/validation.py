"""Checking a model before private training: what breaks privacy, what is slow.

``check_model`` lists, in one message, every layer that breaks per-example
privacy (BatchNormalization in training mode mixes examples: replace it with
GroupNormalization or LayerNormalization), and warns once about layers that
fall back to slower paths (the layer-local VJP, or no layer-wise coverage at
all, which materializes ``B x P`` per-example gradients).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import keras

from per_example_grads._core import model_inspection
from per_example_grads.engines.capture import NotCoverable, plan_units
from per_example_grads.rules.local import LocalRule


@dataclasses.dataclass
class ValidationReport:
    """``errors``: layers that break per-example privacy; ``slow``: layers on slow paths."""

    errors: list[str]
    slow: list[str]

    def __str__(self) -> str:
        lines = []
        if self.errors:
            lines.append("Layers that break per-example differential privacy:")
            lines += [f"  - {e}" for e in self.errors]
        if self.slow:
            lines.append("Layers on slower paths (exact, but slower than the closed forms):")
            lines += [f"  - {s}" for s in self.slow]
        return "\n".join(lines) or "All layers are supported by closed forms."


def validate(model: Any, *, training: bool = True) -> ValidationReport:
    """Inspects ``model`` for private training; see the module docstring.

    Raises:
      TypeError: ``model`` is not a Keras layer or model.
    """
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"model must be a Keras model or layer; got {type(model).__name__} {model!r:.80}.")
    coupling = model_inspection.batch_coupling_layers(model, training)
    errors = [
        f"'{l.name}' (BatchNormalization) normalizes with batch statistics in training: "
        "peg.dp.fix_model(model) replaces it with keras.layers.GroupNormalization, and "
        "peg.dp.fix_model(model, batch_norm='freeze') freezes it (inference mode, for fine-tuning)"
        for l in coupling
    ]
    slow = []
    try:
        units = plan_units(model, model.trainable_variables)
    except NotCoverable as err:
        slow.append(
            f"the layer-wise engine cannot cover the model ({err}); per-example gradients "
            "are materialized by a generic engine (B x P memory)"
        )
    else:
        for u in units:  # one unit per layer, however often it is called
            if isinstance(u.rule, LocalRule) and u.layer not in coupling:
                slow.append(
                    f"'{u.layer.name}' ({type(u.layer).__name__}) has no closed form: exact "
                    "layer-local fallback; register a rule with peg.register_layer_rule to speed it up"
                )
    return ValidationReport(errors, slow)


def check_model(model: Any, *, training: bool = True) -> ValidationReport:
    """Raises ``ValueError`` listing every privacy-breaking layer; warns about slow ones."""
    report = validate(model, training=training)
    if report.errors:
        raise ValueError(str(report))
    if report.slow:
        warnings.warn(str(report), UserWarning, stacklevel=2)
    return report
