"""Elementwise scale layers: ConvNeXt's ``LayerScale`` (``y = x * gamma``).

``gamma`` ``[D]`` scales the last axis of ``x`` ``[B, ..., D]``; with
``g = dL/dy``, example n's gradient is ``dL_n/dgamma = sum_{t} x_nt * g_nt``
over the other axes, ``[B, D]``: the rule computes it from the saved input
and the tapped output, and the clipped sum as the one contraction
``sum_{n,t} w_n x_nt g_nt``. The class is registered by its full name, so
keras.applications' private module is not imported here.
"""

from __future__ import annotations

import tensorflow as tf

from per_example_grads.rules import outer_products
from per_example_grads.rules.rule import LayerRule, register_layer_rule, weighted_example_sum


class LayerScaleRule(LayerRule):
    def variables(self, layer):
        return [layer.gamma]

    def unsupported(self, layer):
        if len(layer.gamma.shape) != 1:
            return "only a gamma of one axis (the last) has the closed form"
        return None

    def forward(self, layer, call, args, kwargs):
        y = call(*args, **kwargs)
        return y, args[0], [y]

    def per_example(self, layer, saved, grads):
        x, g = outer_products.flat_positions(saved), outer_products.flat_positions(grads[0])
        return [tf.cast(tf.reduce_sum(x * g, axis=1), layer.gamma.dtype)]

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        x, g = outer_products.flat_positions(saved), outer_products.flat_positions(grads[0])
        return [tf.cast(weighted_example_sum(weights, tf.reduce_sum(x * g, axis=1)), layer.gamma.dtype)]


register_layer_rule("keras.src.applications.convnext.LayerScale", LayerScaleRule())
