"""per_example_grads: fast per-example gradients for TensorFlow 2 / Keras 3.

    import per_example_grads as peg
    grads = peg.per_example_gradients(model, loss_fn, x, y)
    # grads[k].shape == [B, *model.trainable_variables[k].shape]

Importing the package is cheap: TensorFlow is imported on first use of a
name below (PEP 562 ``__getattr__``), so ``pegrad --help`` answers without
loading it.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from per_example_grads import _lazy

__version__ = "0.1.0"

# The public name -> the module that defines it.
_EXPORTS = {
    "METHODS": "per_example_grads.engines.selection",
    "EngineError": "per_example_grads.errors",
    "EngineFallbackWarning": "per_example_grads.errors",
    "GradientAccumulator": "per_example_grads.dp.accumulation",  # the same class as peg.dp.GradientAccumulator
    "InvalidLossError": "per_example_grads.errors",
    "LayerRule": "per_example_grads.rules",
    "PerExampleSlices": "per_example_grads.per_example_slices",
    "clip_by_global_norm": "per_example_grads.transforms",
    "clipped_gradients": "per_example_grads.clipping",
    "compute_gradients": "per_example_grads.grads_and_vars",
    "export_gradients": "per_example_grads.transfer",
    "global_norms": "per_example_grads.transforms",
    "import_gradients": "per_example_grads.transfer",
    "mean_examples": "per_example_grads.transforms",
    "per_example_gradients": "per_example_grads.gradients",
    "per_example_norms": "per_example_grads.gradients",
    "per_variable_norms": "per_example_grads.transforms",
    "register_layer_rule": "per_example_grads.rules",
    "sum_examples": "per_example_grads.transforms",
}
# Subpackages reached as attributes: peg.dp.*, peg.keras.DPModel, ...
_SUBPACKAGES = ("diagnostics", "dp", "keras", "rules")

__all__ = sorted([*_EXPORTS, *_SUBPACKAGES], key=str.lower)

if _TYPE_CHECKING:  # what static tools and IDEs see; at run time __getattr__ does this
    from per_example_grads import diagnostics, dp, keras, rules  # noqa: F401
    from per_example_grads.clipping import clipped_gradients  # noqa: F401
    from per_example_grads.dp.accumulation import GradientAccumulator  # noqa: F401
    from per_example_grads.engines.selection import METHODS  # noqa: F401
    from per_example_grads.errors import EngineError, EngineFallbackWarning, InvalidLossError  # noqa: F401
    from per_example_grads.gradients import per_example_gradients, per_example_norms  # noqa: F401
    from per_example_grads.grads_and_vars import compute_gradients  # noqa: F401
    from per_example_grads.per_example_slices import PerExampleSlices  # noqa: F401
    from per_example_grads.rules import LayerRule, register_layer_rule  # noqa: F401
    from per_example_grads.transfer import export_gradients, import_gradients  # noqa: F401
    from per_example_grads.transforms import (  # noqa: F401
        clip_by_global_norm,
        global_norms,
        mean_examples,
        per_variable_norms,
        sum_examples,
    )


__getattr__, __dir__ = _lazy.exports(globals(), _EXPORTS)
