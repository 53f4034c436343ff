"""``method="vectorized"``: ``tf.vectorized_map`` over a per-example tape.

Cost: one vectorized forward and backward pass over the batch, about the cost
of the batch gradient plus the per-example outer products, and memory for
``B x P`` gradients. Ops without a vectorization rule run in a while loop
(TensorFlow warns when that happens; its note to itself about
Conv2DBackpropFilter is dropped, see ``per_example_grads._core.quiet``).
"""

from __future__ import annotations

import functools

import tensorflow as tf

from per_example_grads._core import model_inspection
from per_example_grads._core.quiet import quiet_vectorization
from per_example_grads.engines.base import example_gradient, register_engine


def why_not(problem) -> str | None:
    """Refuses models with a layer known to crash ``tf.vectorized_map``."""
    crashers = model_inspection.vectorization_crashers(problem.model)
    if crashers:
        return (
            f"the model has {model_inspection.describe(crashers)}, which can "
            "crash tf.vectorized_map with a segmentation fault"
        )
    return None


@register_engine(name="vectorized", isolates_examples=True, why_not=why_not)
def vectorized(problem, batch) -> list:
    """``tf.vectorized_map(grad of loss_i)`` -> list of ``[B, *var.shape]``."""
    with quiet_vectorization():
        return tf.vectorized_map(functools.partial(example_gradient, problem), batch)
