"""The LoRA rules, where they were first defined (kept so imports from here keep working).

The rules live beside their base rules, ``dense.DenseLoraRule`` and
``einsum_dense.EinsumDenseLoraRule``, over the forms of ``lora_forms``
(which states their maths).
"""

from per_example_grads.rules.dense import DENSE_LORA_RULE, DenseLoraRule
from per_example_grads.rules.einsum_dense import EINSUM_DENSE_LORA_RULE, EinsumDenseLoraRule
from per_example_grads.rules.lora_forms import unsupported_lora

__all__ = ["DENSE_LORA_RULE", "EINSUM_DENSE_LORA_RULE", "DenseLoraRule", "EinsumDenseLoraRule", "unsupported_lora"]
