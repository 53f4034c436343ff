"""Finding the layers to watch, and watching them during one forward pass.

Keras 3 has no forward hooks, so capturing replaces a layer's ``call`` on the
*instance* for the duration of one forward pass (``Layer.__call__`` looks
``self.call`` up on the instance, whatever the model type: Sequential,
Functional, subclassed, or a layer called inside another layer's ``call``) and
restores it afterwards. That lookup is the one Keras behaviour this module
relies on; ``tests/test_layerwise_capture.py`` fails loudly if it changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import keras
import tensorflow as tf

from per_example_grads._core import model_inspection
from per_example_grads.rules.local import LOCAL_RULE  # the fallback rule
from per_example_grads.rules.rule import LayerRule, rule_for

# Layers that call their sublayers inside a loop or on a reshaped batch: they
# are treated as one unit (layer-local fallback) instead of being descended.
OPAQUE_LAYERS: tuple[type, ...] = (
    keras.layers.RNN,
    keras.layers.Bidirectional,
    keras.layers.TimeDistributed,
)


class NotCoverable(ValueError):
    """The layer-wise engine cannot account for every requested variable."""


@dataclasses.dataclass(frozen=True, eq=False)
class Unit:
    """A layer the engine watches, with the rule that explains its gradients."""

    layer: keras.layers.Layer
    rule: LayerRule

    @property
    def variables(self) -> list:
        return self.rule.variables(self.layer)


@dataclasses.dataclass
class Record:
    """One call of a unit: what the rule saved, where it tapped the output, and its per-call cache.

    ``cache`` is what the rule's ``squared_norms`` leaves for its
    ``weighted_sum`` on this call (``LayerRule.squared_norms``).
    """

    unit: Unit
    saved: Any
    taps: list
    cache: dict = dataclasses.field(default_factory=dict)


def plan_units(model: Any, variables) -> list[Unit]:
    """The units whose rules together cover ``variables``.

    Descends from ``model`` through layers without own variables; a layer with
    a registered rule becomes a unit, and so does (through the layer-local
    fallback rule) any other layer that owns variables or is opaque. Units
    with none of ``variables`` are left out.

    Raises:
      NotCoverable: if ``model`` is not a Keras layer, owns variables itself, or
        some requested variable belongs to no unit.
    """
    if not isinstance(model, keras.layers.Layer):
        raise NotCoverable("the model is not a Keras layer or model")
    if model_inspection.own_variables(model) and rule_for(model) is None:
        raise NotCoverable(
            f"'{model.name}' owns variables itself (add_weight on the model), outside any layer"
        )
    units: list[Unit] = []
    seen: set[int] = set()

    def visit(layer):
        # A layer tracked by two parents (KerasHub's CausalLM and its backbone
        # both hold the token embedding) is one unit: two would record each
        # call twice, and the clipped sum would count it twice.
        if id(layer) in seen:
            return
        seen.add(id(layer))
        rule = rule_for(layer)
        if rule is not None and rule.unsupported(layer) is None:
            units.append(Unit(layer, rule))
        elif isinstance(layer, OPAQUE_LAYERS) or model_inspection.own_variables(layer) or rule is not None:
            if layer is not model:
                # A registered rule that declines this instance (grouped conv,
                # LoRA...) also falls back to the exact layer-local VJP.
                units.append(Unit(layer, LOCAL_RULE))
        else:
            for sub in model_inspection.direct_sublayers(layer):
                if sub.weights:
                    visit(sub)

    visit(model)
    covered = {id(v) for u in units for v in u.variables}
    missing = [v for v in variables if id(v) not in covered]
    if missing:
        raise NotCoverable(
            f"{len(missing)} requested variable(s) belong to no watched layer "
            f"(first: {getattr(missing[0], 'path', missing[0].name)})"
        )
    # A unit none of whose variables is requested (a frozen table next to LoRA
    # layers) needs no watching: its rule's work would be thrown away.
    requested = {id(v) for v in variables}
    return [u for u in units if any(id(v) in requested for v in u.variables)]


@contextlib.contextmanager
def capturing(units: list[Unit]) -> Iterator[list[Record]]:
    """Within the block, every call of a unit's layer appends a ``Record``."""
    records: list[Record] = []
    saved_calls = []
    for unit in units:
        layer = unit.layer
        had_instance_call = "call" in vars(layer)
        original = layer.call
        saved_calls.append((layer, had_instance_call, vars(layer).get("call")))
        object.__setattr__(layer, "call", _watched_call(unit, original, records))
    try:
        yield records
    finally:
        for layer, had, previous in reversed(saved_calls):
            if had:
                object.__setattr__(layer, "call", previous)
            else:
                object.__delattr__(layer, "call")


def _watched_call(unit: Unit, original, records: list[Record]):
    def call(*args, **kwargs):
        outputs, saved, taps = unit.rule.forward(unit.layer, original, args, kwargs)
        records.append(Record(unit, saved, list(taps)))
        return outputs

    return call


def check_batch_axis(records: list[Record], batch_size) -> None:
    """Checks each tap's leading axis is the batch; a layer fed something else cannot be split per example.

    Decided while tracing when shapes allow (``NotCoverable``, so ``auto``
    moves to another engine): a static leading size that differs from a static
    ``B``, or any static leading size when ``B`` is dynamic (a constant, such as
    positions ``arange(T)[None]``, is not the batch). Otherwise asserted at run
    time.
    """
    static_b = batch_size if isinstance(batch_size, int) else None
    for r in records:
        for t in r.taps:
            lead = t.shape[0] if t.shape.rank else None
            if lead is not None and (static_b is None or lead != static_b):
                raise NotCoverable(
                    f"layer '{r.unit.layer.name}' was called on a tensor whose leading axis "
                    f"({lead}) is not the batch"
                )
            tf.debugging.assert_equal(
                tf.shape(t)[0],
                tf.cast(batch_size, tf.int32),
                message=(
                    f"layer '{r.unit.layer.name}' was called on a tensor whose leading "
                    "axis is not the batch; the layer-wise engine cannot use it"
                ),
            )
