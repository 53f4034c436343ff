"""Whether the ops being built will be compiled by XLA.

Some closed forms need another formulation under XLA: it wants static shapes
(the embedding rule's data-dependent ``tf.where`` gave wrong norms there,
without an error), and it cannot compile ``tf.vectorized_map`` over a layer
that runs its own loop (an LSTM: it raises). TensorFlow only says so through
its private ``control_flow_util``; this module is the one place that reads
it, and ``tests/test_layerwise_xla.py`` fails loudly if it stops working.
"""

from __future__ import annotations

import tensorflow as tf


def in_xla_context() -> bool:
    """True inside ``tf.function(jit_compile=True)`` (what Keras ``jit_compile`` uses), nested functions included.

    If TensorFlow moves the check, True: the XLA-safe formulations are right
    everywhere, only slower without XLA.
    """
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - TensorFlow moved it
        return True
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())
