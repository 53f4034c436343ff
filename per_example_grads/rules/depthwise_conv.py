"""Depthwise, separable and grouped convolutions: DepthwiseConv1D/2D, SeparableConv1D/2D, grouped Conv1D/2D/3D (channels_last).

Notation: ``a`` ``[B, *spatial_in, C]`` is the layer input, ``m`` the depth
multiplier, ``K = prod(kernel_size)``. A depthwise convolution convolves each
input channel ``c`` on its own with ``m`` filters: its kernel is
``W`` ``[*kernel_size, C, m]`` and output channel ``c m + j`` is
``z[t, c m + j] = sum_k a[pos(t, k), c] W[k, c, j] (+ b[c m + j])``, where
``pos(t, k)`` is the input position that kernel offset ``k`` meets at output
position ``t`` (strides, dilation, padding). With ``g = dL/dz``
``[B, *spatial_out, C m]``, example n's kernel gradient is

    dL_n/dW[k, c, j] = sum_t a_n[pos(t, k), c] g_n[t, c m + j],

only ``K C m`` numbers per example (no more than ``a_n`` whenever the output
has at least ``K / m`` positions), so the rule builds it for the whole batch
and takes norms and the clipped sum ``sum_n w_n dL_n/dW`` from it (the
engine's cache carries it from the norms to the sum). It is built by one of
three exact formulations:

- the "groups trick" (Rochette et al., 2019): the batch is folded into the
  channels, ``a`` -> ``[1, *spatial_in, B C]`` and ``g`` ->
  ``[1, *spatial_out, B C m]``, and the kernel gradient of *one* depthwise
  convolution with ``B C`` channels (TensorFlow's depthwise backprop-filter
  op) is every example's kernel at once, ``[*kernel_size, B C, m]``;
- shifts: for each kernel offset ``k``, the input it meets (a slice
  of the padded input, ``conv.over_offsets``, ``[B, T, C]``) times ``g``,
  summed over ``t``: ``K`` products no larger than the input, never the
  ``[B, T, K C]`` patches;
- the patches of ``conv.sliced_patches`` ``[B, T, K C]`` reshaped to
  ``[B, T, K, C, 1]`` times ``g`` ``[B, T, 1, C, m]``, summed over ``t``
  (elementwise work that XLA fuses).

The groups trick is used only for 3x3 kernels (2-D) on inputs at least as
large as the kernel's reach ``(k - 1) d + 1``, outside XLA, and not with
both strides and dilation above 1 (which ``tf.nn.depthwise_conv2d`` does not
take): TensorFlow's depthwise backprop-filter op is far slower than the
alternatives for the folded batch (``B C`` channels)
with any other kernel size (the 5x5 kernels of EfficientNetB0, 1-D kernels
as 1 x k) and on inputs smaller than the kernel ("same" padding on the 1x1
and 2x2 maps at the end of MobileNetV2 on 32x32 images). It takes batches
of any size, known or not when traced (a DP step's realized batch is not),
and where it applies it is faster than the shifts. The other cases with
static spatial sizes take the shifts outside XLA (less peak memory and time
than the patches); the timings behind these choices are in
``benchmarks/RESULTS.md``;
under XLA (``jit_compile=True``), which fuses the patches' product and sum,
and with unknown spatial sizes, the patches. Under XLA the grouped
convolution with one example and ``B C`` groups compiles and runs far
slower still.

The bias gradient is ``sum_t g_n[t]`` ``[B, C m]``.

SeparableConv: ``d = depthwise(a, W_d)`` ``[B, *spatial_out, C m]``, then
``z = d @ W_p + b`` at every position (a 1x1 convolution, ``W_p``
``[*(1,) * rank, C m, F]``), both computed by the ops the layer itself runs
(``SeparableConvRule.forward``). The rule taps both ``d`` and ``z``: the gradient
at ``d`` (through ``z`` and ``W_p``, ``g_d = g_z W_p^T``) gives ``W_d``'s
gradients as above, and ``W_p`` is a Dense kernel on the positions of ``d``
(``outer_products``: Gram-form or materialized norms, the clipped sum as one
contraction).

Grouped Conv1D/2D/3D (``groups = G > 1``, channels_last): input channel
``c`` of group ``q`` (``C / G`` channels each) meets only the ``F / G``
output channels of its group, through the kernel ``W`` ``[*kernel_size,
C / G, F]`` (output channel ``q F / G + f``). With the patches ``[B, T, K,
G, C / G]`` and ``g`` ``[B, T, G, F / G]``, example n's kernel gradient is
``dL_n/dW[k, c, q F/G + f] = sum_t p_n[t, k, q, c] g_n[t, q, f]``: one
contraction, kept for the clipped sum when it is no larger than the layer's
input and output gradient together; otherwise the clipped sum is the kernel
VJP of the layer's own grouped convolution at ``w * g`` (as ``conv.py`` does
for ``groups = 1``).

channels_first layers use the exact layer-local fallback.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from per_example_grads._core.example_ops import squares_part, widened
from per_example_grads._core.xla_context import in_xla_context
from per_example_grads.rules import outer_products as op
from per_example_grads.rules.conv import (
    PATCHES_RULE,
    ConvSpec,
    KernelBiasRule,
    channels_last_only,
    over_offsets,
    patches,
    sliced_patches,
    weighted_kernel_sum,
)
from per_example_grads.rules.rule import LayerRule, register_layer_rule, weighted_example_sum


def _spec(layer) -> ConvSpec:
    return ConvSpec(
        layer.rank, tuple(layer.kernel_size), tuple(layer.strides), tuple(layer.dilation_rate), layer.padding
    )


def depthwise_kernels(spec: ConvSpec, a: tf.Tensor, g: tf.Tensor, multiplier: int) -> tf.Tensor:
    """``[B, *kernel_size, C, m]``: every example's depthwise kernel gradient (module docstring).

    ``a`` ``[B, *spatial_in, C]`` the layer input, ``g`` ``[B, *spatial_out, C m]``
    the loss gradient at the depthwise output (before bias and activation).
    """
    dtype = op.compute_dtype(a.dtype)
    a, g = tf.cast(a, dtype), tf.cast(g, dtype)
    if (
        in_xla_context() or None in a.shape[1:-1] or None in g.shape[1:-1]
    ):  # g's: unknown after Keras's strided dilation
        return _kernels_by_patches(spec, a, g, multiplier)
    both = any(s > 1 for s in spec.strides) and any(d > 1 for d in spec.dilation_rate)
    reach = [(k - 1) * d + 1 for k, d in zip(spec.kernel_size, spec.dilation_rate)]
    smaller = any(n < r for n, r in zip(a.shape[1:-1], reach))
    three_by_three = tuple(spec.kernel_size) == (3, 3)
    if both or smaller or not three_by_three or a.shape[-1] is None:
        return _kernels_by_shifts(spec, a, g, multiplier)
    return _kernels_by_groups(spec, a, g, multiplier)


def _kernels_by_patches(spec, a, g, m):
    c = a.shape[-1]
    k = math.prod(spec.kernel_size)
    spatial = tuple(a.shape[1:-1])
    p = sliced_patches(spec, spatial, a) if None not in spatial else patches(spec, a)  # [B, T, K C]
    b, t = tf.shape(p)[0], tf.shape(p)[1]  # unknown batch and spatial sizes alike
    p = tf.reshape(p, [b, t, k, c, 1])
    g = tf.reshape(g, [b, t, 1, c, m])
    return tf.reshape(tf.reduce_sum(p * g, axis=1), [-1, *spec.kernel_size, c, m])


def _kernels_by_shifts(spec, a, g, m):
    """Static spatial sizes: one product and sum over positions per kernel offset, never the ``[B, T, K C]`` patches."""
    c = a.shape[-1]
    t = g.shape[1:-1].num_elements()
    g = tf.reshape(g, [-1, t, c, m])
    per_offset, _ = over_offsets(
        spec, tuple(a.shape[1:-1]), a, lambda piece: tf.reduce_sum(tf.reshape(piece, [-1, t, c, 1]) * g, axis=1)
    )
    return tf.reshape(tf.stack(per_offset, axis=1), [-1, *spec.kernel_size, c, m])


def _kernels_by_groups(spec, a, g, m):
    """2-D only: ``depthwise_kernels`` takes this path for 3x3 kernels; the batch size may be unknown until run time."""
    b, c = a.shape[0] if a.shape[0] is not None else tf.shape(a)[0], a.shape[-1]
    kernel_size, strides, dilations = spec.kernel_size, spec.strides, spec.dilation_rate
    # [B, H, W, C] -> [1, H, W, B C]: example n's channel c becomes channel n C + c.
    folded_a = tf.reshape(tf.transpose(a, [1, 2, 0, 3]), [1, a.shape[1], a.shape[2], b * c])
    g = tf.reshape(g, [b, g.shape[1], g.shape[2], c, m])
    folded_g = tf.reshape(tf.transpose(g, [1, 2, 0, 3, 4]), [1, g.shape[1], g.shape[2], b * c * m])
    kernel = tf.zeros([*kernel_size, b * c, m], a.dtype)
    with tf.GradientTape() as tape:
        tape.watch(kernel)
        z = tf.nn.depthwise_conv2d(folded_a, kernel, [1, *strides, 1], spec.padding.upper(), dilations=dilations)
    w = tape.gradient(z, kernel, output_gradients=folded_g)  # [*kernel_size, B C, m]
    w = tf.reshape(w, [*kernel_size, b, c, m])
    w = tf.transpose(w, [2, 0, 1, 3, 4])
    return tf.reshape(w, [b, *spec.kernel_size, c, m])


def _weighted(g: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
    g = tf.cast(g, op.compute_dtype(g.dtype))
    return g * tf.reshape(tf.cast(weights, g.dtype), [-1] + [1] * (g.shape.rank - 1))


class DepthwiseConvRule(KernelBiasRule):
    """DepthwiseConv1D/2D: ``z = depthwise(a, W) + b``, then the fused activation."""

    def unsupported(self, layer):
        return channels_last_only(layer, "depthwise")

    def per_example(self, layer, saved, grads):
        return self._per_example_compute_dtype(layer, saved, grads)

    def squared_norms(self, layer, saved, grads, cache=None):
        """Norms of the per-example kernels and biases, which a following clipped sum reads from ``cache``."""
        per_example = self._per_example_compute_dtype(layer, saved, grads)
        if cache is not None:
            cache["kept"] = per_example
        return widened([squares_part(t) for t in per_example])

    def _per_example_compute_dtype(self, layer, saved, grads):
        g = grads[0]
        out = [depthwise_kernels(_spec(layer), saved, g, layer.depth_multiplier)]
        if layer.use_bias:
            out.append(tf.reduce_sum(op.as_btf(g), axis=1))
        return out

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        kept = (cache or {}).get("kept")
        if kept is not None:
            out = [weighted_example_sum(weights, t) for t in kept]
        else:  # the kernels of (a, w * g), summed: the examples do not mix
            g = _weighted(grads[0], weights)
            out = [tf.reduce_sum(depthwise_kernels(_spec(layer), saved, g, layer.depth_multiplier), axis=0)]
            if layer.use_bias:
                out.append(tf.reduce_sum(op.as_btf(g), axis=[0, 1]))
        return out


class SeparableConvRule(LayerRule):
    """SeparableConv1D/2D: ``d = depthwise(a, W_d)``, ``z = d @ W_p + b``, then the fused activation."""

    def unsupported(self, layer):
        return channels_last_only(layer, "separable")

    def variables(self, layer):
        return [layer.depthwise_kernel, layer.pointwise_kernel] + ([layer.bias] if layer.use_bias else [])

    def forward(self, layer, call, args, kwargs):
        """The layer's output bit for bit, with its depthwise output ``d`` in the open.

        Keras's TensorFlow backend computes a separable convolution as a
        depthwise convolution followed by a 1x1 ``tf.nn.conv2d`` with
        ``VALID`` padding (``tf.nn.separable_conv2d``, or Keras's own
        decomposition when strides and dilation are both above 1; a 1-D layer
        on an added unit axis). ``keras.ops.depthwise_conv`` takes the same
        path to ``d``, and the same 1x1 convolution follows, so the output is
        the layer's own, bit for bit (a matrix product in place of the 1x1
        convolution rounds differently on wide layers, enough to move a ReLU
        or max-pool kink), and ``d`` is tapped where the layer's own
        computation has it, so the one backward pass gives ``g_d``. (Calling
        the layer instead would need ``d`` and ``g_d = g_z W_p^T`` computed
        again.) ``tests/test_engine_interface.py`` checks the output against
        the layer's bit for bit.
        """
        a = args[0]
        d = keras.ops.depthwise_conv(
            a,
            layer.depthwise_kernel,
            strides=layer.strides,
            padding=layer.padding,
            dilation_rate=layer.dilation_rate,
            data_format=layer.data_format,
        )
        z = _pointwise(d, layer.pointwise_kernel, layer.rank)
        if layer.use_bias:
            z = keras.ops.add(z, keras.ops.reshape(layer.bias, (1,) * (layer.rank + 1) + (layer.filters,)))
        out = layer.activation(z) if layer.activation is not None else z
        return out, (a, d), [d, z]

    def _parts(self, layer, saved, grads):
        (a, d), (g_d, g_z) = saved, grads
        return a, op.as_btf(d), g_d, op.as_btf(g_z)

    def per_example(self, layer, saved, grads):
        a, d, g_d, g_z = self._parts(layer, saved, grads)
        out = [
            depthwise_kernels(_spec(layer), a, g_d, layer.depth_multiplier),
            tf.reshape(op.per_example_kernel(d, g_z), [-1, *layer.pointwise_kernel.shape]),
        ]
        if layer.use_bias:
            out.append(tf.reduce_sum(g_z, axis=1))
        return out

    def squared_norms(self, layer, saved, grads, cache=None):
        a, d, g_d, g_z = self._parts(layer, saved, grads)
        kernels = depthwise_kernels(_spec(layer), a, g_d, layer.depth_multiplier)
        if cache is not None:
            cache["kept"] = kernels
        parts = [squares_part(kernels), op.kernel_part(d, g_z)]
        if layer.use_bias:
            parts.append(squares_part(tf.reduce_sum(g_z, axis=1)))
        return widened(parts)

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        a, d, g_d, g_z = self._parts(layer, saved, grads)
        kept = (cache or {}).get("kept")
        if kept is not None:
            depthwise = weighted_example_sum(weights, kept)
        else:
            depthwise = tf.reduce_sum(
                depthwise_kernels(_spec(layer), a, _weighted(g_d, weights), layer.depth_multiplier), axis=0
            )
        out = [depthwise, tf.reshape(op.weighted_kernel_sum(d, g_z, weights), layer.pointwise_kernel.shape)]
        if layer.use_bias:
            out.append(op.weighted_bias_sum(g_z, weights))
        return out


def _pointwise(d: tf.Tensor, kernel, rank: int) -> tf.Tensor:
    """``d`` ``[B, *spatial, C m]`` through the ``[*(1,) * rank, C m, F]`` kernel, as Keras's separable convolution does it."""
    kernel = keras.ops.convert_to_tensor(kernel)  # as Keras converts it: autocast under mixed precision
    if rank == 1:
        z = tf.nn.conv2d(tf.expand_dims(d, 1), tf.expand_dims(kernel, 0), [1, 1, 1, 1], "VALID", data_format="NHWC")
        return tf.squeeze(z, [1])
    return tf.nn.conv2d(d, kernel, [1, 1, 1, 1], "VALID", data_format="NHWC")


def grouped_kernels(spec: ConvSpec, a: tf.Tensor, g: tf.Tensor, groups: int) -> tf.Tensor:
    """``[B, *kernel_size, C / G, F]``: every example's kernel gradient of a grouped convolution (module docstring)."""
    c, f = a.shape[-1], g.shape[-1]
    k = math.prod(spec.kernel_size)
    spatial = tuple(a.shape[1:-1])
    p = sliced_patches(spec, spatial, a) if None not in spatial else patches(spec, a)  # [B, T, K C]
    b, t = tf.shape(p)[0], tf.shape(p)[1]  # unknown batch and spatial sizes alike
    p = tf.reshape(p, [b, t, k, groups, c // groups])
    g = tf.reshape(op.as_btf(g), [b, t, groups, f // groups])
    kernels = tf.einsum("btkqc,btqf->bkcqf", p, g)
    return tf.reshape(kernels, [-1, *spec.kernel_size, c // groups, f])


class GroupedConvRule(KernelBiasRule):
    """Conv1D/2D/3D with ``groups > 1``: ``z = conv(a, W) + b``, then the fused activation."""

    def unsupported(self, layer):
        return channels_last_only(layer, "grouped")

    def _per_example(self, layer, a, g):
        out = [grouped_kernels(ConvSpec.of(layer), a, g, layer.groups)]
        if layer.use_bias:
            out.append(tf.reduce_sum(op.as_btf(g), axis=1))
        return out

    def per_example(self, layer, saved, grads):
        return self._per_example(layer, saved, grads[0])

    def squared_norms(self, layer, saved, grads, cache=None):
        """Norms of the per-example gradients, which a following clipped sum reads from ``cache`` when small."""
        a, g = saved, grads[0]
        per_example = self._per_example(layer, a, g)
        small = (
            a.shape[1:].is_fully_defined()
            and g.shape[1:].is_fully_defined()
            and (per_example[0].shape[1:].num_elements() <= a.shape[1:].num_elements() + g.shape[1:].num_elements())
        )
        if cache is not None and small:
            cache["kept"] = per_example
        return widened([squares_part(t) for t in per_example])

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        kept = (cache or {}).get("kept")
        if kept is not None:
            out = [weighted_example_sum(weights, t) for t in kept]
        else:
            a, g = saved, grads[0]
            out = [weighted_kernel_sum(ConvSpec.of(layer), layer.kernel, a, g, weights)]
            if layer.use_bias:
                out.append(op.weighted_bias_sum(op.as_btf(g), weights))
        return out


class _ConvRule(LayerRule):
    """Conv1D/2D/3D: hands each layer to ``conv.PATCHES_RULE`` (``groups = 1``) or ``GroupedConvRule``."""

    def for_layer(self, layer):
        return GROUPED_RULE if layer.groups > 1 else PATCHES_RULE


DEPTHWISE_RULE = DepthwiseConvRule()
SEPARABLE_RULE = SeparableConvRule()

GROUPED_RULE = GroupedConvRule()
CONV_RULE = _ConvRule()

register_layer_rule(keras.layers.Conv1D, CONV_RULE)
register_layer_rule(keras.layers.Conv2D, CONV_RULE)
register_layer_rule(keras.layers.Conv3D, CONV_RULE)
register_layer_rule(keras.layers.DepthwiseConv1D, DEPTHWISE_RULE)
register_layer_rule(keras.layers.DepthwiseConv2D, DEPTHWISE_RULE)
register_layer_rule(keras.layers.SeparableConv1D, SEPARABLE_RULE)
register_layer_rule(keras.layers.SeparableConv2D, SEPARABLE_RULE)
