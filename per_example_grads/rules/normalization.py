"""LayerNormalization, RMSNormalization, GroupNormalization and BatchNormalization in inference: closed forms.

LayerNormalization normalizes each example on its own: with the normalized
input ``xh = (x - mean) / sqrt(var + eps)`` (``x / sqrt(var + eps)`` with
``rms_scaling``; moments over ``layer.axis``) the output is
``y = xh * gamma + beta``, ``gamma`` and ``beta`` of shape ``[*x.shape[axis]]``
broadcast over the other axes. With the loss gradient ``g = dL/dy``, example
n's gradients are

- ``dL_n/dgamma = sum_{other axes} g_n * xh_n`` and
- ``dL_n/dbeta = sum_{other axes} g_n``,

``[B, *gamma.shape]`` each: no recomputation of the layer per example. The
rule computes ``y`` as Keras does, ``x * (inv gamma) + (beta - mean inv
gamma)``, whose rounding differs from ``xh * gamma + beta`` (the model must
compute what it computes without the engine, bit for bit), by Keras's own
ops, and ``xh`` beside it from the same moments (in at least float32, as
Keras does), and taps ``y``; a subclass with its own ``call``, or
``rms_scaling``, runs the layer's call and computes ``xh`` apart. A
LayerNormalization whose axes include the batch axis uses the layer-local
fallback.

Keras's ``RMSNormalization`` (SmolLM3's norms): ``xh = x / sqrt(mean(x^2
over layer.axis) + eps)`` and ``y = xh * scale``, ``scale`` of shape
``[*x.shape[axis]]`` broadcast against the trailing axes. Example n's
gradient is ``g_n * xh_n`` summed over the axes ``scale`` is broadcast over,
``[B, *scale.shape]`` (``rules.hub_layers``' RMS rule with Keras's axes and
epsilon); the rule runs the layer's call and computes ``xh`` beside it by
``keras.ops.rms_normalization``'s own ops.

BatchNormalization in inference mode (``training`` false, or a frozen layer:
``trainable=False``, which Keras runs on its moving statistics) is the same
per-channel affine map of ``xh = (x - moving_mean) / sqrt(moving_variance +
eps)``, moments fixed, so it has the same closed form with ``axes =
[layer.axis]``: ``dL_n/dgamma = sum_{other axes} g_n * xh_n``, ``dL_n/dbeta
= sum_{other axes} g_n``. The rule runs the layer's own call for the output
(so the model computes exactly what Keras computes) and ``xh`` beside it. In
training mode with a trainable layer the batch statistics couple the
examples: that is refused before any engine runs unless
``allow_batch_coupling=True``, and then the call goes, as before, to the
layer-local VJP (each example normalized by its own statistics); so does a
call whose ``training`` is a tensor.

GroupNormalization normalizes each example on its own too: the channels
(``layer.axis``, ``C`` of them) are split into ``G`` groups of ``C / G``, and
``xh`` is ``x`` normalized by the mean and variance of each example's group
(over all its other axes and the group's channels); ``y = xh * gamma +
beta`` per channel. So it has the same closed form with ``axes =
[layer.axis]``; the rule computes the moments once, ``y`` from them by the
layer's own formula and ops (the same values as its call), and ``xh`` beside it.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from per_example_grads._core.example_ops import compute_dtype
from per_example_grads.rules.hub_layers import RMSNormRule
from per_example_grads.rules.local import LOCAL_RULE
from per_example_grads.rules.rule import LayerRule, register_layer_rule


def _axes(layer, rank: int) -> list[int]:
    """``layer.axis`` as sorted non-negative axes of a rank-``rank`` input."""
    axis = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    return sorted(a % rank for a in axis)


def _broadcast(variable, axes: list[int], rank: int, like: tf.Tensor) -> tf.Tensor:
    """A LayerNormalization's ``gamma`` or ``beta`` in ``like``'s dtype, reshaped as Keras does against a rank-``rank``
    input normalized over other axes than the last alone."""
    v = tf.cast(tf.convert_to_tensor(variable), like.dtype)
    if v.shape.rank != rank and axes != [rank - 1]:
        v = tf.reshape(v, [like.shape[a] if a in axes else 1 for a in range(rank)])
    return v


class LayerNormRule(LayerRule):
    def unsupported(self, layer):
        axis = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        if 0 in axis:
            return "a LayerNormalization over the batch axis couples examples"
        return None

    def variables(self, layer):
        return [v for v in (layer.gamma, layer.beta) if v is not None]

    def forward(self, layer, call, args, kwargs):
        x = args[0]
        rank = x.shape.rank
        axes = _axes(layer, rank)
        if 0 in axes:
            raise ValueError(f"LayerNormalization '{layer.name}' normalizes over the batch axis.")
        if layer.rms_scaling or type(layer).call is not keras.layers.LayerNormalization.call:
            y = call(*args, **kwargs)  # the layer's own values, bit for bit
            xh = keras.ops.layer_normalization(
                tf.cast(x, compute_dtype(x.dtype)), None, None, axes, layer.epsilon, rms_scaling=layer.rms_scaling
            )
            return y, (xh, axes), [y]
        # Keras's own formula and ops (keras.ops.layer_normalization, then the call's cast) for y, and the same with
        # no gamma and beta for xh, from one set of moments: fewer ops to trace and run than the call and xh apart.
        xc = tf.cast(x, compute_dtype(x.dtype))
        mean, variance = keras.ops.moments(xc, axes=axes, keepdims=True)
        inv = tf.math.rsqrt(variance + layer.epsilon)
        xh = xc * inv + -mean * inv
        scaled = inv * _broadcast(layer.gamma, axes, rank, xc) if layer.gamma is not None else inv
        shift = -mean * scaled
        if layer.beta is not None:
            shift = shift + _broadcast(layer.beta, axes, rank, xc)
        y = tf.cast(tf.cast(xc * scaled + shift, x.dtype), layer.compute_dtype)
        return y, (xh, axes), [y]

    @staticmethod
    def _other_axes(rank: int, axes: list[int]) -> list[int]:
        return [a for a in range(1, rank) if a not in axes]

    def per_example(self, layer, saved, grads):
        xh, axes = saved
        g = tf.cast(grads[0], xh.dtype)
        other = self._other_axes(xh.shape.rank, axes)
        out = []
        if layer.gamma is not None:
            out.append(tf.reduce_sum(g * xh, axis=other) if other else g * xh)
        if layer.beta is not None:
            out.append(tf.reduce_sum(g, axis=other) if other else g)
        return out

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        if cache and "per_example" in cache:  # the [B, D] gradients the norms built
            return super().weighted_sum(layer, saved, grads, weights, cache)
        xh, axes = saved
        g = tf.cast(grads[0], xh.dtype)
        g = g * tf.reshape(tf.cast(weights, g.dtype), [-1] + [1] * (g.shape.rank - 1))
        summed = [0] + self._other_axes(xh.shape.rank, axes)
        out = []
        if layer.gamma is not None:
            out.append(tf.reduce_sum(g * xh, axis=summed))
        if layer.beta is not None:
            out.append(tf.reduce_sum(g, axis=summed))
        return out


class BatchNormRule(LayerNormRule):
    """BatchNormalization: the closed form in inference mode, the layer-local VJP otherwise (module docstring).

    ``saved`` is ``(xh, axes, None)`` for the closed form and
    ``(None, None, local_saved)`` for the layer-local rule.
    """

    def unsupported(self, layer):
        return None

    def forward(self, layer, call, args, kwargs):
        training = kwargs.get("training")
        if not (training is None or isinstance(training, bool)) or (training and layer.trainable):
            outputs, saved, taps = LOCAL_RULE.forward(layer, call, args, kwargs)
            return outputs, (None, None, saved), taps
        y = call(*args, **kwargs)
        x = args[0]
        dtype = compute_dtype(x.dtype)
        axes = _axes(layer, x.shape.rank)
        shape = [x.shape[a] if a in axes else 1 for a in range(x.shape.rank)]
        mean = tf.reshape(tf.cast(layer.moving_mean, dtype), shape)
        inv = tf.math.rsqrt(tf.reshape(tf.cast(layer.moving_variance, dtype), shape) + layer.epsilon)
        xh = (tf.cast(x, dtype) - mean) * inv
        return y, (xh, axes, None), [y]

    def per_example(self, layer, saved, grads):
        if saved[2] is not None:
            return LOCAL_RULE.per_example(layer, saved[2], grads, variables=self.variables(layer))
        return super().per_example(layer, saved[:2], grads)

    def squared_norms(self, layer, saved, grads, cache=None):
        return LayerRule.squared_norms(self, layer, saved, grads, cache)  # through per_example (small: [B, channels])

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        if saved[2] is not None or (cache and "per_example" in cache):
            return LayerRule.weighted_sum(self, layer, saved, grads, weights, cache)
        return super().weighted_sum(layer, saved[:2], grads, weights, cache)


class GroupNormRule(LayerNormRule):
    """GroupNormalization: per-example group statistics, per-channel ``gamma`` and ``beta`` (module docstring)."""

    def unsupported(self, layer):
        return None

    def forward(self, layer, call, args, kwargs):
        """``y`` by Keras's own formula (``x * s + (beta - mean * s)``, ``s = gamma / sqrt(var + eps)``) and ``xh``, from one set of moments.

        Running the layer's call for ``y`` and computing the moments again for
        ``xh`` would take the moments twice (``benchmarks/RESULTS.md``).
        """
        x = args[0]
        rank = x.shape.rank
        axis = layer.axis % rank
        channels = x.shape[axis]
        dtype = compute_dtype(x.dtype)
        unknown = [i for i in range(rank) if x.shape[i] is None]
        if len(unknown) <= 1 and all(x.shape[i] for i in range(rank) if i not in unknown):
            # One unknown size (the batch): a constant shape with -1 there, no shape ops per layer.
            shape = [-1 if i in unknown else x.shape[i] for i in range(rank)]
            dynamic = shape
        else:
            dynamic = tf.shape(x)
            shape = [dynamic[i] if x.shape[i] is None else x.shape[i] for i in range(rank)]
        grouped = tf.reshape(
            tf.cast(x, dtype), shape[:axis] + [layer.groups, channels // layer.groups] + shape[axis + 1 :]
        )
        reduce = [i for i in range(1, rank + 1) if i != axis]  # all but the batch and group axes
        mean, variance = keras.ops.moments(grouped, axes=reduce, keepdims=True)
        inv = tf.math.rsqrt(variance + layer.epsilon)
        per_channel = [1] * (rank + 1)
        per_channel[axis : axis + 2] = [layer.groups, channels // layer.groups]
        scale = inv * tf.reshape(tf.cast(layer.gamma, dtype), per_channel) if layer.scale else inv
        shift = -mean * scale
        if layer.center:
            shift = shift + tf.reshape(tf.cast(layer.beta, dtype), per_channel)
        y = tf.cast(tf.reshape(grouped * scale + shift, dynamic), layer.compute_dtype)
        xh = tf.reshape((grouped - mean) * inv, dynamic)
        return y, (xh, [axis]), [y]


class KerasRMSNormRule(RMSNormRule):
    """``keras.layers.RMSNormalization``: the scale over ``layer.axis`` (module docstring)."""

    def unsupported(self, layer):
        axis = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        if 0 in axis:
            return "an RMSNormalization over the batch axis couples examples"
        return None

    def variables(self, layer):
        return [layer.scale]

    def _scale(self, layer):
        return layer.scale

    def normalized(self, layer, x):
        """``x * rsqrt(mean(square(x), axis) + eps)`` in at least float32, as ``keras.ops.rms_normalization``."""
        ops = keras.ops
        axes = _axes(layer, x.shape.rank)
        if 0 in axes:
            raise ValueError(f"RMSNormalization '{layer.name}' normalizes over the batch axis.")
        eps = keras.config.epsilon() if layer.epsilon is None else layer.epsilon
        x = tf.cast(x, compute_dtype(x.dtype))
        return x * ops.rsqrt(ops.mean(ops.square(x), axis=axes, keepdims=True) + eps)


register_layer_rule(keras.layers.LayerNormalization, LayerNormRule())
register_layer_rule(keras.layers.RMSNormalization, KerasRMSNormRule())
register_layer_rule(keras.layers.GroupNormalization, GroupNormRule())
register_layer_rule(keras.layers.BatchNormalization, BatchNormRule())
