"""The thing every engine differentiates: one loss per example.

A ``Problem`` bundles the forward function, the per-example loss and the
variables; engines only ever call ``losses`` (a whole batch) or
``example_loss`` (one example) and differentiate with respect to
``variables``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from per_example_grads._core import model_inspection
from per_example_grads._core.batch import Batch, add_batch_axis
from per_example_grads._core.losses import PerExampleLoss, as_per_example_loss


@dataclasses.dataclass(frozen=True)
class Problem:
    """Per-example losses of ``model`` with respect to ``variables``.

    Attributes:
      model: the Keras model or callable (kept for inspection by engines).
      forward: ``x -> y_pred`` with the ``training`` flag already applied.
      loss: ``(y_true, y_pred) -> [B]``.
      variables: the variables to differentiate, each ``[*var.shape]``.
      training: the mode the model runs in.
      batch_coupling: whether a layer mixes examples in this mode (batch
        statistics, accepted with ``allow_batch_coupling``).
      cache: what engines work out once per call (the layer-wise engine's
        watch plan), keyed by name.
    """

    model: Any
    forward: Callable[[Any], Any]
    loss: PerExampleLoss
    variables: tuple
    training: bool = False
    batch_coupling: bool = False
    cache: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def losses(self, batch: Batch) -> tf.Tensor:
        """``[B]`` losses, each multiplied by its ``sample_weight`` if given."""
        return self.predictions_and_losses(batch)[1]

    def predictions_and_losses(self, batch: Batch) -> tuple[Any, tf.Tensor]:
        """The model's outputs on the batch, and ``losses``."""
        predictions = self.forward(batch["x"])
        values = self.loss(batch.get("y"), predictions)
        if "sample_weight" in batch:
            values = values * tf.cast(batch["sample_weight"], values.dtype)
        return predictions, values

    def example_loss(self, example: Batch) -> tf.Tensor:
        """The scalar loss of one example (leaves without the batch axis)."""
        return self.losses(add_batch_axis(example))[0]

    def gradient_specs(self) -> list[tf.TensorSpec]:
        """One ``TensorSpec(var.shape, var.dtype)`` per variable."""
        return [tf.TensorSpec(v.shape, v.dtype) for v in self.variables]


def make_forward(model: Any, training: bool) -> Callable[[Any], Any]:
    """``x -> model(x, training=training)`` when the model takes ``training``."""
    if isinstance(model, keras.layers.Layer) or _accepts_training(model):
        return lambda x: model(x, training=training)
    return model


def resolve_variables(model: Any, variables: Sequence | None) -> tuple:
    """The variables to differentiate: ``variables`` or ``model.trainable_variables``."""
    if variables is None:
        if not hasattr(model, "trainable_variables"):
            raise TypeError(
                "model is a plain callable, so pass variables=[...] listing the variables to differentiate."
            )
        variables = model.trainable_variables
    variables = tuple(variables)
    if not variables:
        raise ValueError(
            "model has no trainable variables to differentiate: build it first "
            "(call it once, or give it an Input), unfreeze some layers, or pass "
            "variables=[...]."
        )
    for i, v in enumerate(variables):
        if not tf.as_dtype(v.dtype).is_floating:
            raise TypeError(
                f"variables[{i}] ('{getattr(v, 'path', v.name)}') has dtype "
                f"{tf.as_dtype(v.dtype).name}; only floating-point variables have gradients."
            )
    return variables


def _accepts_training(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "training" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def make_problem(model, loss_fn, variables, training: bool, allow_batch_coupling: bool) -> Problem:
    """Validates the model, loss and variables; returns the ``Problem`` engines differentiate.

    Raises ``ValueError`` for batch-coupling layers in training mode unless
    ``allow_batch_coupling``.
    """
    coupling = model_inspection.batch_coupling_layers(model, training)
    if coupling and not allow_batch_coupling:
        raise ValueError(
            "Per-example gradients are ill-defined with training=True: "
            f"{model_inspection.describe(coupling)} normalizes each example "
            "with statistics of the whole batch. Replace it with "
            "keras.layers.GroupNormalization (or LayerNormalization), call with "
            "training=False, or pass allow_batch_coupling=True to accept "
            "per-example batch statistics."
        )
    return Problem(
        model=model,
        forward=make_forward(model, training),
        loss=as_per_example_loss(loss_fn),
        variables=resolve_variables(model, variables),
        training=training,
        batch_coupling=bool(coupling),
    )
