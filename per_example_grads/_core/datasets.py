"""What a ``tf.data`` pipeline's chain of datasets shows about its examples."""

from __future__ import annotations

import tensorflow as tf


def repeats(dataset: tf.data.Dataset) -> bool:
    """Whether a ``repeat`` stands anywhere in the chain of datasets ``dataset`` was made from.

    One pass of a repeated dataset shows each example several times, so its
    rows are not its number of examples. The chain is followed through the
    ``_input_dataset`` of TensorFlow's unary datasets (and the inputs of zips
    and concatenations); a transformation that hides its input is not seen.
    """
    seen, stack = set(), [dataset]
    while stack:
        d = stack.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        if type(d).__name__ == "_RepeatDataset":
            return True
        for name in ("_input_dataset", "_dataset_to_concatenate"):
            if isinstance(getattr(d, name, None), tf.data.Dataset):
                stack.append(getattr(d, name))
        stack.extend(x for x in tf.nest.flatten(getattr(d, "_datasets", ())) if isinstance(x, tf.data.Dataset))
    return False
