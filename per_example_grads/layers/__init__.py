"""Closed-form and layer-local rules for the layer-wise engine, one module per family.

Importing this package registers every built-in rule with
``per_example_grads.layerwise.rule.register_layer_rule``.
"""

from per_example_grads.layers import conv, dense, einsum_dense, embedding, local, normalization, prelu  # noqa: F401
