"""LoRA-enabled Dense and EinsumDense: what their rules share.

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
and ``[B, r, j]``; nothing of the frozen kernel's size per example is built
(``dense.DenseLoraRule``).

For EinsumDense, ``A`` is ``kernel.shape[:-1] + (r,)`` and ``B`` is
``[r, kernel.shape[-1]]`` (``W = matmul(A, B)`` contracts ``r``). When the
kernel's last axis ``k`` is an output axis (every MultiHeadAttention and
KerasHub projection), the same split holds with einsums: writing ``<out_r>``
for the output letters with ``k`` replaced by ``r``,

    u = einsum("<in>,<kernel[:-1]>r-><out_r>", a, A)
    dA_n: the EinsumDense kernel gradient of "<in>,<kernel[:-1]>r-><out_r>" on (a, s g B^T)
    dB_n: the EinsumDense kernel gradient of "<out_r>,rk-><out>" on (u, s g)

and both use the EinsumDense closed forms (``einsum_forms``,
``einsum_dense.EinsumDenseLoraRule``). Other equations, quantized layers,
and layers whose frozen kernel was made trainable again go to the exact
layer-local fallback. The forward pass is the layer's own (the merged kernel
``W0 + s A B``), so outputs are unchanged.

A LoRA rule's variables are the layer's trainable ones: ``A``, ``B`` and the
bias if it is trainable.
"""

from __future__ import annotations


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


def lora_scale(layer) -> float:
    """``s = lora_alpha / lora_rank``, the factor of ``A B`` in the merged kernel."""
    return layer.lora_alpha / layer.lora_rank


def has_trainable_bias(layer) -> bool:
    """Whether a LoRA layer's bias is among its rule's variables."""
    return layer.bias is not None and layer.bias.trainable


def lora_variables(layer) -> list:
    """``[A, B]`` and the bias if it is trainable: the variables of a LoRA rule, in its output order."""
    return [layer.lora_kernel_a, layer.lora_kernel_b] + ([layer.bias] if has_trainable_bias(layer) else [])
