"""Reductions over the example axis of a ``[B, ...]`` tensor, shared by the rules, the engines and the transforms.

They import nothing from the package but ``xla_context`` (which imports
nothing), so any module may use them.
"""

from __future__ import annotations

import functools
import weakref

import tensorflow as tf

from per_example_grads._core.xla_context import in_xla_context

# graph -> {(dtype, value): a weak reference to its Const's output}; weak both ways, so the cache keeps no graph alive.
_CONSTANTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graph_constant(value, dtype=tf.int32) -> tf.Tensor:
    """``tf.constant(value, dtype)``, made once per graph for each value and dtype (an int or a list of ints, nested or not).

    The rules and engines reduce and reshape hundreds of tensors over the
    same axes and to the same shapes, and each ``axis=1`` or ``[-1, n]``
    was a ``Const`` node of its own (a few hundred in a 12-layer GPT-2's
    DP step). The one made here has no control inputs (made outside any
    ``tf.control_dependencies`` block: an op that reads it still has its
    own), and belongs to the graph being built (a ``tf.cond`` branch's is
    its own). Eagerly, a new constant.
    """
    if tf.executing_eagerly():
        return tf.constant(value, dtype)
    graph = tf.compat.v1.get_default_graph()
    key = (tf.as_dtype(dtype), _frozen(value))
    made = _CONSTANTS.setdefault(graph, {})
    found = made[key]() if key in made else None  # alive while its graph is: the graph holds its op
    if found is None:
        with tf.control_dependencies(None):
            found = tf.constant(value, dtype)
        made[key] = weakref.ref(found)
    return found


def _frozen(value):
    """``value`` with its lists as tuples (hashable; nesting kept, so ``[[0, 1]]`` is not ``[0, 1]``)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def compute_dtype(dtype) -> tf.DType:
    """The one rule for the dtype of norms, clip factors and reductions: float64 for float64, else float32.

    Half-precision gradients are reduced in float32 (their squares overflow
    and their sums lose digits), float64 ones keep their precision, so every
    layer of a model gives norms of one dtype that add up.
    """
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


def in_dtype(value, dtype) -> tf.Tensor:
    """``value`` as a tensor of ``dtype``; a Python number is converted directly (``tf.cast`` of one goes
    through float32 first, which turns 0.05 into 0.050000000745 in a float64 computation)."""
    return tf.cast(value, dtype) if tf.is_tensor(value) else tf.constant(value, dtype)


def per_example_squared_norms(t: tf.Tensor) -> tf.Tensor:
    """``[B]``: ``sum(t[n] ** 2)`` over all axes but the first, in float32 (float64 for float64 ``t``).

    One fused reduction (``reduce_euclidean_norm``, squared): it never holds
    a squared copy of ``t`` (for an output gradient ``g`` that copy is as
    large as ``g``, which the clipped sum keeps alive until every norm is
    known), and on CPU it is faster than ``reduce_sum(square(t))`` and than a
    batched dot product of each row with itself (``benchmarks/RESULTS.md``). Squaring the norm costs at most two roundings.
    XLA has no such kernel; it fuses ``reduce_sum(square(t))`` into one instead.

    In float32 the squares overflow for entries beyond about 1.8e19 (the
    sum is then inf; ``wide_squared_norms`` recomputes such examples in
    float64) and flush to 0 below about 1e-19.
    """
    t = tf.cast(t, compute_dtype(t.dtype))
    return _sum_of_squares(_rows(t))


WIDE = tf.float64  # the dtype of [B] squared norms beyond float32's range (``widened``)


def squares_part(t: tf.Tensor, squares: tf.Tensor | None = None) -> tuple:
    """``per_example_squared_norms(t)`` as a part for ``widened``: ``(value, its float64 recomputation)``.

    Args:
      t: ``[B, ...]``.
      squares: ``per_example_squared_norms(t)`` when already computed (in an
        XLA-compiled function beside ``t``, say).
    """
    squares = per_example_squared_norms(t) if squares is None else squares
    return squares, (None if compute_dtype(t.dtype) == WIDE else lambda pick: wide_sum_of_squares(pick(t)))


def wide_squared_norms(t: tf.Tensor) -> tf.Tensor:
    """``[B]`` float64: ``sum(t[n] ** 2)`` over all axes but the first, finite wherever ``t[n]`` is (``widened``)."""
    return widened([squares_part(t)])[0]


def wide_sum_of_squares(t: tf.Tensor) -> tf.Tensor:
    """``[k]`` float64: ``sum(t[n] ** 2)`` of ``[k, ...]`` rows, computed in float64, where the square of any float32 is finite."""
    return _sum_of_squares(tf.cast(t, WIDE), axis=list(range(1, t.shape.rank)))


def widened(parts: list) -> list[tf.Tensor]:
    """Float64 squared norms from float32 ones, finite wherever the gradients are.

    Each part is ``(value, exact)``: ``value`` ``[B]`` (or ``[B, ...]``) in
    float32, and ``exact(pick)`` the float64 values of the examples that
    ``pick`` selects (``pick(t)``: those rows of a ``[B, ...]`` tensor ``t``)
    (None: nothing to recompute, ``value`` is float64 or needs none). The
    result per part is ``value``, exactly (cast), except for the examples
    where some part's value is not finite (float32 squares overflow for
    entries beyond about 1.8e19), which get every part's ``exact``. The
    recomputations take those examples' rows only (``tf.gather_nd``, empty
    in the common case: no ``tf.cond``, whose branches cost more to trace
    and to run); under XLA, which wants static shapes, they run on the whole
    batch inside one ``tf.cond`` on ``is_finite``. Either way the common path
    costs a cast per part, one ``is_finite`` for all of them (``_all_finite``)
    and a few ops on ``[B]`` vectors or empty tensors.

    Underflow is not caught: entries below about 1e-19 square to 0 in
    float32 (TensorFlow flushes subnormal numbers), as in
    ``per_example_squared_norms``, and such a 0 is not told from the zero
    gradients of a padded batch's rows without a pass over the tensor.
    """
    wide = [tf.cast(value, WIDE) for value, _ in parts]
    checked = [i for i, (_, exact) in enumerate(parts) if exact is not None]
    if not checked:
        return wide
    finite = _all_finite([parts[i][0] for i in checked], [wide[i] for i in checked])
    if in_xla_context():

        def recomputed():
            out = []
            for i in checked:
                rank = parts[i][0].shape.rank
                keep = finite if rank == 1 else tf.reshape(finite, [-1] + [1] * (rank - 1))
                out.append(tf.where(keep, wide[i], parts[i][1](lambda t: t)))
            return out

        outs = tf.cond(tf.reduce_all(finite), lambda: [wide[i] for i in checked], recomputed)
    else:
        rows = tf.where(tf.logical_not(finite))  # [k, 1]
        pick = lambda t: tf.gather_nd(t, rows)  # noqa: E731
        outs = [tf.tensor_scatter_nd_update(wide[i], rows, parts[i][1](pick)) for i in checked]
    for i, value in zip(checked, outs):
        wide[i] = value
    return wide


def _all_finite(values: list, wide: list) -> tf.Tensor:
    """``[B]`` bool: whether every entry of example n in every one of ``values`` (``[B]`` or ``[B, ...]``) is finite.

    ``wide`` holds ``values`` cast to float64. Where no value is float64, one
    ``is_finite`` of their float64 sum decides: each entry is at most
    float32's largest, about 3.4e38, so the float64 sum cannot overflow, and
    it is finite exactly where every term is (a NaN or an infinity in a term
    makes it NaN or infinite). That is two graph nodes for a call's parts
    in place of an ``is_finite`` per part and a ``logical_and`` per part but one.
    """
    if any(v.dtype == WIDE for v in values):  # float64 terms could overflow their sum: one check each
        checks = [tf.math.is_finite(v) for v in values]
        checks = [tf.reduce_all(c, axis=list(range(1, c.shape.rank))) if c.shape.rank > 1 else c for c in checks]
        return functools.reduce(tf.logical_and, checks)
    totals = [w if w.shape.rank == 1 else tf.reduce_sum(w, axis=list(range(1, w.shape.rank))) for w in wide]
    return tf.math.is_finite(totals[0] if len(totals) == 1 else tf.add_n(totals))


def _sum_of_squares(t: tf.Tensor, axis=1) -> tf.Tensor:
    """``[B]`` ``sum(t[n] ** 2)`` over ``axis`` (of ``[B, n]`` rows by default): ``per_example_squared_norms``' reduction."""
    axis = graph_constant(axis)
    if in_xla_context():
        return tf.reduce_sum(tf.square(t), axis=axis)
    return tf.square(tf.math.reduce_euclidean_norm(t, axis=axis))


def _rows(t: tf.Tensor) -> tf.Tensor:
    """``t`` as ``[B, n]`` rows, ``n`` the product of its other axes.

    With those axes static (the rules' tensors: a layer's outputs and its
    variables' shapes) the target shape is one constant, ``[-1, n]``;
    ``[tf.shape(t)[0], -1]`` took six more graph nodes per call, which over
    every norm and sum of a large model were a good part of its graph.
    """
    inner = t.shape[1:]
    if t.shape.rank == 2:
        return t
    if inner.is_fully_defined() and inner.num_elements() > 0:
        return tf.reshape(t, graph_constant([-1, inner.num_elements()]))
    return tf.reshape(t, [tf.shape(t)[0], -1])


def weighted_example_sum(weights: tf.Tensor, t: tf.Tensor) -> tf.Tensor:
    """``sum_i weights[i] * t[i]``: ``[*t.shape[1:]]`` from ``[B]`` weights and ``[B, ...]`` ``t``.

    One matrix product of ``t`` viewed as ``[B, n]`` and the weights as a
    column (``example_column``, shared by every sum with those weights): what
    ``tf.linalg.matvec`` computes, without its two shape ops per call;
    ``tf.tensordot`` builds the same from a dozen, which cost more than the
    product on small layers.
    """
    flat = _rows(t)
    total = tf.matmul(flat, example_column(weights, t.dtype), transpose_a=True)  # [n, 1]
    return tf.reshape(
        total, graph_constant(t.shape[1:].as_list()) if t.shape[1:].is_fully_defined() else tf.shape(t)[1:]
    )


# graph -> {(id(weights), dtype, rank): (weak reference to the weights, weak reference to their column)}
_COLUMNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def example_column(weights: tf.Tensor, dtype, rank: int = 2) -> tf.Tensor:
    """``[B, 1, ..., 1]`` (``rank`` axes): ``[B]`` ``weights`` cast to ``dtype``, to scale the rows of a ``[B, ...]`` tensor.

    Made once per graph for each weights tensor, dtype and rank (every
    variable clipped together is scaled by the same weights), outside any
    ``tf.control_dependencies`` block, as ``graph_constant``'s constants are:
    a reshape of a ``[B]`` vector, it waits for nothing but the weights.
    Eagerly, made each time.
    """
    dtype = tf.as_dtype(dtype)
    make = lambda: tf.reshape(tf.cast(weights, dtype), graph_constant([-1] + [1] * (rank - 1)))  # noqa: E731
    if tf.executing_eagerly():
        return make()
    made = _COLUMNS.setdefault(tf.compat.v1.get_default_graph(), {})
    key = (id(weights), dtype, rank)
    was, found = made.get(key, (None, None))
    if was is not None and was() is weights and found() is not None:
        return found()
    with tf.control_dependencies(None):
        column = make()
    made[key] = (weakref.ref(weights), weakref.ref(column))
    return column


def map_examples(fn, elems, **kwargs):
    """``tf.map_fn(fn, elems, **kwargs)``, leaving the variable scope as it found it when ``fn`` raises.

    Traced inside a ``tf.function``, ``tf.map_fn`` gives the current variable
    scope a caching device and takes it back only when it returns; when
    ``fn`` raises (a data error, say), the device stays on the scope of the
    eager context, and every later ``MirroredStrategy`` variable creation in
    the process fails ("Caching devices is not yet supported when eager
    execution is enabled").
    """
    if tf.executing_eagerly():
        return tf.map_fn(fn, elems, **kwargs)
    from tensorflow.python.ops import variable_scope  # the scope tf.map_fn itself sets

    scope = variable_scope.get_variable_scope()
    device = scope.caching_device
    try:
        return tf.map_fn(fn, elems, **kwargs)
    except BaseException:
        scope.set_caching_device(device)
        raise
