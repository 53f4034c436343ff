"""``clipped_gradients``: the sum (or mean) of per-example clipped gradients.

This is the core of DP-SGD. With per-example gradients ``g_i`` and clip norm
``C``, it returns ``sum_i c_i g_i`` where ``c_i = C / max(||g_i||, C)``, so each
example contributes a vector of norm at most ``C``.

With the layer-wise engine it takes one forward and one backward pass: the
norms come from closed forms per layer and the weighted sum from one
contraction per layer, without building ``B x P``. Other engines materialize
the per-example gradients, clip and sum them.

The entry points are marked ``do_not_convert``: called inside a user's
``tf.function``, AutoGraph would otherwise re-parse the library's source
below them at every trace, although none of it branches on tensors in
Python (the model and the loss already run unconverted, inside the engine's
own ``tf.function(autograph=False)``).
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

import tensorflow as tf

from per_example_grads import transforms
from per_example_grads._core.arguments import check_clip
from per_example_grads._core.batch import batch_size, branch_zeros, make_batch, unless_empty
from per_example_grads._core.problem import make_problem
from per_example_grads.engines import grouped, selection
from per_example_grads.engines.base import ClipGroups, FiniteSums, finite_examples

ClipNorm = float | Mapping[str, float] | Sequence[float]


@tf.autograph.experimental.do_not_convert
def clipped_gradients(
    model: Any,
    loss_fn: Any,
    x: Any,
    y: Any = None,
    *,
    l2_norm_clip: ClipNorm,
    sample_weight: Any = None,
    reduction: str = "sum",
    return_norms: bool = False,
    method: str = "auto",
    variables: Sequence | None = None,
    training: bool = False,
    allow_batch_coupling: bool = False,
    unit_ids: Any = None,
    num_units: int | None = None,
):
    """Sum (or mean) over examples of each example's gradient, clipped.

    Flat clipping (``l2_norm_clip`` a number ``C``):
    ``result[k] = sum_i c_i grads[k][i]`` with ``c_i = C / max(n_i, C)`` and
    ``n_i = sqrt(sum_k ||grads[k][i]||^2)``.

    Per-layer clipping (``l2_norm_clip`` a dict ``{layer_name: C_l}``): each
    layer's part of an example's gradient is clipped to its own ``C_l``, with
    ``n_il`` the norm over that layer's variables. A variable belongs to the
    innermost named layer on its ``path``; every variable needs a key. A list
    gives one clip norm per variable, aligned with ``variables``.

    Args:
      model, loss_fn, x, y, sample_weight, variables, training,
        allow_batch_coupling: as in ``per_example_gradients``.
      l2_norm_clip: ``C > 0``, a dict of them by layer name, or a list of them
        aligned with the variables.
      reduction: ``"sum"`` or ``"mean"`` (the sum divided by ``B``; zeros for
        ``B = 0``).
      return_norms: also return the norms before clipping: ``[B]`` for flat
        clipping, else a dict ``{group: [B]}``.
      method: ``"auto"`` (layer-wise when it covers the model, else the
        generic engines) or any ``per_example_gradients`` method.
      unit_ids: None, or ``[B]`` integers in ``[0, num_units)``, the unit (a
        user, any group of rows) of each row: then each *unit's* summed
        gradient ``G_u = sum_{i in u} grads[i]`` is clipped instead,
        ``result[k] = sum_u c_u G_u[k]`` with ``c_u = C / max(||G_u||, C)``
        (per clipping group as above), so each unit contributes at most
        ``C`` whatever its number of rows. The norms are ``[U]``, indexed by
        unit id (0 for a unit with no rows; rows of weight 0 add nothing).
        The layer-wise engine computes them from closed forms per layer and
        the sum as one contraction per layer, each row weighted by its
        unit's factor (``per_example_grads.engines.grouped``). A unit with
        a non-finite norm is left out, as an example is without units.
      num_units: ``U``; None infers ``max(unit_ids) + 1``. With ``unit_ids``,
        ``reduction="mean"`` divides by ``U``.

    Returns:
      A list of ``[*var.shape]`` tensors aligned with the variables, or
      ``(that list, norms)`` with ``return_norms=True``. With the layer-wise
      engine an embedding table's entry is a ``tf.IndexedSlices`` (as from
      ``tape.gradient``): ``optimizer.apply_gradients`` takes it as is, and
      ``tf.convert_to_tensor`` (or ``dense_sums``) makes it a dense tensor.

    Examples:
      >>> import keras, numpy as np
      >>> import per_example_grads as peg
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
      >>> x, y = np.ones((8, 3), "float32"), np.arange(8) % 2
      >>> grads = peg.clipped_gradients(model, loss, x, y, l2_norm_clip=0.1)
      >>> [tuple(g.shape) for g in grads]
      [(3, 2), (2,)]
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean'; got {reduction!r}.")
    sums, norms, _ = clipped_sums_and_predictions(
        model,
        loss_fn,
        x,
        y,
        l2_norm_clip=l2_norm_clip,
        sample_weight=sample_weight,
        method=method,
        variables=variables,
        training=training,
        allow_batch_coupling=allow_batch_coupling,
        unit_ids=unit_ids,
        num_units=num_units,
    )
    if reduction == "mean":
        if unit_ids is not None:  # checked by now
            b = (
                num_units
                if num_units is not None
                else tf.reduce_max(tf.concat([tf.cast(unit_ids, tf.int32), [-1]], 0)) + 1
            )
        else:
            b = tf.shape(tf.nest.flatten(x)[0])[0]  # x is checked by now
        sums = [transforms.divide_no_nan(s, b) for s in sums]
    return (sums, norms) if return_norms else sums


@tf.autograph.experimental.do_not_convert
def clipped_sums_and_predictions(
    model: Any,
    loss_fn: Any,
    x: Any,
    y: Any = None,
    *,
    l2_norm_clip: ClipNorm,
    sample_weight: Any = None,
    method: str = "auto",
    variables: Sequence | None = None,
    training: bool = False,
    allow_batch_coupling: bool = False,
    unit_ids: Any = None,
    num_units: int | None = None,
    nonempty: bool = False,
) -> tuple[list, Any, Any]:
    """``clipped_gradients``' sums and norms (as ``return_norms=True`` gives them), and the model's predictions.

    With ``unit_ids`` (``clipped_gradients``), the sums clip each unit's
    summed gradient and the norms are ``[U]``.

    The predictions are the outputs of the forward pass the sums came from
    (the layer-wise engine runs the model once on the whole batch), or
    ``()`` when the engine ran no such pass: a training step then needs no
    second forward pass for its loss and metrics.

    ``nonempty``: the caller guarantees at least one row when run, so a
    batch of unknown size is not guarded by ``unless_empty``'s ``tf.cond``.
    """
    selection.check_method(method)
    l2_norm_clip = check_clip(l2_norm_clip)
    problem = make_problem(model, loss_fn, variables, training, allow_batch_coupling)
    clip = _clip_groups(problem.variables, l2_norm_clip)
    batch = make_batch(model, x, y, sample_weight)
    units = grouped.units_or_none(unit_ids, num_units, batch)

    def clipped_sums(batch):
        if units is None:
            use = lambda engine: engine.clipped_sums(problem, batch, clip)
        else:
            use = lambda engine: grouped.unit_clipped_sums(engine, problem, batch, clip, units)
        sums, norms, predictions = selection.run(method, problem, use, batch)
        return sums, norms, () if predictions is None else predictions

    if not tf.executing_eagerly() and (units is not None or method not in ("auto", "layerwise")):
        # An engine that does not leave non-finite examples out itself: traced once for the pass and
        # its recomputation below, instead of the model and its rules traced twice; both calls are
        # weighted (weights of 1 are exact), so they share one signature. Where the layer-wise engine
        # may run, the pass is traced inline: that engine leaves them out itself, and a function
        # boundary costs the first step more (benchmarks/RESULTS.md, first step); should ``auto``
        # choose another engine, its recomputation traces the pass a second time.
        traced = tf.function(clipped_sums, autograph=False)

        def clipped_sums(batch):
            if "sample_weight" not in batch:
                batch = batch | {"sample_weight": tf.ones([batch_size(batch)])}
            return traced(batch)

    def without_nonfinite(batch):  # run only for B > 0
        sums, norms, predictions = clipped_sums(batch)
        left_out = isinstance(sums, FiniteSums)
        sums = _static_dense_shapes(sums, problem.variables)
        if left_out:  # the engine left such examples out itself: no second pass to trace
            return _without_nonfinite_examples(None, batch, sums, norms, problem.variables), norms, predictions
        recompute = lambda batch: clipped_sums(batch)[:2]
        return _without_nonfinite_examples(recompute, batch, sums, norms, problem.variables, units), norms, predictions

    sums, norms, predictions = unless_empty(batch, without_nonfinite, nonempty)
    if not isinstance(l2_norm_clip, (Mapping, list)):
        return sums, norms[0], predictions
    names = list(l2_norm_clip) if isinstance(l2_norm_clip, Mapping) else list(range(len(clip.groups)))
    return sums, dict(zip(names, norms)), predictions


def _without_nonfinite_examples(clipped_sums, batch, sums, norms, variables, units=None) -> list:
    """``sums``, or where some example's gradient is NaN or Inf, the sums over the other examples.

    Such an example gets clip factor 0. Its gradient cannot simply be
    multiplied by 0 (``0 * inf`` is NaN), so the step is recomputed with its
    rows replaced by a finite example's rows and weight 0: with per-example
    isolation the other examples' gradients are unchanged, and the replaced
    rows contribute exactly zero. This is still a per-example function whose
    contribution has norm ``<= C`` (0 for a non-finite example), so the
    sensitivity, and with it the privacy guarantee, is unchanged; and the
    sum no longer tells, without noise, whether such an example was in the
    batch. The recomputation runs only for batches that have such an
    example; the count is ``sum(~finite_examples(norms))`` (real rows only).

    ``clipped_sums`` None: the engine already left such examples out (it
    returned ``engines.base.FiniteSums``); only the warning is given.

    With ``units`` (``engines.grouped.Units``) the norms are per unit, and
    every row of a unit with a non-finite norm is replaced so: that unit
    contributes exactly zero, the others are unchanged.
    """
    if clipped_sums is None and not tf.executing_eagerly():  # the sums already leave them out, and no warning
        return sums
    finite = finite_examples(norms)
    if tf.executing_eagerly():
        bad = int(tf.reduce_sum(tf.cast(~finite, tf.int32)))
        if not bad:
            return sums
        what = "unit(s) of the batch have" if units is not None else "example(s) of the batch have"
        warnings.warn(
            f"{bad} {what} a non-finite (NaN or Inf) gradient; they were left "
            "out of the clipped sum (clip factor 0). Check their inputs and labels.",
            RuntimeWarning,
            stacklevel=3,
        )
    if clipped_sums is None:  # the sums already leave them out
        return sums
    all_finite = tf.reduce_all(finite)
    if units is not None:
        finite = tf.gather(finite, units.ids)  # per row: its unit's
    flat = tf.nest.flatten(sums, expand_composites=True)

    def recomputed():
        rows = tf.range(tf.size(finite))
        donor = tf.cast(tf.argmax(tf.cast(finite, tf.int32)), rows.dtype)  # a finite example
        source = tf.where(finite, rows, donor)
        cleaned = {k: v for k, v in batch.items() if k != "sample_weight"}
        cleaned = tf.nest.map_structure(lambda t: tf.gather(t, source), cleaned)
        weight = batch.get("sample_weight", tf.ones_like(finite, tf.float32))
        cleaned["sample_weight"] = tf.where(finite, weight, tf.zeros_like(weight))
        again, _ = clipped_sums(cleaned)
        return tf.nest.flatten(again, expand_composites=True)

    some = tf.reduce_any(finite)

    def zeros():  # run only where no example is finite (``some`` False): ``branch_zeros``
        return tf.nest.flatten(
            [
                tf.IndexedSlices(branch_zeros(tf.shape(s.values), s.values.dtype, some), s.indices, s.dense_shape)
                if isinstance(s, tf.IndexedSlices)
                else branch_zeros(v.shape, s.dtype, some)
                for v, s in zip(variables, sums)
            ],
            expand_composites=True,
        )

    if tf.executing_eagerly():
        out = recomputed() if bool(some) else zeros()
    else:
        out = tf.cond(all_finite, lambda: flat, lambda: tf.cond(some, recomputed, zeros))
    return _static_dense_shapes(tf.nest.pack_sequence_as(sums, out, expand_composites=True), variables)


def _static_dense_shapes(sums: Sequence, variables: Sequence) -> list:
    """``sums`` with each ``tf.IndexedSlices``' dense shape its variable's, a constant (``tf.cond`` and ``tf.function`` return it as a tensor)."""
    return [
        tf.IndexedSlices(s.values, s.indices, tf.constant(v.shape.as_list(), s.dense_shape.dtype))
        if isinstance(s, tf.IndexedSlices)
        else s
        for s, v in zip(sums, variables)
    ]


def dense_sums(sums: Sequence) -> list[tf.Tensor]:
    """``sums`` with every ``tf.IndexedSlices`` made a dense tensor (repeated indices added)."""
    return [tf.convert_to_tensor(s) if isinstance(s, tf.IndexedSlices) else s for s in sums]


def _clip_groups(variables, l2_norm_clip) -> ClipGroups:
    """Variable indices per clipping group, and each group's clip norm (already checked by ``check_clip``)."""
    if isinstance(l2_norm_clip, Mapping):
        names = list(l2_norm_clip)
        groups: list[list[int]] = [[] for _ in names]
        layer_names: set[str] = set()
        for i, v in enumerate(variables):
            parts = getattr(v, "path", v.name).split("/")[:-1]
            layer_names.update(parts)
            owners = [p for p in parts if p in l2_norm_clip]
            if not owners:
                raise ValueError(
                    f"l2_norm_clip has no entry for variable '{getattr(v, 'path', v.name)}'; "
                    f"give one of the layer names on its path: {parts}."
                )
            groups[names.index(owners[-1])].append(i)
        unknown = [n for n in names if n not in layer_names]
        if unknown:
            raise ValueError(
                f"l2_norm_clip names {unknown}, which match no layer owning a variable; "
                f"the layer names are {sorted(layer_names)}."
            )
        return ClipGroups(groups, [l2_norm_clip[n] for n in names])
    if isinstance(l2_norm_clip, list):
        if len(l2_norm_clip) != len(variables):
            raise ValueError(
                f"l2_norm_clip as a list needs one clip norm per variable ({len(variables)}); got {len(l2_norm_clip)}."
            )
        return ClipGroups([[i] for i in range(len(variables))], l2_norm_clip)
    return ClipGroups([list(range(len(variables)))], [l2_norm_clip])
