"""LoRA-enabled Dense and EinsumDense: closed forms for the two low-rank factors.

``layer.enable_lora(r)`` freezes the kernel ``W0`` and adds trainable
``A`` and ``B``; the layer computes with ``W = W0 + s A B``, ``s = lora_alpha
/ r``. For Dense, ``A`` is ``[i, r]`` and ``B`` ``[r, j]``; with ``a``
``[B, T, i]`` the input and ``g = dL/dz`` ``[B, T, j]`` the gradient at the
pre-activation, example n's gradients are

    dA_n = sum_t a_nt^T (s g_nt B^T),     dB_n = sum_t (a_nt A)^T (s g_nt)

that is, the Dense closed forms (``outer_products``) on the pairs
``(a, s g B^T)`` and ``(u, s g)`` with ``u = a A`` ``[B, T, r]``: the norms
by ``||a||^2 ||g||^2`` or the Gram form (whichever is cheaper), the clipped
sums as one contraction each. The per-example gradients are ``[B, i, r]``
and ``[B, r, j]``; nothing of the frozen kernel's size per example is built.

For EinsumDense, ``A`` is ``kernel.shape[:-1] + (r,)`` and ``B`` is
``[r, kernel.shape[-1]]`` (``W = matmul(A, B)`` contracts ``r``). When the
kernel's last axis ``k`` is an output axis (every MultiHeadAttention and
KerasHub projection), the same split holds with einsums: writing ``<out_r>``
for the output letters with ``k`` replaced by ``r``,

    u = einsum("<in>,<kernel[:-1]>r-><out_r>", a, A)
    dA_n: the EinsumDense kernel gradient of "<in>,<kernel[:-1]>r-><out_r>" on (a, s g B^T)
    dB_n: the EinsumDense kernel gradient of "<out_r>,rk-><out>" on (u, s g)

and both use the EinsumDense closed forms. Other equations, quantized
layers, and layers whose frozen kernel was made trainable again go to the
exact layer-local fallback. The forward pass is the layer's own (the merged
kernel ``W0 + s A B``), so outputs are unchanged.

The rule's variables are the layer's trainable ones: ``A``, ``B`` and the
bias if it is trainable.
"""

from __future__ import annotations

import string

import tensorflow as tf

from per_example_grads.rules import outer_products as op
from per_example_grads.rules.dense import DenseRule
from per_example_grads.rules.einsum_dense import (
    EinsumDenseRule,
    _cast,
    _expand,
    _split,
    kernel_part,
    kernel_per_example,
    kernel_weighted_sum,
    unsupported_equation,
)
from per_example_grads._core.example_ops import squares_part, widened
from per_example_grads.rules.rule import sum_to_shape


def unsupported_lora(layer) -> str | None:
    """Why the LoRA closed forms do not apply to ``layer``, or None."""
    if getattr(layer, "quantization_mode", None):
        return "quantized layers use the layer-local fallback"
    if not all(hasattr(layer, n) for n in ("lora_kernel_a", "lora_kernel_b", "lora_alpha", "lora_rank")):
        return "LoRA without lora_kernel_a/lora_kernel_b"
    base = getattr(layer, "_kernel", None)
    if base is None or base.trainable:
        return "LoRA with a trainable base kernel"
    return None


def _scale(layer) -> float:
    return layer.lora_alpha / layer.lora_rank


def _variables(layer) -> list:
    bias = [layer.bias] if layer.bias is not None and layer.bias.trainable else []
    return [layer.lora_kernel_a, layer.lora_kernel_b] + bias


class DenseLoraRule(DenseRule):
    """A LoRA-enabled ``keras.layers.Dense`` (see the module docstring)."""

    def for_layer(self, layer):
        return self

    def unsupported(self, layer):
        return unsupported_lora(layer)

    def variables(self, layer):
        return _variables(layer)

    def _pairs(self, layer, saved, grads):
        """``[(a, s g B^T), (u, s g)]``, ``[B, T, *]`` in the compute dtype, and ``g``."""
        a, g = op.as_btf(saved), op.as_btf(grads[0])
        lora_a, lora_b = tf.cast(layer.lora_kernel_a, a.dtype), tf.cast(layer.lora_kernel_b, a.dtype)
        s = tf.constant(_scale(layer), a.dtype)
        u = tf.einsum("bti,ir->btr", a, lora_a)
        return [(a, s * tf.einsum("btj,rj->btr", g, lora_b)), (u, s * g)], g

    def _has_bias(self, layer) -> bool:
        return layer.bias is not None and layer.bias.trainable

    def per_example(self, layer, saved, grads):
        pairs, g = self._pairs(layer, saved, grads)
        out = [op.per_example_kernel(x, y) for x, y in pairs]
        if self._has_bias(layer):
            out.append(tf.reduce_sum(g, axis=1))
        return [tf.cast(t, v.dtype) for t, v in zip(out, self.variables(layer))]

    def squared_norms(self, layer, saved, grads, cache=None):
        pairs, g = self._pairs(layer, saved, grads)
        parts = [op.kernel_part(x, y) for x, y in pairs]
        if self._has_bias(layer):
            parts.append(squares_part(tf.reduce_sum(g, axis=1)))
        return widened(parts)

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        pairs, g = self._pairs(layer, saved, grads)
        out = [op.weighted_kernel_sum(x, y, weights) for x, y in pairs]
        if self._has_bias(layer):
            out.append(op.weighted_bias_sum(g, weights))
        return [tf.cast(t, v.dtype) for t, v in zip(out, self.variables(layer))]

    def outer_factors(self, layer, saved, grads):
        return None


class EinsumDenseLoraRule(EinsumDenseRule):
    """A LoRA-enabled ``keras.layers.EinsumDense`` (see the module docstring)."""

    def for_layer(self, layer):
        return self

    def unsupported(self, layer):
        why = unsupported_lora(layer) or unsupported_equation(layer.equation)
        if why:
            return why
        inp, kern, out = _split(layer.equation)
        last = kern[-1]
        if last not in out or last in inp:
            return f"LoRA on equation {layer.equation!r}: the kernel's last axis is not an output axis"
        return None

    def variables(self, layer):
        return _variables(layer)

    def _pieces(self, layer, saved, grads):
        """The two EinsumDense problems ``(inp, kernel, out, kernel_shape, x, y)`` of ``A`` and ``B``, and ``g``."""
        a, g = _cast(saved, grads[0])
        inp, kern, out = _expand(layer.equation, a.shape.rank)
        r = next(c for c in string.ascii_letters if c not in inp + kern + out)
        k0, k = kern[:-1], kern[-1]
        out_r = out.replace(k, r)
        lora_a, lora_b = tf.cast(layer.lora_kernel_a, a.dtype), tf.cast(layer.lora_kernel_b, a.dtype)
        s = tf.constant(_scale(layer), a.dtype)
        u = tf.einsum(f"{inp},{k0}{r}->{out_r}", a, lora_a)
        g_u = s * tf.einsum(f"{out},{r}{k}->{out_r}", g, lora_b)
        return [
            (inp, k0 + r, out_r, layer.lora_kernel_a.shape, a, g_u),
            (out_r, r + k, out, layer.lora_kernel_b.shape, u, s * g),
        ], g

    def _has_bias(self, layer) -> bool:
        return layer.bias is not None and layer.bias.trainable

    def per_example(self, layer, saved, grads):
        pieces, g = self._pieces(layer, saved, grads)
        result = [kernel_per_example(i, k, o, x, y) for i, k, o, _, x, y in pieces]
        if self._has_bias(layer):
            result.append(sum_to_shape(g, layer.bias.shape))
        return [tf.cast(t, v.dtype) for t, v in zip(result, self.variables(layer))]

    def squared_norms(self, layer, saved, grads, cache=None):
        pieces, g = self._pieces(layer, saved, grads)
        parts = [kernel_part(i, k, o, shape, x, y) for i, k, o, shape, x, y in pieces]
        if self._has_bias(layer):
            parts.append(squares_part(sum_to_shape(g, layer.bias.shape)))
        return widened(parts)

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        pieces, g = self._pieces(layer, saved, grads)
        result = [kernel_weighted_sum(i, k, o, x, y, weights) for i, k, o, _, x, y in pieces]
        if self._has_bias(layer):
            gw = g * tf.reshape(tf.cast(weights, g.dtype), [-1] + [1] * (g.shape.rank - 1))
            result.append(tf.reduce_sum(sum_to_shape(gw, layer.bias.shape), axis=0))
        return [tf.cast(t, v.dtype) for t, v in zip(result, self.variables(layer))]


DENSE_LORA_RULE = DenseLoraRule()
EINSUM_DENSE_LORA_RULE = EinsumDenseLoraRule()
