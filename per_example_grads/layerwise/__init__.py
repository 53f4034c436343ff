"""The layer-wise engine: captured layer inputs and output gradients, closed forms per layer."""

from per_example_grads.layerwise.rule import (
    LayerRule,
    per_example_squared_norms,
    register_layer_rule,
    rule_for,
    sum_to_shape,
)

__all__ = ["LayerRule", "per_example_squared_norms", "register_layer_rule", "rule_for", "sum_to_shape"]
