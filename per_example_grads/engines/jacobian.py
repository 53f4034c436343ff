"""``method="jacobian"``: ``GradientTape.jacobian`` of the ``[B]`` loss vector.

One batched forward pass, then the backward pass vectorized over the ``B``
one-hot output directions, so it costs about ``B`` batch backward passes
(``O(B^2)`` work) though they run in parallel. Because the forward pass is
shared, a NaN or Inf in one example can reach others' gradients (a ``0 * NaN``
in a matmul's backward pass), which is why ``method="auto"`` never picks it.
"""

from __future__ import annotations

import tensorflow as tf

from per_example_grads._core.quiet import quiet_vectorization
from per_example_grads.engines.base import register_engine
from per_example_grads._core.tape import dense_or_zeros, watch_variables


@register_engine(name="jacobian", isolates_examples=False)
def jacobian(problem, batch) -> list:
    """``d losses[i] / d var`` for every i -> list of ``[B, *var.shape]``."""
    with tf.GradientTape() as tape:
        watch_variables(tape, problem.variables)
        losses = problem.losses(batch)
    with quiet_vectorization():
        jac = tape.jacobian(losses, problem.variables, experimental_use_pfor=True)
    # With a dynamic B of 0, pfor loses the variable's static shape; restore it.
    b = tf.shape(losses)[:1]
    jac = dense_or_zeros(jac, problem.variables, leading_shape=b)
    return [
        tf.ensure_shape(tf.reshape(j, tf.concat([b, v.shape], 0)), [None, *v.shape])
        for j, v in zip(jac, problem.variables)
    ]
