"""``method="weight_copies"``: Goodfellow's weight-copy trick.

Every example ``i`` is tied to its own copy ``W_i = identity(W)`` of each
weight, ``[B, *var.shape]`` in all. The per-example forward passes run with
their copies substituted for the Keras variables (``keras.StatelessScope``),
and a single backward pass of ``sum_i loss_i(W_i)`` gives
``d/dW_i sum_j loss_j = d loss_i / dW_i``: the per-example gradients, as the
gradient with respect to the copies.

The forward passes run in a ``tf.map_fn`` loop, not ``tf.vectorized_map``, so
this engine is safe on layers that crash vectorization. It needs Keras
variables, and because the substituted call cannot advance random seeds it
refuses random layers (Dropout, noise) in training mode.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from per_example_grads._core import model_inspection
from per_example_grads._core.batch import batch_size
from per_example_grads._core.example_ops import map_examples
from per_example_grads._core.tape import dense_or_zeros
from per_example_grads.engines.base import register_engine


def why_not(problem) -> str | None:
    """Why weight copies cannot be exact for this problem, or None."""
    not_keras = [v for v in problem.variables if not isinstance(v, keras.Variable)]
    if not_keras:
        return (
            "it substitutes Keras variables, but "
            f"{len(not_keras)} of the variables are not keras.Variable "
            f"(first: {getattr(not_keras[0], 'name', not_keras[0])}); use "
            "method='vectorized' or 'loop'"
        )
    random = model_inspection.random_layers(problem.model) if problem.training else []
    if random:
        return (
            "it cannot give examples independent random draws in training "
            f"mode, and the model has random layers: {model_inspection.describe(random)}; "
            "use method='vectorized' or 'loop', or training=False"
        )
    return None


@register_engine(name="weight_copies", isolates_examples=True, why_not=why_not)
def weight_copies(problem, batch) -> list:
    """Gradient of ``sum_i loss_i(W_i)`` w.r.t. copies ``W_i`` -> list of ``[B, *var.shape]``."""
    b = batch_size(batch)
    copies = [tf.repeat(tf.expand_dims(tf.identity(v), 0), b, axis=0) for v in problem.variables]

    @tf.autograph.experimental.do_not_convert
    def example_loss(args):
        example, weights = args
        with keras.StatelessScope(state_mapping=list(zip(problem.variables, weights))):
            return tf.cast(problem.example_loss(example), loss_dtype)

    # Summing in at least float32 (float64 if any variable is float64) keeps
    # mixed-precision losses from rounding before the backward pass.
    loss_dtype = max((tf.as_dtype(v.dtype) for v in problem.variables), key=lambda d: d.size)
    loss_dtype = loss_dtype if loss_dtype.size >= 4 else tf.float32
    with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(copies)
        losses = map_examples(
            example_loss,
            (batch, copies),
            fn_output_signature=tf.TensorSpec([], loss_dtype),
        )
        total = tf.reduce_sum(losses)
    return dense_or_zeros(tape.gradient(total, copies), copies)
