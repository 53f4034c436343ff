"""Keras integration: a private model and callbacks for private training."""

from per_example_grads.keras.callbacks import EpsilonCallback
from per_example_grads.keras.dp_model import DPModel

__all__ = ["DPModel", "EpsilonCallback"]
