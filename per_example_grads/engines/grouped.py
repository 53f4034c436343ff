"""Grouped capabilities of the engines: per-unit gradients, norms and clipped sums.

A *unit* (a privacy unit: a user, an author, any group of rows; not a
layer the layer-wise engine watches, a ``capture.Watch``) is given by ``ids`` ``[B]``,
the unit of each row, in ``[0, U)``. Unit ``u``'s gradient is the sum of its
rows' (weighted) per-example gradients, ``G_u = sum_{n: ids[n] = u} g_n``;
its norm ``||G_u||``; and the clipped sum ``sum_u c_u G_u`` with
``c_u = C / max(||G_u||, C)`` per clipping group. Outputs are indexed by unit
id: ``[U, *var.shape]`` gradients, ``[U]`` norms; a unit with no rows has a
zero gradient and norm 0 (factor 1, contributing nothing). Padding rows of
weight 0 contribute nothing to their unit. Units of one row each
(``ids = range(B)``) are the example-level quantities.

Every engine gets them by segment-summing its materialized per-example
gradients (``B x P`` memory, then ``U x P``). An engine may give its own
(``Engine.native_unit_squared_norms``, ``Engine.native_unit_clipped_sums``);
the layer-wise engine does (``layerwise_unit_squared_norms``,
``layerwise_unit_clipped_sums``): per-unit squared norms per layer from the
rules' grouped forms (``rules.grouped``; the exact per-layer fallback for the
rest), and the clipped sum as the rules' own ``weighted_sum`` with each row
weighted by its unit's factor, ``sum_u c_u G_u = sum_n c_{ids[n]} g_n``: one
forward and one backward pass, never ``[B, P]`` for the closed forms.

Callers go through ``selection.run`` with these functions, as for the
example-level capabilities:

    selection.run(method, problem, lambda e: grouped.unit_clipped_sums(e, problem, batch, clip, units), batch)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf

from per_example_grads import transforms
from per_example_grads._core.batch import Batch
from per_example_grads._core.example_ops import WIDE
from per_example_grads._core.problem import Problem
from per_example_grads._core.xla_context import in_xla_context
from per_example_grads.engines import layerwise
from per_example_grads.engines.base import ENGINES, ClipGroups, Engine
from per_example_grads.per_example_slices import PerExampleSlices
from per_example_grads.rules import grouped as grouped_rules
from per_example_grads.rules import grouped_conv  # noqa: F401  (registers the convolutions' grouped forms)


@dataclasses.dataclass(frozen=True)
class Units:
    """The unit of each row of a batch.

    Attributes:
      ids: ``[B]`` int32, each in ``[0, count)``.
      count: ``U``, the number of units: a Python int, or a scalar int32
        tensor when inferred inside a graph.
    """

    ids: tf.Tensor
    count: Any


def checked_unit_ids(unit_ids: Any, x: Any) -> tf.Tensor:
    """``unit_ids`` as a ``[B]`` integer tensor, checked against the ``B`` rows of ``x``: every front door's check.

    Refused: ragged or sparse ids, or ids that are not integers (before any
    cast, which would merge ``1.2`` and ``1.7``), with ``TypeError``; ids
    whose shape is not ``[B]``, with ``ValueError`` where both sizes are
    known when traced, and else, inside a graph, when run
    (``tf.errors.InvalidArgumentError``). The values are each caller's to
    check: ``make_units`` wants ``[0, num_units)``, a DP batch also has
    padding rows of id ``-1``.
    """
    if isinstance(unit_ids, (tf.RaggedTensor, tf.SparseTensor)):
        raise TypeError("unit_ids must be one dense [B] integer tensor or array.")
    ids = tf.convert_to_tensor(np.asarray(unit_ids) if isinstance(unit_ids, (list, tuple)) else unit_ids)
    if not ids.dtype.is_integer:
        raise TypeError(f"unit_ids must be integers, shape [B]; got dtype {ids.dtype.name}.")
    first = tf.nest.flatten(x)[0]
    static = first.shape[0]
    if ids.shape.rank != 1 or (static is not None and ids.shape[0] is not None and ids.shape[0] != static):
        raise ValueError(f"unit_ids must have shape [B] with B = {static}, the rows of x; got shape {ids.shape}.")
    if static is None or ids.shape[0] is None:  # known only when run
        check = tf.debugging.assert_equal(
            tf.size(ids), tf.shape(first)[0], message="unit_ids must have shape [B], one unit id per row of x"
        )
        with tf.control_dependencies([check]):
            ids = tf.identity(ids)
    return ids


def units_or_none(unit_ids: Any, num_units: int | None, batch: Batch) -> "Units | None":
    """``make_units`` for given ``unit_ids``; None without them.

    Raises:
      ValueError: ``num_units`` without ``unit_ids`` (it would be ignored).
    """
    if unit_ids is None:
        if num_units is not None:
            raise ValueError("num_units needs unit_ids.")
        return None
    return make_units(unit_ids, num_units, batch)


def make_units(unit_ids: Any, num_units: int | None, batch: Batch) -> Units:
    """Checks ``unit_ids`` against the batch and returns ``Units``.

    Args:
      unit_ids: ``[B]`` integers (array or tensor), each in ``[0, num_units)``.
      num_units: ``U``; None infers ``max(unit_ids) + 1`` (0 for an empty batch).
      batch: the checked batch (``_core.batch.make_batch``).

    Raises:
      TypeError: ``unit_ids`` is not integers, or ``num_units`` not an int.
      ValueError: ``unit_ids`` is not ``[B]`` (``checked_unit_ids``), ``num_units`` is negative or
        None under XLA (``jit_compile``, which needs static shapes), or
        (eagerly; inside a graph, when run: ``tf.errors.InvalidArgumentError``)
        an id is outside ``[0, num_units)``.
    """
    if num_units is not None and (isinstance(num_units, bool) or not isinstance(num_units, (int, np.integer))):
        raise TypeError(f"num_units must be an int or None; got {type(num_units).__name__}.")
    if num_units is not None and num_units < 0:
        raise ValueError(f"num_units must be >= 0; got {num_units}.")
    ids = tf.cast(checked_unit_ids(unit_ids, batch["x"]), tf.int32)
    if tf.executing_eagerly():
        values = ids.numpy()
        if values.size and values.min() < 0:
            raise ValueError(f"unit_ids must be >= 0; got {int(values.min())}.")
        count = int(values.max()) + 1 if num_units is None and values.size else (num_units or 0)
        if values.size and values.max() >= count:
            raise ValueError(f"unit_ids must be < num_units = {count}; got {int(values.max())}.")
        return Units(ids, count)
    if num_units is None and in_xla_context():
        raise ValueError(
            "num_units must be given under XLA (jit_compile): it is the static size of the per-unit outputs "
            "(inferring it from unit_ids would give a shape known only at run time)."
        )
    largest = tf.reduce_max(tf.concat([ids, [-1]], 0))
    count = largest + 1 if num_units is None else int(num_units)
    checks = [
        tf.debugging.assert_non_negative(ids, message="unit_ids must be >= 0"),
        tf.debugging.assert_less(
            largest, tf.cast(count, tf.int32), message=f"unit_ids must be < num_units = {num_units}"
        ),
    ]
    with tf.control_dependencies(checks):
        ids = tf.identity(ids)
    return Units(ids, count)


def segment(t, units: Units) -> tf.Tensor:
    """``[U, ...]``: ``sum_{n: ids[n] = u} t[n]`` of per-example ``t`` ``[B, ...]`` (a ``PerExampleSlices`` made dense)."""
    if isinstance(t, PerExampleSlices):
        t = tf.convert_to_tensor(t)
    return tf.math.unsorted_segment_sum(t, units.ids, units.count)


def unit_gradients(engine: Engine, problem: Problem, batch: Batch, units: Units) -> list:
    """Per-unit gradients ``[U, *var.shape]`` aligned with ``problem.variables``, from the engine's per-example ones."""
    return [segment(g, units) for g in engine.compute(problem, batch)]


def unit_squared_norms(engine: Engine, problem: Problem, batch: Batch, units: Units) -> list:
    """``[U]`` squared norms of each unit's gradient, per variable: the engine's own, else from ``unit_gradients``."""
    if engine.native_unit_squared_norms is not None:
        return engine.native_unit_squared_norms(problem, batch, units)
    return [tf.square(n) for n in transforms.per_variable_norms(unit_gradients(engine, problem, batch, units))]


def unit_norms(engine: Engine, problem: Problem, batch: Batch, units: Units, by_variable: bool = False):
    """``[U]`` norms of each unit's whole gradient, or with ``by_variable`` a ``[U]`` per variable."""
    if engine.native_unit_squared_norms is None:
        per_unit = unit_gradients(engine, problem, batch, units)
        return transforms.per_variable_norms(per_unit) if by_variable else transforms.global_norms(per_unit)
    squared, dtype = engine.native_unit_squared_norms(problem, batch, units), layerwise.norm_dtype(problem)
    return [layerwise.norms_of([s], dtype) for s in squared] if by_variable else layerwise.norms_of(squared, dtype)


def unit_clipped_sums(
    engine: Engine, problem: Problem, batch: Batch, clip: ClipGroups, units: Units
) -> tuple[list, list, Any]:
    """``(sums per variable, [U] norms per group, predictions or None)``: ``sums[k] = sum_u c_ug G_u[k]``.

    ``c_ug = C_g / max(n_ug, C_g)`` with ``n_ug`` unit ``u``'s norm over the
    variables of clipping group ``g`` (0 for a non-finite norm,
    ``transforms.clip_factors``). Each unit's contribution has norm at most
    ``C_g`` per group, whatever its number of rows.
    """
    if engine.native_unit_clipped_sums is not None:
        return engine.native_unit_clipped_sums(problem, batch, clip, units)
    sums, norms = clip.clip_and_sum(unit_gradients(engine, problem, batch, units))
    return sums, norms, None


# -- the layer-wise engine's own ------------------------------------------------


def _squared_norms(problem: Problem, captured, units: Units, keep: bool = False) -> tuple[list, dict]:
    """``([U] float64 squared norms aligned with problem.variables, kept)`` from one capture (zeros if unreached).

    ``kept`` maps ``id(variable)`` to its per-unit gradients ``[U, *shape]``
    where a layer's grouped form kept them for the clipped sum (``keep``:
    one follows; ``rules.grouped.UnitParts``).

    Layers are processed last first, as in ``layerwise.per_variable_squared_norms``;
    a layer whose grouped norms build its per-example gradients (the
    fallback) waits for the previous such layer, so at most one of those
    tensors exists at a time, and every layer for the one ``CHAIN_WINDOW``
    places before it.
    """
    found: dict[int, tf.Tensor] = {}
    kept: dict[int, tf.Tensor] = {}
    done: list = []
    materialized: list = []
    for watch, calls in reversed(list(captured.by_watch().items())):
        if not calls:
            continue
        materializes = not grouped_rules.has_grouped_form(watch.rule)
        waits_for = done[-layerwise.CHAIN_WINDOW] if len(done) >= layerwise.CHAIN_WINDOW else []
        with tf.control_dependencies(list(waits_for) + (materialized if materializes else [])):
            parts = grouped_rules.grouped_parts(
                watch.rule, watch.layer, [(record.saved, g) for record, g in calls], units.ids, units.count, keep
            )
        norms = parts.norms
        done.append(norms)
        if materializes:
            materialized = list(norms)
        for k, (v, n) in enumerate(zip(watch.variables, norms)):
            found[id(v)] = n
            if parts.kept is not None:
                kept[id(v)] = parts.kept[k]
    zeros = lambda: tf.zeros(tf.reshape(units.count, [1]), WIDE)  # noqa: E731
    return [found[id(v)] if id(v) in found else zeros() for v in problem.variables], kept


def layerwise_unit_squared_norms(problem: Problem, batch: Batch, units: Units) -> list:
    """``[U]`` float64 squared norms per variable, from one forward and one backward pass (module docstring)."""
    return _squared_norms(problem, layerwise.capture(problem, batch), units)[0]


def layerwise_unit_clipped_sums(
    problem: Problem, batch: Batch, clip: ClipGroups, units: Units
) -> tuple[list, list, Any]:
    """``unit_clipped_sums`` in one forward and one backward pass: each row weighted by its unit's factor.

    A layer whose grouped form kept its per-unit gradients ``G_u`` adds
    ``sum_u c_u G_u`` (one matrix-vector product); every other layer's
    rule computes ``sum_n c_{ids[n]} g_n`` (``weighted_sum``).
    """
    captured = layerwise.capture(problem, batch)
    (squared, kept), dtype = _squared_norms(problem, captured, units, keep=True), layerwise.norm_dtype(problem)
    norms = [layerwise.norms_of([squared[i] for i in idx], dtype) for idx in clip.groups]
    factors = [transforms.clip_factors(n, c) for n, c in zip(norms, clip.clips)]
    row_weights = [tf.gather(f, units.ids) for f in factors]
    group_of = {id(problem.variables[i]): g for g, idx in enumerate(clip.groups) for i in idx}
    sums = _weighted_sums(problem, captured, lambda v: row_weights[group_of[id(v)]], kept)
    for k, v in enumerate(problem.variables):
        if id(v) in kept:
            sums[k] = grouped_rules.unit_weighted_sum(factors[group_of[id(v)]], kept[id(v)], v.dtype)
    return sums, norms, captured.predictions


def _weighted_sums(problem: Problem, captured, weights_for, kept: dict) -> list:
    """``layerwise.weighted_sums`` over the layers none of whose variables were kept (``None`` for the kept ones)."""
    requested = {id(v) for v in problem.variables}
    sums: dict[int, Any] = {}
    for watch, calls in captured.by_watch().items():
        wanted = [v for v in watch.variables if id(v) in requested and id(v) not in kept]
        distinct = {id(weights_for(v)): weights_for(v) for v in wanted}
        for w in distinct.values():
            for record, g in calls:
                outputs = watch.rule.weighted_sum(watch.layer, record.saved, g, w, record.cache)
                for v, s in zip(watch.variables, outputs):
                    if id(v) in requested and id(v) not in kept and weights_for(v) is w:
                        sums[id(v)] = s if id(v) not in sums else layerwise.add_sums(sums[id(v)], s)
    return [
        sums[id(v)] if id(v) in sums else (None if id(v) in kept else tf.zeros(v.shape, v.dtype))
        for v in problem.variables
    ]


# The layer-wise engine's per-unit forms: registered here, where they are defined (that engine's module cannot
# import this one, which builds on it).
ENGINES["layerwise"] = dataclasses.replace(
    ENGINES["layerwise"],
    native_unit_squared_norms=layerwise_unit_squared_norms,
    native_unit_clipped_sums=layerwise_unit_clipped_sums,
)
