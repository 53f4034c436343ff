"""How many examples ``fit`` trains on, read from the data itself.

``DPModel.epsilon`` is computed for ``N`` examples; a ``num_examples`` that
overstates the data under-reports it. ``rows_of_fit_data`` reads ``N`` from
whatever ``keras.Model.fit`` was given, wherever it can be known without
guessing:

- arrays (NumPy, tensors, or dicts / lists of them): their rows, less the
  last ``floor``-complement that ``validation_split`` holds out (Keras's own
  split: the first ``floor(N (1 - split))`` rows train);
- a ``tf.data.Dataset`` of known cardinality that does not repeat its
  elements: the rows of one pass, the
  cardinality times the batch size where every batch has a static size, else
  counted by running the pipeline once (only the leading dimension of each
  batch is read);
- anything else (a dataset of unknown or infinite cardinality, a generator,
  a ``PyDataset``): unknown.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import tensorflow as tf

from per_example_grads._core.datasets import repeats


@dataclasses.dataclass(frozen=True)
class FitRows:
    """The training rows of one ``fit`` call.

    Attributes:
      total: rows of one pass (``N``), or None when unknown.
      largest_batch: the most rows one step takes, or None when unknown.
      what: how the data is named in messages (``"arrays with"``, ...),
        followed by the number of rows.
    """

    total: int | None
    largest_batch: int | None
    what: str


def rows_of_fit_data(x: Any, batch_size: int | None, validation_split: float = 0.0) -> FitRows:
    """The rows ``fit(x, batch_size=..., validation_split=...)`` trains on (module docstring)."""
    if isinstance(x, tf.data.Dataset):
        return _dataset_rows(x)
    leaves = tf.nest.flatten(x)
    if leaves and all(hasattr(leaf, "shape") and len(leaf.shape) > 0 for leaf in leaves):
        rows = leaves[0].shape[0]
        if rows is None:
            return FitRows(None, None, "arrays of unknown length")
        what = "the arrays have"
        if validation_split:
            rows = int(math.floor(rows * (1.0 - validation_split)))
            what = f"the arrays train on (validation_split={validation_split:g} holds out the rest)"
        return FitRows(int(rows), min(int(rows), batch_size or 32), what)
    return FitRows(None, None, f"a {type(x).__name__}")


def _dataset_rows(dataset: tf.data.Dataset) -> FitRows:
    cardinality = int(dataset.cardinality().numpy())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        return FitRows(None, None, "a dataset that repeats forever")
    if cardinality == tf.data.UNKNOWN_CARDINALITY:
        return FitRows(None, None, "a dataset of unknown cardinality")
    if repeats(dataset):
        return FitRows(None, None, "a dataset that repeats its elements (Dataset.repeat)")
    leaves = tf.nest.flatten(dataset.element_spec)
    if not leaves or any(getattr(spec, "shape", None) is None or spec.shape.rank in (None, 0) for spec in leaves):
        return FitRows(None, None, "a dataset whose elements are not batches")
    static = leaves[0].shape[0]
    if static is not None:
        return FitRows(cardinality * int(static), int(static), "one pass of the dataset has")
    first = lambda *element: tf.shape(tf.nest.flatten(element)[0], out_type=tf.int64)[0]  # noqa: E731
    total, largest = dataset.map(first).reduce(
        (tf.constant(0, tf.int64), tf.constant(0, tf.int64)),
        lambda acc, rows: (acc[0] + rows, tf.maximum(acc[1], rows)),
    )
    return FitRows(int(total.numpy()), int(largest.numpy()), "one pass of the dataset has")
