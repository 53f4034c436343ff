"""How per-example gradients are computed: one module per engine.

Importing this package registers every engine in ``ENGINES``; ``selection``
holds the rule ``method="auto"`` follows.
"""

from per_example_grads.engines.base import ENGINES, Engine, register_engine
from per_example_grads.engines import jacobian, loop, vectorized, weight_copies  # noqa: F401  (registers)
from per_example_grads.layerwise import engine as _layerwise  # noqa: F401,E402  (registers "layerwise")

__all__ = ["ENGINES", "Engine", "register_engine"]
