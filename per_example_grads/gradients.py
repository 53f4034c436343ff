"""The main entry points: ``per_example_gradients`` and ``per_example_norms``."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from per_example_grads._core.batch import make_batch, unless_empty
from per_example_grads._core.problem import make_problem
from per_example_grads.engines import ENGINES, grouped, selection


@tf.autograph.experimental.do_not_convert
def per_example_gradients(
    model: Any,
    loss_fn: Callable | str,
    x: Any,
    y: Any = None,
    *,
    sample_weight: Any = None,
    method: str = "auto",
    variables: Sequence | None = None,
    training: bool = False,
    allow_batch_coupling: bool = False,
    sparse_embeddings: bool = False,
    unit_ids: Any = None,
    num_units: int | None = None,
) -> list:
    """Every example's gradient, in one pass.

    Convention: ``grads[k][i]`` is the gradient of example i's own loss,
    multiplied by ``sample_weight[i]`` if given, with respect to
    ``variables[k]``. Summing over i gives the gradient of the summed loss
    (not the mean). Variables the loss does not reach get zeros.

    Args:
      model: a Keras 3 model (Sequential, Functional, subclassed, nested), or
        any callable ``x -> y_pred`` together with ``variables=``.
      loss_fn: ``loss_fn(y_true, y_pred)`` returning ``[B]`` or ``[B, ...]``
        (trailing axes are averaged per example); a ``keras.losses.Loss``
        with any ``reduction`` (the unreduced values are used); or a Keras loss
        name.
      x: model input, ``[B, ...]``, or a list/dict of such for multi-input
        models.
      y: targets, ``[B, ...]`` or a structure of them, or None.
      sample_weight: None or ``[B]`` weights.
      method: ``"auto"`` (default), ``"layerwise"``, ``"vectorized"``,
        ``"jacobian"``, ``"weight_copies"`` or ``"loop"`` (``peg.METHODS``).
        ``"auto"`` runs ``"layerwise"`` whenever it covers the model. See the
        engine table in the README; ``per_example_grads.engines.selection``
        documents the auto rule.
      variables: what to differentiate; defaults to
        ``model.trainable_variables``.
      training: passed to the model as ``training=``.
      allow_batch_coupling: with ``training=True``, BatchNormalization makes one
        example's output depend on the whole batch, so per-example gradients
        are ill-defined and this raises ``ValueError``. Set True to compute
        them anyway (each example is then normalized with its own statistics).
      sparse_embeddings: if True, an embedding table's entry is a
        ``PerExampleSlices`` (each example's ``[T]`` ids and ``[T, dim]`` rows)
        instead of the dense ``[B, vocab, dim]`` tensor, which is mostly zeros
        and can be huge. It converts to the dense tensor wherever one is
        expected, and the transforms (``global_norms``,
        ``clip_by_global_norm``, ``sum_examples``...) use the rows directly.
        Needs the layer-wise engine (``method="layerwise"``, or ``"auto"`` on
        a model it covers).
      unit_ids: None, or ``[B]`` integers in ``[0, num_units)``: the unit
        (a user, any group of rows) of each row. Then entry k is
        ``[U, *variables[k].shape]``, row ``u`` the sum of unit ``u``'s rows'
        gradients (zeros for a unit with no rows; a row of weight 0 adds
        nothing). See ``per_example_grads.engines.grouped``.
      num_units: ``U``; None infers ``max(unit_ids) + 1``. Only with ``unit_ids``.

    Returns:
      A list aligned with ``variables``; entry k has shape
      ``[B, *variables[k].shape]`` (``[U, ...]`` with ``unit_ids``) and the
      variable's dtype (a ``PerExampleSlices`` of that shape for an
      embedding table with ``sparse_embeddings=True``).

    Raises:
      ValueError, TypeError: for bad inputs, naming the argument.

    Examples:
      >>> import keras, numpy as np
      >>> import per_example_grads as peg
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> x = np.ones((4, 3), "float32"); y = np.array([0, 1, 0, 1])
      >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
      >>> grads = peg.per_example_gradients(model, loss, x, y)
      >>> [tuple(g.shape) for g in grads]
      [(4, 3, 2), (4, 2)]
    """
    selection.check_method(method)
    problem = make_problem(model, loss_fn, variables, training, allow_batch_coupling)
    batch = make_batch(model, x, y, sample_weight)
    units = grouped.units_or_none(unit_ids, num_units, batch)
    if units is not None:
        if sparse_embeddings:
            raise ValueError("sparse_embeddings=True cannot be combined with unit_ids (per-unit gradients are dense).")
        return unless_empty(
            batch,
            lambda batch: selection.run(
                method, problem, lambda e: grouped.unit_gradients(e, problem, batch, units), batch
            ),
        )
    if sparse_embeddings:
        engine = _sparse_engine(method, problem)

    def compute(batch):  # run only for B > 0
        if sparse_embeddings:
            return engine.sparse_compute(problem, batch)
        return selection.compute(method, problem, batch)

    return unless_empty(batch, compute)


def _sparse_engine(method: str, problem):
    """The engine ``sparse_embeddings=True`` runs: ``method``, or for ``"auto"`` its first choice; ValueError if it cannot."""
    name = selection.AUTO_ORDER[0] if method == "auto" else method
    engine = ENGINES[name]
    able = " or ".join(repr(n) for n, e in ENGINES.items() if e.supports_sparse)
    reason = engine.why_not(problem) if engine.supports_sparse else f"method={method!r} gives no embedding rows"
    if reason:
        raise ValueError(f"sparse_embeddings=True needs method={able} or 'auto' on a model it covers: {reason}.")
    return engine


@tf.autograph.experimental.do_not_convert
def per_example_norms(
    model: Any,
    loss_fn: Callable | str,
    x: Any,
    y: Any = None,
    *,
    by_variable: bool = False,
    unit_ids: Any = None,
    num_units: int | None = None,
    **kwargs: Any,
) -> tf.Tensor | list[tf.Tensor]:
    """L2 norms of every example's gradient (or, with ``unit_ids``, of every unit's).

    Args:
      model, loss_fn, x, y: as in ``per_example_gradients``.
      by_variable: False for one global norm per example; True for one norm
        per example and variable.
      unit_ids, num_units: as in ``per_example_gradients``: the norms of each
        unit's summed gradient, ``[U]``, indexed by unit id (0 for a unit
        with no rows). The layer-wise engine computes them from closed forms
        per layer without per-example gradients where a layer's rule has a
        grouped form (``per_example_grads.rules.grouped``).
      **kwargs: ``sample_weight``, ``method``, ``variables``, ``training``,
        ``allow_batch_coupling``, as in ``per_example_gradients``.

    Returns:
      ``[B]`` global norms (float32), or with ``by_variable=True`` a list of
      ``[B]`` tensors aligned with the variables (``[U]`` with ``unit_ids``).

    Examples:
      >>> import keras, numpy as np
      >>> import per_example_grads as peg
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> norms = peg.per_example_norms(model, "mse", np.ones((5, 3)), np.zeros((5, 1)))
      >>> tuple(norms.shape)
      (5,)
    """
    method = kwargs.pop("method", "auto")
    selection.check_method(method)
    problem = make_problem(
        model,
        loss_fn,
        kwargs.pop("variables", None),
        kwargs.pop("training", False),
        kwargs.pop("allow_batch_coupling", False),
    )
    batch = make_batch(model, x, y, kwargs.pop("sample_weight", None))
    if kwargs:
        raise TypeError(f"per_example_norms got unexpected arguments: {sorted(kwargs)}.")
    units = grouped.units_or_none(unit_ids, num_units, batch)
    if units is not None:
        return unless_empty(
            batch,
            lambda batch: selection.run(
                method, problem, lambda e: grouped.unit_norms(e, problem, batch, units, by_variable), batch
            ),
        )
    # Engines with closed forms (layer-wise: ghost norms) never build B x P.
    return unless_empty(
        batch, lambda batch: selection.run(method, problem, lambda e: e.norms(problem, batch, by_variable), batch)
    )
