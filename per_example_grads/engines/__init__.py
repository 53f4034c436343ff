"""How per-example gradients are computed: one module per engine.

Importing this package registers every engine in ``ENGINES``; ``selection``
holds the rule ``method="auto"`` follows.
"""

from per_example_grads.engines import (  # noqa: F401  (registers)
    grouped,  # noqa: F401  (the layer-wise engine's per-unit forms)
    jacobian,
    layerwise,
    loop,
    vectorized,
    weight_copies,
)
from per_example_grads.engines.base import ENGINES, Engine, register_engine

__all__ = ["ENGINES", "Engine", "register_engine"]
