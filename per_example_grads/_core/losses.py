"""Turning a user's loss into one loss value per example.

The engines need ``loss_i`` for every example ``i`` separately. Users hand us
anything from a plain function returning ``[B]`` to a ``keras.losses.Loss``
object configured with a batch-reducing ``reduction``; this module turns all of
them into one callable with a fixed contract:

``per_example_loss(y_true, y_pred) -> [B]`` (float), where trailing axes of the
user's result are averaged per example (over unmasked positions when the
prediction carries a Keras mask).
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from per_example_grads.errors import InvalidLossError

PerExampleLoss = Callable[[Any, Any], tf.Tensor]


def as_per_example_loss(loss_fn: Any) -> PerExampleLoss:
    """Adapts ``loss_fn`` to return a ``[B]`` vector of per-example losses.

    Args:
      loss_fn: a callable ``loss_fn(y_true, y_pred)`` returning ``[B]`` or
        ``[B, ...]``; a ``keras.losses.Loss`` instance with any ``reduction``
        (its unreduced ``call`` is used, so the reduction is ignored); or a
        Keras loss name such as ``"sparse_categorical_crossentropy"``.

    Returns:
      A callable ``(y_true, y_pred) -> [B]``.

    Raises:
      TypeError: if ``loss_fn`` is none of the above.
    """
    if isinstance(loss_fn, str):
        try:
            loss_fn = keras.losses.get(loss_fn)
        except ValueError as err:
            raise ValueError(f"loss_fn={loss_fn!r} is not a Keras loss name: {err}") from None
    if isinstance(loss_fn, keras.losses.Loss):
        loss_object = loss_fn

        def unreduced(y_true, y_pred):
            # Same input conversion as Loss.__call__, without its reduction.
            to_loss_dtype = lambda t: tf.cast(t, loss_object.dtype)
            return loss_object.call(
                tf.nest.map_structure(to_loss_dtype, y_true),
                tf.nest.map_structure(to_loss_dtype, y_pred),
            )

        raw = unreduced
    elif callable(loss_fn):
        raw = loss_fn
    else:
        raise TypeError(
            "loss_fn must be a callable loss_fn(y_true, y_pred) returning one "
            "loss per example, a keras.losses.Loss, or a Keras loss name; got "
            f"{type(loss_fn).__name__}."
        )

    def per_example_loss(y_true, y_pred) -> tf.Tensor:
        try:
            values = tf.convert_to_tensor(raw(y_true, y_pred))
        except (TypeError, AttributeError, ValueError) as err:
            if y_true is not None:
                raise
            raise InvalidLossError(
                f"y is None, but loss_fn needs labels: it raised {type(err).__name__}: {err}. "
                "Pass y (one label per example, leading axis B), or a loss_fn that ignores y_true."
            ) from err
        if values.shape.rank == 0:
            raise InvalidLossError(
                "loss_fn returned a scalar, but per-example gradients need one "
                "loss per example, shape [B] (or [B, ...], averaged per "
                "example). Use an unreduced loss, for example "
                "keras.losses.SparseCategoricalCrossentropy(reduction=None) or "
                "a function such as keras.losses.sparse_categorical_crossentropy."
            )
        if not values.dtype.is_floating:
            raise InvalidLossError(f"loss_fn must return floating-point losses; got {values.dtype.name}.")
        _check_leading_axis(values, y_pred)
        mask = _keras_mask(y_pred)
        if values.shape.rank is not None and values.shape.rank > 1:
            axes = list(range(1, values.shape.rank))
            if mask is not None and mask.shape.rank == values.shape.rank:
                weights = tf.cast(mask, values.dtype)
                total = tf.reduce_sum(values * weights, axis=axes)
                count = tf.reduce_sum(weights, axis=axes)
                values = tf.math.divide_no_nan(total, count)
            else:
                values = tf.reduce_mean(values, axis=axes)
        return values

    return per_example_loss


def _check_leading_axis(values: tf.Tensor, y_pred) -> None:
    """Refuses a loss whose leading axis is not the batch's (a batch-reduced ``[1]``, say).

    Checked when both sizes are known while tracing; a ``[1]`` loss against a
    batch of unknown size is checked when the step runs.
    """
    leaves = [t for t in tf.nest.flatten(y_pred) if tf.is_tensor(t) and t.shape.rank]
    if not leaves or values.shape.rank is None:
        return
    b, n = leaves[0].shape[0], values.shape[0]
    message = (
        f"loss_fn returned losses of shape {values.shape} for a batch of {b if b is not None else 'B'} "
        "predictions: the leading axis must hold one loss per example (shape [B] or [B, ...]). "
        "A batch-reduced loss (a mean over the batch, kept as shape [1]) would scale every "
        "per-example gradient by 1/B; use an unreduced loss."
    )
    if b is not None and n is not None:
        if b != n:
            raise InvalidLossError(message)
    elif n == 1:
        tf.debugging.assert_equal(tf.shape(leaves[0])[0], 1, message=message)


def _keras_mask(y_pred) -> tf.Tensor | None:
    leaves = tf.nest.flatten(y_pred)
    if len(leaves) != 1:
        return None
    return getattr(leaves[0], "_keras_mask", None)
