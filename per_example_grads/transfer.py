"""Gradients across a process boundary: to and from ``{variable.path: numpy array}``.

To carry ``(gradient, variable)`` pairs (from ``compute_gradients``) to a
parameter-server-style worker, a file or a queue, ``export_gradients`` turns
them into ``{variable.path: numpy array}``, and ``import_gradients`` checks
such a dict against a model's variables by name (or by position, between two
copies of one model), shape and dtype before pairing them up again. Real multi-machine training should go through
``tf.distribute``; this is for the simple cases.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import tensorflow as tf


def export_gradients(grads_and_vars: Sequence[tuple[Any, Any]]) -> dict[str, np.ndarray]:
    """``{variable.path: gradient as numpy}``, e.g. for ``np.savez`` or pickling."""
    out = {}
    for pair in grads_and_vars:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(
                "export_gradients takes (gradient, variable) pairs, as compute_gradients returns them; got a "
                f"{type(pair).__name__}. For a list of gradients (peg.dp.private_gradients'), give "
                "zip(grads, model.trainable_variables)."
            )
        g, v = pair
        name = _name(v)
        if name in out:
            raise ValueError(f"two variables share the name {name!r}; cannot export by name.")
        out[name] = np.asarray(tf.convert_to_tensor(g))
    return out


def import_gradients(
    arrays: Mapping[str, np.ndarray] | Sequence[np.ndarray],
    variables: Sequence,
    *,
    match: str = "path",
) -> list[tuple[tf.Tensor, Any]]:
    """Pairs exported arrays with ``variables``, checking names (or positions), shapes and dtypes.

    Args:
      arrays: ``{variable.path: array}`` from ``export_gradients``, or a
        list of arrays in the order of ``variables``.
      variables: the receiving model's variables (e.g.
        ``model.trainable_variables``).
      match: ``"path"`` (default for a dict): array ``k`` goes to the variable
        of the same path, which fails between two copies of one architecture
        built in one process (Keras numbers their layers: ``dense`` and
        ``dense_1``); ``"position"`` (the only choice for a list): the k-th
        array goes to the k-th variable, in the dict's order for a dict
        (``export_gradients`` keeps its variables' order), so a server can
        import what a worker with its own copy of the model exported. A
        dict whose keys name the receiving variables in another order, or
        pair a variable's own name (``kernel``) with another (``bias``), is
        refused.

    Raises:
      TypeError: ``arrays`` is neither a dict nor a list, or ``match`` is not
        one of the two.
      ValueError: listing every missing or unexpected name (or a count that
        differs), and every mismatched shape or dtype.

    Examples:
      >>> import keras
      >>> worker = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> server = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> pairs = [(tf.ones(v.shape), v) for v in worker.trainable_variables]
      >>> exported = export_gradients(pairs)
      >>> received = import_gradients(exported, server.trainable_variables, match="position")
      >>> [tuple(g.shape) for g, _ in received]
      [(3, 2), (2,)]
    """
    if match not in ("path", "position"):
        raise TypeError(f"match must be 'path' or 'position'; got {match!r}.")
    variables = list(variables)
    names = [_name(v) for v in variables]
    problems = []
    if isinstance(arrays, Mapping):
        if match == "path":
            missing = [n for n in names if n not in arrays]
            extra = [n for n in arrays if n not in names]
            if missing:
                problems.append(f"missing gradients for {missing}")
            if extra:
                problems.append(f"gradients for unknown variables {extra}")
            if missing or extra:
                problems.append("(between two copies of a model, import with match='position')")
            given = [(arrays[n], v, repr(n)) for n, v in zip(names, variables) if n in arrays]
        else:
            if set(arrays) <= set(names) and [n for n in names if n in arrays] != list(arrays):
                problems.append("its keys name these variables, in another order: import with match='path'")
            problems += [
                f"{k!r} -> {n!r} pairs a {_own_name(k)!r} gradient with a {_own_name(n)!r} variable"
                for k, n in zip(arrays, names)
                if _own_name(k) != _own_name(n)
            ]
            given = list(zip(arrays.values(), variables, (f"{k!r} -> {n!r}" for k, n in zip(arrays, names))))
    elif isinstance(arrays, (list, tuple)):
        if match == "path":
            match = "position"  # a list has no names
        given = list(zip(arrays, variables, (f"#{k} ({n!r})" for k, n in enumerate(names))))
    else:
        raise TypeError(
            "arrays must be a dict {variable.path: array} from export_gradients, or a list of arrays "
            f"in the order of the variables; got {type(arrays).__name__}."
        )
    if match == "position" and len(arrays) != len(variables):
        problems.append(f"{len(arrays)} gradients for {len(variables)} variables")
    pairs = []
    for a, v, where in given:
        a = np.asarray(a)
        if tuple(a.shape) != tuple(v.shape):
            problems.append(f"{where}: gradient shape {tuple(a.shape)} != variable shape {tuple(v.shape)}")
        elif a.dtype != np.dtype(tf.as_dtype(v.dtype).as_numpy_dtype):
            problems.append(f"{where}: gradient dtype {a.dtype} != variable dtype {tf.as_dtype(v.dtype).name}")
        else:
            pairs.append((tf.convert_to_tensor(a), v))
    if problems:
        raise ValueError("Cannot import gradients: " + "; ".join(problems) + ".")
    return pairs


def _name(v) -> str:
    return getattr(v, "path", None) or v.name


def _own_name(path: str) -> str:
    """A variable's own name in its path: ``"kernel"`` of ``"sequential/dense/kernel"`` (or of ``"dense/kernel:0"``)."""
    return str(path).rsplit("/", 1)[-1].split(":")[0]
