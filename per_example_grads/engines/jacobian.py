"""``method="jacobian"``: ``GradientTape.jacobian`` of the ``[B]`` loss vector.

One batched forward pass, then the backward pass vectorized over the ``B``
one-hot output directions, so it costs about ``B`` batch backward passes
(``O(B^2)`` work) though they run in parallel. Because the forward pass is
shared, a NaN or Inf in one example can reach others' gradients (a ``0 * NaN``
in a matmul's backward pass), which is why ``method="auto"`` never picks it.
"""

from __future__ import annotations

import tensorflow as tf

from per_example_grads._core import pfor_limits
from per_example_grads._core.quiet import quiet_vectorization
from per_example_grads._core.tape import dense_or_zeros, watch_variables
from per_example_grads.engines.base import register_engine


def why_not_batch(problem, batch) -> str | None:
    """Refuses a model whose backward pass has an op that pfor would push past its CPU kernel's rank.

    ``tape.jacobian`` vectorizes only the backward pass (over the ``B``
    output directions), so only the ops ``tape.gradient`` adds are checked, at
    the batch's shapes (a batch of 1 has the unit axis that makes a
    broadcasting batch matmul a hazard); see
    ``per_example_grads._core.pfor_limits``.
    """

    def find() -> list[str]:
        specs = tf.nest.map_structure(lambda t: tf.TensorSpec.from_tensor(tf.convert_to_tensor(t)), batch)
        found = []

        def backward(b):
            with tf.GradientTape() as tape, tf.name_scope("pfor_check"):  # as vectorized_map's
                watch_variables(tape, problem.variables)
                losses = problem.losses(b)
            graph = tf.compat.v1.get_default_graph()
            start = len(graph.get_operations())
            tape.gradient(losses, problem.variables, output_gradients=tf.ones_like(losses))
            found.extend(pfor_limits.over_limit_ops(graph.get_operations()[start:], graph))
            return losses

        tf.function(backward, autograph=False).get_concrete_function(specs)
        return found

    return pfor_limits.refusal(problem.cache, "jacobian_hazards", find, "its vectorized backward pass")


@register_engine(name="jacobian", isolates_examples=False, why_not_batch=why_not_batch)
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
