"""``method="vectorized"``: ``tf.vectorized_map`` over a per-example tape.

Cost: one vectorized forward and backward pass over the batch, about the cost
of the batch gradient plus the per-example outer products, and memory for
``B x P`` gradients. Ops without a vectorization rule run in a while loop
(TensorFlow warns when that happens).
"""

from __future__ import annotations

import functools

import tensorflow as tf

from per_example_grads.engines.base import example_gradient, register_engine


@register_engine(name="vectorized", uses_vectorized_map=True, isolates_examples=True)
def vectorized(problem, batch) -> list:
    """``tf.vectorized_map(grad of loss_i)`` -> list of ``[B, *var.shape]``."""
    return tf.vectorized_map(functools.partial(example_gradient, problem), batch)
