"""Checking a model before private training: what breaks privacy, what is slow.

``check_model`` lists, in one message, every layer that breaks per-example
privacy (BatchNormalization in training mode mixes examples: replace it with
GroupNormalization or LayerNormalization), and warns once about layers that
fall back to slower paths (the layer-local VJP, or no layer-wise coverage at
all, which materializes ``B x P`` per-example gradients).

Every layer the layer-wise engine runs through the layer-local fallback (one
VJP of that layer per example, exact but slower than a closed form) is
named with its class and why it has no closed form (``Fallback``): no rule is
registered for its class or a base class; its class overrides ``call`` of a
registered base class (a rule is written for its class's own ``call``); or
the registered rule declines this instance (LoRA or quantized kernels,
channels_first convolutions, ...), with the rule's reason. A layer the
engine finds only while tracing (one called on a tensor whose leading axis
is not the batch, which falls back at an enclosing layer) is not known
before the model runs and is not listed.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import keras

from per_example_grads._core import model_inspection
from per_example_grads._core.problem import Problem
from per_example_grads.engines import ENGINES
from per_example_grads.rules.rule import RULES, rule_for


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A layer on the layer-local fallback: its ``name``, its class's ``class_name``, and ``why`` it has no closed form."""

    name: str
    class_name: str
    why: str

    def __str__(self) -> str:
        return (
            f"'{self.name}' ({self.class_name}): exact layer-local fallback (one VJP of this layer per example), "
            f"slower than a closed form: {self.why}"
        )


@dataclasses.dataclass
class ValidationReport:
    """``errors``: layers that break per-example privacy; ``slow``: what is on slow paths, as text.

    ``fallback``: the layers among ``slow`` that take the layer-local
    fallback, one ``Fallback`` each (module docstring).
    """

    errors: list[str]
    slow: list[str]
    fallback: list[Fallback] = dataclasses.field(default_factory=list)

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
    fallback = []
    engine = ENGINES["layerwise"]
    problem = Problem(  # what the engine plans over
        model, None, None, tuple(model.trainable_variables), training, batch_coupling=bool(coupling)
    )
    reason = engine.why_not(problem)
    if reason:
        slow.append(
            f"the layer-wise engine cannot cover the model ({reason}); per-example gradients "
            "are materialized by a generic engine (B x P memory)"
        )
    else:
        for layer in engine.slow_layers(problem):  # one entry per layer, however often it is called
            if layer not in coupling:
                fallback.append(Fallback(layer.name, type(layer).__name__, why_fallback(layer)))
        slow += [str(f) for f in fallback]
    return ValidationReport(errors, slow, fallback)


def why_fallback(layer: keras.layers.Layer) -> str:
    """Why ``layer`` has no closed form (module docstring), as one clause naming the class or the rule's reason."""
    cls = type(layer)
    full = f"{cls.__module__}.{cls.__qualname__}"
    registered = next((c for c in cls.__mro__ if c in RULES or f"{c.__module__}.{c.__qualname__}" in RULES), None)
    if registered is None:
        return f"no rule is registered for {full} (peg.register_layer_rule teaches the engine one)"
    rule = rule_for(layer)
    if rule is None:
        overriding = next(c for c in cls.__mro__ if "call" in vars(c))
        return (
            f"{overriding.__qualname__} overrides call of {registered.__qualname__}, whose rule is written for "
            f"that class's own call (register a rule for {full})"
        )
    reason = rule.unsupported(layer)
    if reason:
        return f"the rule for {registered.__qualname__} declines it: {reason}"
    return f"the rule for {registered.__qualname__} hands it to the layer-local rule"


def check_model(model: Any, *, training: bool = True) -> ValidationReport:
    """Raises ``ValueError`` listing every privacy-breaking layer; warns once, listing every slow one.

    The warning names each layer on the layer-local fallback, its class and
    why it has no closed form (module docstring); the returned report holds
    them as ``report.fallback``.

    Raises:
      ValueError: some layer breaks per-example privacy (the message lists them all).
      TypeError: ``model`` is not a Keras layer or model.
    """
    report = validate(model, training=training)
    if report.errors:
        raise ValueError(str(report))
    if report.slow:
        warnings.warn(str(report), UserWarning, stacklevel=2)
    return report
