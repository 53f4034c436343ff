"""Per-layer rules of the layer-wise engine: the interface, the registry, and the built-in rules.

``rule.py`` holds the ``LayerRule`` interface and ``register_layer_rule``;
every other module is one layer family's rule and registers itself. Importing
this package (or any module in it) registers all built-in rules first, so a
rule a user registers for a built-in layer class is never overwritten later.

    import per_example_grads as peg
    peg.rules.register_layer_rule(MyLayer, MyLayerRule())
"""

from per_example_grads.rules import (  # noqa: F401,E402  (each registers its rules)
    conv,
    conv_transpose,
    dense,
    depthwise_conv,
    einsum_dense,
    embedding,
    hub_layers,
    local,
    lora,
    moe,
    normalization,
    patch_embedding,
    reversible_embedding,
    scale,
    t5_attention,
)
from per_example_grads.rules.rule import (
    LayerRule,
    per_example_squared_norms,
    register_layer_rule,
    rule_for,
    sum_to_shape,
    wide_squared_norms,
)

__all__ = [
    "LayerRule",
    "per_example_squared_norms",
    "register_layer_rule",
    "rule_for",
    "sum_to_shape",
    "wide_squared_norms",
]
