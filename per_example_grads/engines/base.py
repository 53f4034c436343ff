"""The engine interface and registry.

An engine turns a ``Problem`` and a ``Batch`` into per-example gradients: a
list aligned with ``problem.variables`` whose k-th entry has shape
``[B, *variables[k].shape]``, entry ``i`` being the gradient of example i's
own (weighted) loss. Variables the loss does not reach get zeros.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import keras
import tensorflow as tf

from per_example_grads.batch import Batch
from per_example_grads.problem import Problem

EngineFn = Callable[[Problem, Batch], list]


@dataclasses.dataclass(frozen=True)
class Engine:
    """A registered way of computing per-example gradients.

    Attributes:
      name: the ``method=`` string.
      compute: ``(problem, batch) -> list of [B, *var.shape]``.
      isolates_examples: True if a NaN/Inf in one example can never reach
        another example's gradient.
      why_not: ``(problem, training) -> str | None``: why the engine must not
        run on this problem (it would crash or be wrong), or None.
    """

    name: str
    compute: EngineFn
    isolates_examples: bool
    why_not: Callable[[Problem, bool], str | None] = lambda problem, training: None


ENGINES: dict[str, Engine] = {}


def register_engine(**properties) -> Callable[[EngineFn], EngineFn]:
    """Decorator: ``@register_engine(name=..., isolates_examples=..., why_not=...)``."""

    def wrap(fn: EngineFn) -> EngineFn:
        ENGINES[properties["name"]] = Engine(compute=fn, **properties)
        return fn

    return wrap


def watch_variables(tape: tf.GradientTape, variables) -> None:
    """Makes ``tape`` watch ``variables``, non-trainable ones included.

    Trainable variables are watched when the tape sees them read; a
    non-trainable one must be watched by hand, through its ``tf.Variable``
    (``keras.Variable.value``), since ``tape.watch`` rejects Keras variables.
    """
    for v in variables:
        if not v.trainable:
            tape.watch(v.value if isinstance(v, keras.Variable) else v)


@tf.autograph.experimental.do_not_convert  # plain Python; nothing for AutoGraph to convert
def example_gradient(problem: Problem, example: Batch) -> list:
    """Gradients of one example's loss: ``list of [*var.shape]``."""
    with tf.GradientTape() as tape:
        watch_variables(tape, problem.variables)
        loss = problem.example_loss(example)
    return dense_or_zeros(tape.gradient(loss, problem.variables), problem.variables)


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

    return [
        zeros(v)
        if g is None
        else tf.convert_to_tensor(g)
        for g, v in zip(grads, variables)
    ]
