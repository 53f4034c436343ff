"""per_example_grads: fast per-example gradients for TensorFlow 2 / Keras 3.

    import per_example_grads as peg
    grads = peg.per_example_gradients(model, loss_fn, x, y)
    # grads[k].shape == [B, *model.trainable_variables[k].shape]
"""

from per_example_grads import dp, keras  # noqa: F401  (peg.dp.*, peg.keras.DPModel)
from per_example_grads import diagnostics  # noqa: F401  (peg.diagnostics.*)
from per_example_grads.accumulation import GradientAccumulator
from per_example_grads.engines.selection import METHODS
from per_example_grads.errors import EngineError, EngineFallbackWarning, InvalidLossError
from per_example_grads.clipping import clipped_gradients
from per_example_grads.gradients import per_example_gradients, per_example_norms
from per_example_grads.layerwise import LayerRule, register_layer_rule
from per_example_grads.per_example_slices import PerExampleSlices
from per_example_grads.transfer import compute_gradients, export_gradients, import_gradients
from per_example_grads.transforms import (
    clip_by_global_norm,
    global_norms,
    mean_examples,
    per_variable_norms,
    sum_examples,
)

__version__ = "0.1.0"

__all__ = [
    "METHODS",
    "EngineError",
    "GradientAccumulator",
    "EngineFallbackWarning",
    "InvalidLossError",
    "LayerRule",
    "PerExampleSlices",
    "clip_by_global_norm",
    "clipped_gradients",
    "compute_gradients",
    "dp",
    "export_gradients",
    "global_norms",
    "import_gradients",
    "keras",
    "mean_examples",
    "per_example_gradients",
    "per_example_norms",
    "per_variable_norms",
    "register_layer_rule",
    "sum_examples",
]
