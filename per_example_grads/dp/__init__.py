"""Differentially private training: clipping and noise, sampling, accounting.

    import per_example_grads as peg
    grads = peg.dp.private_gradients(model, loss_fn, x, y, l2_norm_clip=1.0,
                                     noise_multiplier=1.1, expected_batch_size=256)
    eps = peg.dp.compute_epsilon(60_000, 256, 60, noise_multiplier=1.1, delta=1e-5)
"""

from per_example_grads.dp.accounting import (
    PrivacyAccountant,
    adaptive_clipping_noise_multiplier,
    compute_epsilon,
    noise_multiplier_for_epsilon,
)
from per_example_grads.dp.adaptive import AdaptiveClipping
from per_example_grads.dp.aggregator import ClippedSum, DPAggregator
from per_example_grads.dp.applied_steps import AppliedSteps
from per_example_grads.dp.private import private_gradients
from per_example_grads.dp.sampling import (
    PhysicalChunk,
    PoissonSampling,
    default_max_batch_size,
    physical_chunks,
    physical_chunks_dataset,
    poisson_batches,
    poisson_batches_from_dataset,
)
from per_example_grads.dp.validation import ValidationReport, check_model, validate

__all__ = [
    "AdaptiveClipping",
    "AppliedSteps",
    "ClippedSum",
    "DPAggregator",
    "PhysicalChunk",
    "PoissonSampling",
    "PrivacyAccountant",
    "ValidationReport",
    "adaptive_clipping_noise_multiplier",
    "check_model",
    "compute_epsilon",
    "default_max_batch_size",
    "noise_multiplier_for_epsilon",
    "physical_chunks",
    "physical_chunks_dataset",
    "poisson_batches",
    "poisson_batches_from_dataset",
    "private_gradients",
    "validate",
]
