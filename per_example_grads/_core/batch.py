"""Checking and packing the ``(x, y, sample_weight)`` a user passes in.

A *batch* here is a dict ``{"x": ..., "y": ..., "sample_weight": ...}``
(absent entries left out) whose leaves are tensors sharing one leading axis
``B``. Engines map over that axis, so every leaf must have it.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Mapping

import numpy as np
import tensorflow as tf

from per_example_grads._core import model_inspection

Batch = dict


def make_batch(model: Any, x: Any, y: Any = None, sample_weight: Any = None) -> Batch:
    """Converts and validates the inputs; returns a ``Batch``.

    Args:
      model: the model, used to check declared input dtypes.
      x: a tensor, array or nested structure of them, each ``[B, ...]``.
      y: ``None`` or the same kind of structure, each ``[B, ...]``.
      sample_weight: ``None`` or ``[B]`` real numbers.

    Raises:
      TypeError: for non-numeric inputs, a Python list of numbers (pass it
        as one array: ``np.asarray``), ``tf.RaggedTensor`` or
        ``tf.SparseTensor`` leaves (anywhere in ``x``, ``y`` or
        ``sample_weight``: the message says how to make them dense), or
        non-float ``x`` where the model declares a float input.
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
    return _check_leading_dims(batch)


def batch_size(batch: Batch) -> tf.Tensor | int:
    """``B``: a Python int when static, else a scalar int32 tensor."""
    first = tf.nest.flatten(batch["x"])[0]
    static = first.shape[0]
    return static if static is not None else tf.shape(first)[0]


def unless_empty(batch: Batch, compute: Callable[[Batch], Any], nonempty: bool = False) -> Any:
    """``compute(batch)``, except that for ``B = 0`` it returns the results for no examples without running it.

    The one guard against empty batches, shared by every public entry point
    (``per_example_gradients``, ``per_example_norms``, ``clipped_gradients``):
    the model never runs on zero rows. How TensorFlow's kernels treat empty
    tensors varies with the processor (oneDNN picks different kernels: on
    some CPUs a causal ``Conv1D`` rejects a ``[0, T, C]`` input while on others
    it passes), so nothing here may depend on it.

    The results for no examples have the structure ``compute`` returns when
    traced with ``B`` unknown: every dimension left unknown there is taken to
    depend on ``B`` and is 0, every other is kept, and entries are zeros. So
    ``[B, *var.shape]`` per-example gradients become ``[0, *var.shape]``, ``[B]``
    norms ``[0]``, sums over examples zeros of their static shape, a
    ``tf.IndexedSlices`` sum has no rows and a ``PerExampleSlices`` no
    examples. ``compute`` must therefore give its results static shapes
    apart from the dimensions that depend on ``B`` (variables' shapes are
    static).

    - ``B`` static and positive: ``compute(batch)``, nothing else.
    - ``B`` static and 0: ``compute`` is traced (in a graph of its own, never
      run) with ``B`` unknown, to learn the structure of its results.
    - ``B`` known only at run time (``tf.function`` with an unknown batch
      size): ``tf.cond(B > 0, compute, no examples)``; ``tf.cond`` traces the
      first branch before the second, which builds its results from the
      first's. With ``nonempty`` the caller guarantees ``B > 0`` when run
      (``dp.aggregator.clipped_sum``'s bucketed rows of a batch of known
      positive size), and ``compute(batch)`` is traced without the branch.
    """
    compute = tf.autograph.experimental.do_not_convert(compute)
    b = batch_size(batch)
    if (isinstance(b, int) and b > 0) or (nonempty and not isinstance(b, int)):
        return compute(batch)
    if isinstance(b, int):
        relaxed = tf.nest.map_structure(lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), batch)
        traced = tf.function(compute, autograph=False).get_concrete_function(relaxed).structured_outputs
        return _no_examples(traced, 0)

    first_branch = []

    def examples():
        results = compute(batch)
        first_branch.append(results)
        return results

    def no_examples():
        if not first_branch:
            raise AssertionError("tf.cond traced its second branch first; unless_empty needs the first's results.")
        return _no_examples(first_branch[0], b)

    return tf.cond(b > 0, examples, no_examples)


def branch_zeros(shape, dtype, off: tf.Tensor) -> tf.Tensor:
    """Zeros of ``shape`` and ``dtype`` for a ``tf.cond`` branch that runs only where the scalar ``off`` is 0 (or False).

    ``tf.zeros`` (or ``tf.zeros_like``) of a static shape is a ``Fill`` of
    constants, which Grappler's constant folding turns into a ``Const`` node:
    its kernel holds a full-size tensor for as long as the function lives,
    even in a branch that never runs. For a clipped sum's fallback branch,
    whose zeros have every variable's shape, that was one more float32 copy
    of the model's parameters. Filled with ``off``, a value known only at
    run time and 0 wherever the branch runs, the same zeros are made only
    when the branch runs.
    """
    return tf.fill(shape, tf.cast(off, dtype))


def _no_examples(results: Any, b: tf.Tensor | int) -> Any:
    """``results`` for no examples: zeros, with ``b`` (0 when run) for every unknown dimension.

    The zeros are filled with ``b`` (``branch_zeros``): a sum's zeros of its
    variable's static shape would otherwise be held for as long as the function lives.
    """

    def zeros(t):
        if not isinstance(t, tf.Tensor):
            return t
        if t.shape.rank is None:
            raise ValueError(f"unless_empty needs results of known rank; got a {t.dtype.name} tensor of unknown shape.")
        shape = tf.stack([b if d is None else d for d in t.shape.as_list()]) if t.shape.rank else []
        return branch_zeros(shape, t.dtype, b)

    def leaf(value):
        if isinstance(value, tf.IndexedSlices):
            dense_shape = tf.get_static_value(value.dense_shape)
            if dense_shape is None:
                raise ValueError("unless_empty needs tf.IndexedSlices results with a static dense_shape.")
            return tf.IndexedSlices(
                zeros(value.values), zeros(value.indices), tf.constant(dense_shape, value.dense_shape.dtype)
            )
        if isinstance(value, tf.experimental.ExtensionType):  # PerExampleSlices: its tensors, its static fields kept
            return tf.nest.map_structure(zeros, value, expand_composites=True)
        if tf.is_tensor(value) and not isinstance(value, tf.Tensor):
            raise TypeError(f"unless_empty cannot build a {type(value).__name__} for no examples.")
        return zeros(value)

    return tf.nest.map_structure(leaf, results)


def add_batch_axis(example: Batch) -> Batch:
    """``[...]`` leaves of one example -> ``[1, ...]``."""
    return tf.nest.map_structure(lambda t: tf.expand_dims(t, 0), example)


def common_rows(arguments: Mapping[str, Any], where: str, *, require_known: bool = True) -> int | None:
    """``N``, the leading dimension every leaf of every argument shares, for data that is sliced into batches.

    ``arguments`` maps each argument's name to its value (``{"x": x, "y": y}``,
    ``None`` values skipped): arrays, tensors, or dicts, lists, tuples and
    nested structures of them, as the model takes them. Nothing is converted;
    only the leaves' shapes are read, so this checks array data before it is
    batched (``where`` names the data in messages, e.g. ``"data"``). A leaf
    whose rows are unknown (a symbolic tensor in ``tf.function``) is an error
    with ``require_known``, else skipped (``None`` if no leaf's rows are known).

    Raises:
      TypeError: a leaf that is None, a scalar or a Python list of numbers
        (read as a structure of scalars; pass ``np.asarray`` of it).
      ValueError: two leaves with different numbers of rows, naming both
        (``x['ids'] has 8 rows but y has 10``).
    """
    first: tuple[str, int] | None = None
    for name, value in arguments.items():
        if value is None:
            continue
        _refuse_numbers_as_structure(name, value)
        for label, leaf in zip(_leaf_labels(name, value), tf.nest.flatten(value)):
            if leaf is None:
                raise TypeError(f"{where}: {label} is None; expected an array of shape [N, ...].")
            shape = leaf.shape if hasattr(leaf, "shape") else np.shape(leaf)
            if len(shape) == 0:
                raise TypeError(f"{where}: {label} is a scalar; expected an array of shape [N, ...].")
            rows = shape[0]
            if rows is None:
                if not require_known:
                    continue
                raise ValueError(f"{where}: {label} has an unknown number of rows; pass arrays or eager tensors.")
            if first is None:
                first = (label, int(rows))
            elif int(rows) != first[1]:
                raise ValueError(
                    f"{where}: {label} has {int(rows)} rows but {first[0]} has {first[1]}; every array "
                    "(each leaf of a dict, list or tuple too) needs the same number of rows N, one per example."
                )
    if first is None:
        if require_known:
            raise ValueError(f"{where} holds no arrays.")
        return None
    return first[1]


def _refuse_numbers_as_structure(name: str, value: Any) -> None:
    """A Python list or tuple of numbers anywhere in ``value`` is refused: tf.nest reads it as scalars, not rows."""

    def walk(label: str, node: Any) -> None:
        if isinstance(node, Mapping):
            for key, child in node.items():
                walk(f"{label}[{key!r}]", child)
        elif isinstance(node, (list, tuple)) and not hasattr(node, "_fields") and node:
            if all(isinstance(leaf, (numbers.Number, np.generic)) for leaf in tf.nest.flatten(node)):
                raise TypeError(
                    f"{label} is a Python {type(node).__name__} of numbers, which reads as a structure of "
                    f"scalars, not as rows; pass it as one array, e.g. np.asarray({label})."
                )
            for i, child in enumerate(node):
                walk(f"{label}[{i}]", child)

    walk(name, value)


def _to_tensors(name: str, value: Any):
    _refuse_numbers_as_structure(name, value)
    leaves = tf.nest.flatten(value)
    converted = [_to_tensor(label, leaf) for label, leaf in zip(_leaf_labels(name, value), leaves)]
    return tf.nest.pack_sequence_as(value, converted)


def _leaf_labels(name: str, value: Any) -> list[str]:
    """How messages name each leaf of ``value`` (in ``tf.nest.flatten`` order): ``name``, or ``name['key'][0]``..."""
    # tf.nest's own paths (public under tf.__internal__ for Keras), so the order is tf.nest.flatten's.
    paths = list(tf.__internal__.nest.yield_flat_paths(value))
    if len(paths) == 1:
        return [name]
    return [name + "".join(f"[{key!r}]" for key in path) for path in paths]


# What each composite tensor must become: the engines slice and map over dense [B, ...] leaves.
_DENSIFY = {
    tf.RaggedTensor: "pad it with .to_tensor() (and pass a padding mask if the model takes one)",
    tf.SparseTensor: "make it dense with tf.sparse.to_dense(...)",
}


def _to_tensor(label: str, leaf: Any) -> tf.Tensor:
    if leaf is None:
        raise TypeError(f"{label} is None; expected a tensor or array of shape [B, ...].")
    for kind, fix in _DENSIFY.items():
        if isinstance(leaf, kind):
            raise TypeError(
                f"{label} is a tf.{kind.__name__}; per-example gradients need dense "
                f"tensors of shape [B, ...], so {fix}."
            )
    if isinstance(leaf, (tf.Tensor, tf.Variable)):
        t = tf.convert_to_tensor(leaf)
    else:
        arr = np.asarray(leaf)
        if arr.dtype == object or arr.dtype.kind in "USV":
            raise TypeError(f"{label} must be numeric, shape [B, ...]; got an array of dtype {arr.dtype}.")
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


def _check_leading_dims(batch: Batch) -> Batch:
    """``batch``, checked: static leading dimensions now, dynamic ones when the graph runs.

    The run-time checks are attached to every leaf (``tf.identity`` under
    their control), so no computation on the batch can run, and fail with a
    less helpful message, before them.
    """
    named = []
    for name in ("x", "y", "sample_weight"):
        if name in batch:
            named.extend(zip(_leaf_labels(name, batch[name]), tf.nest.flatten(batch[name])))
    ref_name, ref = named[0]
    unknown = []  # (name, leaf) whose leading size is compared with ref's when the graph runs
    for name, leaf in named[1:]:
        a, b = ref.shape[0], leaf.shape[0]
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"All inputs must share the leading batch dimension B: {ref_name} has B={a} but {name} has B={b}."
            )
        if a is None or b is None:
            unknown.append((name, leaf))
    if not unknown:  # always so eagerly, where every shape is known
        return batch
    # One assertion for every leaf (tf.debugging.assert_equal took about 15 graph nodes per leaf).
    leads = tf.stack([tf.shape(leaf, out_type=tf.int32)[0] for _, leaf in unknown])
    ref_lead = tf.shape(ref, out_type=tf.int32)[0]
    check = tf.debugging.Assert(
        tf.reduce_all(tf.equal(leads, ref_lead)),
        [
            f"All inputs must share the leading batch dimension B: {ref_name} has B =",
            ref_lead,
            f"but {', '.join(name for name, _ in unknown)} {'has' if len(unknown) == 1 else 'have'} B =",
            leads,
        ],
    )
    with tf.control_dependencies([check]):
        return tf.nest.map_structure(tf.identity, batch)
