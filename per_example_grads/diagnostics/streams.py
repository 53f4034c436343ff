"""Turning the ``data`` a user passes into a stream of ``(x, y)`` batches."""

from __future__ import annotations

import numbers
from typing import Any, Iterator

import tensorflow as tf

from per_example_grads._core.batch import common_rows

DEFAULT_BATCH_SIZE = 256


def check_batch_size(batch_size: Any) -> int:
    """``batch_size`` as an ``int``: ``DEFAULT_BATCH_SIZE`` for None, else ``check_count``'s (``>= 1``)."""
    return DEFAULT_BATCH_SIZE if batch_size is None else check_count("batch_size", batch_size, 1)


def check_count(name: str, value: Any, minimum: int) -> int:
    """``value`` as an ``int``, an integer ``>= minimum``.

    Raises:
      TypeError: not an integer (``True`` and ``2.5`` are refused, not rounded).
      ValueError: an integer below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}; got {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}.")
    return int(value)


def iterate_batches(data: Any, batch_size: int | None = None) -> Iterator[tuple[Any, Any]]:
    """Yields ``(x, y)`` batches, each leaf ``[B, ...]``.

    Args:
      data: a *batched* ``tf.data.Dataset`` whose elements are ``(x, y)``
        (sample weights are not supported yet and raise), or a tuple/list
        ``(x, y)`` of arrays, each of ``x`` and ``y`` an array or the
        structure the model takes (a dict, list or tuple of arrays, nested
        or not), every array sharing the leading axis ``N``. Batches keep
        that structure: each leaf is sliced to ``[B, ...]`` rows.
      batch_size: examples per batch for array data (default
        ``DEFAULT_BATCH_SIZE``; ``check_batch_size``); ignored for datasets,
        which are batched already.

    Raises:
      TypeError: for anything else, or a leaf of array data that is not an
        array (``num_examples``).
      ValueError: array data whose leaves disagree on ``N``, naming two of
        them (``num_examples``), before any batch is yielded.
    """
    if isinstance(data, tf.data.Dataset):
        for element in data:
            if not isinstance(element, (tuple, list)) or len(element) < 2:
                raise TypeError(
                    "data must be a batched tf.data.Dataset of (x, y) pairs; got elements "
                    f"of type {type(element).__name__}."
                )
            if len(element) > 2:
                raise ValueError(
                    f"data elements have {len(element)} entries; gradient statistics take "
                    "(x, y) only (sample weights would be silently dropped)."
                )
            yield element[0], element[1]
        return
    if isinstance(data, (tuple, list)) and len(data) == 2:
        x, y = data
        n = num_examples(data)
        step = check_batch_size(batch_size)
        for start in range(0, n, step):
            sl = slice(start, start + step)
            yield (
                tf.nest.map_structure(lambda t: t[sl], x),
                None if y is None else tf.nest.map_structure(lambda t: t[sl], y),
            )
        return
    raise TypeError(
        f"data must be a batched tf.data.Dataset of (x, y) or a tuple (x, y) of arrays; got {type(data).__name__}."
    )


def num_examples(data: Any) -> int | None:
    """``N`` for array data ``(x, y)``, None for datasets (unknown without iterating).

    Raises:
      TypeError, ValueError: as ``common_rows`` (``_core/batch.py``): a leaf
        that is not an array, or leaves with different numbers of rows; the
        message names the leaf (``x['padding_mask']``).
    """
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return common_rows({"x": data[0], "y": data[1]}, "data")
    return None


def num_batches(data: Any, batch_size: int | None = None) -> int | None:
    """Batches ``iterate_batches`` will yield, when known in advance."""
    if isinstance(data, tf.data.Dataset):
        n = int(data.cardinality())
        return n if n >= 0 else None
    n = num_examples(data)
    if n is None:
        return None
    return -(-n // check_batch_size(batch_size))
