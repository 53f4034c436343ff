"""``method="loop"``: one example at a time, in a ``tf.map_fn`` loop.

The reference engine: ``B`` sequential forward and backward passes of batch
size 1. Slowest, but works for anything that runs on one example.
"""

from __future__ import annotations

import functools

from per_example_grads._core.example_ops import map_examples
from per_example_grads.engines.base import example_gradient, register_engine


@register_engine(name="loop", isolates_examples=True)
def loop(problem, batch) -> list:
    """``[grad of loss_i for i in range(B)]``, stacked -> list of ``[B, *var.shape]``."""
    return map_examples(
        functools.partial(example_gradient, problem),
        batch,
        fn_output_signature=problem.gradient_specs(),
    )
