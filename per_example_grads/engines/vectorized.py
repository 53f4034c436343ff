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

from per_example_grads._core import pfor_limits
from per_example_grads._core.quiet import quiet_vectorization
from per_example_grads.engines.base import example_gradient, register_engine


def why_not_batch(problem, batch) -> str | None:
    """Refuses a model whose one-example gradient graph has an op that pfor would push past its CPU kernel's rank.

    The graph of ``example_gradient`` (forward and backward of one example,
    shapes of ``batch`` without its batch axis) is traced once per call; see
    ``per_example_grads._core.pfor_limits``.
    """
    find = lambda: pfor_limits.vectorization_hazards(
        functools.partial(example_gradient, problem), pfor_limits.example_specs(batch)
    )
    return pfor_limits.refusal(problem.cache, "vectorized_hazards", find, "tf.vectorized_map")


@register_engine(name="vectorized", isolates_examples=True, why_not_batch=why_not_batch)
def vectorized(problem, batch) -> list:
    """``tf.vectorized_map(grad of loss_i)`` -> list of ``[B, *var.shape]``."""
    with quiet_vectorization():
        return tf.vectorized_map(functools.partial(example_gradient, problem), batch)
