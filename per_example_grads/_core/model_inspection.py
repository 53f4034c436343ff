"""What the library needs to know about a model's layers.

This is the one module that walks Keras layer trees. It relies on
``Layer._flatten_layers``, a private Keras 3 method that has been stable since
Keras 3.0; ``tests/test_model_inspection.py`` fails loudly if it changes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import keras

# Layers whose output for one example depends on the other examples of the
# batch when called with ``training=True``.
BATCH_COUPLING_LAYERS: tuple[type, ...] = (keras.layers.BatchNormalization,)


def iter_layers(model: Any) -> Iterator[keras.layers.Layer]:
    """Yields ``model`` (if it is a layer) and every layer nested in it, once."""
    if not isinstance(model, keras.layers.Layer):
        return
    yield from model._flatten_layers(include_self=True, recursive=True)


def direct_sublayers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers ``layer`` tracks directly (one level down), in creation order."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def own_variables(layer: keras.layers.Layer) -> list:
    """Variables created by ``layer`` itself, not by one of its sublayers."""
    below = {id(v) for sub in direct_sublayers(layer) for v in sub.weights}
    return [v for v in layer.weights if id(v) not in below]


def batch_coupling_layers(model: Any, training: bool) -> list[keras.layers.Layer]:
    """Layers that mix examples of a batch when called with ``training``.

    BatchNormalization normalizes with batch statistics only in training mode
    and only while the layer itself is trainable (Keras runs a frozen
    BatchNormalization in inference mode).
    """
    if not training:
        return []
    return [l for l in iter_layers(model) if isinstance(l, BATCH_COUPLING_LAYERS) and l.trainable]


def random_layers(model: Any) -> list[keras.layers.Layer]:
    """Layers that draw random numbers in training mode (Dropout, noise layers).

    Recognized by the ``SeedGenerator`` Keras gives every random layer; a layer
    with a ``rate`` of 0 draws nothing and is left out.
    """
    found = []
    for layer in iter_layers(model):
        has_seed = any(isinstance(v, keras.random.SeedGenerator) for v in vars(layer).values())
        if has_seed and getattr(layer, "rate", 1.0) != 0:
            found.append(layer)
    return found


def declared_input_dtypes(model: Any) -> list[str] | None:
    """The dtypes of a Functional/Sequential model's inputs, flattened, if known."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    return [keras.backend.standardize_dtype(t.dtype) for t in inputs]


def describe(layers: list[keras.layers.Layer]) -> str:
    """``"'mha' (MultiHeadAttention), ..."`` for messages."""
    return ", ".join(f"'{l.name}' ({type(l).__name__})" for l in layers)


@contextlib.contextmanager
def replaced_on_instances(replacements: Iterable[tuple[Any, str, Any]]) -> Iterator[None]:
    """Within the block, each ``(obj, name, value)`` sets ``obj.name = value`` on the instance; restored on the way out.

    On the instance, where ``Layer.__call__`` looks ``call`` up (and any
    method is shadowed). The triples are taken one at a time, each set
    before the next is read, so a replacement may wrap what an earlier one
    set. On exit every instance gets back exactly what it had (its own
    attribute, or none), also when setting a later one raised.
    """
    saved = []
    try:
        for obj, name, value in replacements:
            saved.append((obj, name, name in vars(obj), vars(obj).get(name)))
            object.__setattr__(obj, name, value)
        yield
    finally:
        for obj, name, had, previous in reversed(saved):
            if had:
                object.__setattr__(obj, name, previous)
            else:
                object.__delattr__(obj, name)


def replaced_calls(replacements: Iterable[tuple[keras.layers.Layer, Callable]]):
    """``replaced_on_instances`` of each ``(layer, call)``'s ``layer.call`` (a context manager)."""
    return replaced_on_instances((layer, "call", call) for layer, call in replacements)
