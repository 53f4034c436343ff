"""Rebuilding a model for private training: BatchNormalization out, weights kept.

BatchNormalization in training mode normalizes each example with statistics
of the whole batch, so one example's gradient depends on the others and
per-example clipping no longer bounds its contribution (``check_model``
refuses such models). ``fix_model`` rebuilds a Sequential or Functional model
with each ``BatchNormalization`` replaced:

- ``batch_norm="group_norm"`` (default, for training from scratch):
  ``GroupNormalization`` over the same channel axis, with
  the largest divisor of its channel count up to ``groups`` as its group
  count (32 by default, as Wu & He, 2018), the
  same ``epsilon``, ``center`` and ``scale``. Its per-channel ``gamma`` and
  ``beta`` carry BatchNormalization's over; the moving statistics have no
  counterpart and are dropped.
- ``batch_norm="freeze"`` (for fine-tuning pretrained weights): the same
  BatchNormalization layer, with every weight kept and ``trainable=False``,
  so Keras runs it in inference mode (moving statistics, no batch coupling)
  and its ``gamma`` and ``beta`` are not trained.

Every other layer is rebuilt from its config and gets its weights back, and
the raw Keras operations a Functional graph records (``x + 3.0`` in
MobileNetV3's hard-swish is a ``keras.ops`` ``Add``, not a layer) are rebuilt
in place, so the fixed model computes what the original does except in the
replaced layers (with ``"freeze"``, called in inference mode, exactly what
the original computes). Every ``keras.applications`` model can be fixed.

    >>> import keras, per_example_grads as peg
    >>> model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(16, 3),
    ...                           keras.layers.BatchNormalization(), keras.layers.Flatten(),
    ...                           keras.layers.Dense(10)])
    >>> fixed, changes = peg.dp.fix_model(model, return_changes=True)
    >>> [type(l).__name__ for l in fixed.layers]
    ['Conv2D', 'GroupNormalization', 'Flatten', 'Dense']
    >>> changes[0]  # doctest: +ELLIPSIS
    "'batch_normalization...' (BatchNormalization) -> GroupNormalization(groups=16, axis=-1): gamma and beta kept, moving statistics dropped"
"""

from __future__ import annotations

from typing import Any

import keras

BATCH_NORM_FIXES = ("group_norm", "freeze")


def fix_model(
    model: keras.Model,
    *,
    batch_norm: str = "group_norm",
    groups: int = 32,
    return_changes: bool = False,
) -> keras.Model | tuple[keras.Model, list[str]]:
    """A copy of ``model`` without batch coupling, with its weights; see the module docstring.

    Args:
      model: a Sequential or Functional Keras model (nested ones are rebuilt
        too). ``model`` itself is left unchanged.
      batch_norm: ``"group_norm"`` or ``"freeze"``.
      groups: the most groups a GroupNormalization gets; a layer with ``C``
        channels gets the largest divisor of ``C`` up to ``groups``.
      return_changes: also return the list of what was changed, one line per
        layer (empty if the model had no BatchNormalization).

    Returns:
      The rebuilt model, or ``(model, changes)``.

    Raises:
      ValueError: for a subclassed model (its ``call`` cannot be rebuilt from
        the layer graph: replace BatchNormalization in its code), or a bad
        ``batch_norm`` or ``groups``.
    """
    if batch_norm not in BATCH_NORM_FIXES:
        raise ValueError(f"batch_norm must be one of {list(BATCH_NORM_FIXES)}; got {batch_norm!r}.")
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"model must be a Sequential or Functional Keras model; got {type(model).__name__} {model!r:.80}."
        )
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int; got {groups!r}.")
    if not _is_graph_model(model):
        raise ValueError(
            f"fix_model rebuilds Sequential and Functional models; {type(model).__name__} is subclassed. "
            "Replace keras.layers.BatchNormalization in its code with keras.layers.GroupNormalization, "
            "or set each BatchNormalization layer's trainable = False to run it in inference mode."
        )
    pairs: list[tuple[keras.layers.Layer, keras.layers.Layer]] = []
    changes: list[str] = []

    def clone(layer: keras.Operation) -> keras.Operation:
        if not isinstance(layer, keras.layers.Layer):
            return _clone_operation(layer)
        if isinstance(layer, keras.layers.BatchNormalization) and batch_norm == "group_norm":
            new = _group_norm_for(layer, groups)
            changes.append(
                f"'{layer.name}' (BatchNormalization) -> GroupNormalization(groups={new.groups}, axis={new.axis}): "
                "gamma and beta kept, moving statistics dropped"
            )
        else:
            new = layer.__class__.from_config(layer.get_config())
            if isinstance(layer, keras.layers.BatchNormalization):
                new.trainable = False
                changes.append(f"'{layer.name}' (BatchNormalization) frozen: inference mode, all weights kept")
        pairs.append((layer, new))
        return new

    def call(layer: keras.layers.Layer, *args, **kwargs):
        if isinstance(layer, keras.layers.GroupNormalization):
            kwargs.pop("mask", None)  # recorded for BatchNormalization's call; GroupNormalization takes none
        return layer(*args, **kwargs)

    graph_call = {} if isinstance(model, keras.Sequential) else {"call_function": call}
    fixed = keras.models.clone_model(model, clone_function=clone, recursive=True, **graph_call)
    for old, new in pairs:
        _copy_weights(old, new)
    return (fixed, changes) if return_changes else fixed


def _is_graph_model(model: Any) -> bool:
    """Sequential or Functional: a model whose layer graph ``clone_model`` can rebuild."""
    from keras.src.models.functional import Functional  # keras.Model(inputs, outputs) builds one

    return isinstance(model, (keras.Sequential, Functional))


def _clone_operation(op: keras.Operation) -> keras.Operation:
    """A copy of a raw Keras operation in the graph (``x + 3.0`` records ``keras.ops.Add``).

    Operations have no weights, so the original is shared when its constructor
    arguments cannot be serialized (Keras then has no config to rebuild it from).
    """
    try:
        return op.__class__.from_config(op.get_config())
    except (NotImplementedError, TypeError, ValueError):
        return op


def _group_norm_for(layer: keras.layers.BatchNormalization, groups: int) -> keras.layers.GroupNormalization:
    axis = layer.axis if isinstance(layer.axis, int) else layer.axis[0]
    channels = int(layer.moving_mean.shape[0])
    return keras.layers.GroupNormalization(
        groups=max(d for d in range(1, min(channels, groups) + 1) if channels % d == 0),
        axis=axis,
        epsilon=layer.epsilon,
        center=layer.center,
        scale=layer.scale,
        name=layer.name,
        dtype=layer.dtype_policy,
    )


def _copy_weights(old: keras.layers.Layer, new: keras.layers.Layer) -> None:
    """``old``'s weights into ``new``: all of them, or for BatchNorm -> GroupNorm its gamma and beta."""
    if isinstance(old, keras.layers.BatchNormalization) and isinstance(new, keras.layers.GroupNormalization):
        for name in ("gamma", "beta"):
            if getattr(old, name, None) is not None:
                getattr(new, name).assign(getattr(old, name))
        return
    if old.weights:
        new.set_weights(old.get_weights())
