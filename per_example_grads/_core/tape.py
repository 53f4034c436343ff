"""GradientTape helpers shared by the engines and the layer-local rule: which variables a tape watches, and dense gradients.

Core: it imports nothing from the package, so rules and engines may both use it.
"""

from __future__ import annotations

import keras
import tensorflow as tf


def watch_variables(tape: tf.GradientTape, variables) -> None:
    """Makes ``tape`` watch ``variables``, non-trainable ones included.

    Trainable variables are watched when the tape sees them read; a
    non-trainable one must be watched by hand, through its ``tf.Variable``
    (``keras.Variable.value``), since ``tape.watch`` rejects Keras variables.
    """
    for v in variables:
        if not v.trainable:
            tape.watch(v.value if isinstance(v, keras.Variable) else v)


def dense_or_zeros(grads, variables, leading_shape=None) -> list:
    """Dense gradients, with zeros of ``[*leading_shape, *var.shape]`` for ``None``.

    ``leading_shape`` is None or a 1-D int32 tensor.

    Embedding gradients arrive as IndexedSlices, and variables the loss does
    not reach as None. (TensorFlow's own ``UnconnectedGradients.ZERO`` cannot
    be used: it fails on Keras variables, whose ``dtype`` is a string.)
    """

    def zeros(v):
        if leading_shape is None:
            return tf.zeros(v.shape, v.dtype)
        return tf.zeros(tf.concat([leading_shape, tf.constant(v.shape, tf.int32)], 0), v.dtype)

    return [zeros(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, variables)]
