"""Differentially private training: clipping and noise, sampling, accounting.

    import per_example_grads as peg
    grads = peg.dp.private_gradients(model, loss_fn, x, y, l2_norm_clip=1.0,
                                     noise_multiplier=1.1, expected_batch_size=256)
    eps = peg.dp.compute_epsilon(60_000, 256, 60, noise_multiplier=1.1, delta=1e-5)

Importing ``per_example_grads.dp`` loads nothing heavy: each name below loads
its module on first use, so ``pegrad epsilon`` (accounting only) never
imports TensorFlow.
"""

from typing import TYPE_CHECKING as _TYPE_CHECKING

from per_example_grads import _lazy

_EXPORTS = {
    "GradientAccumulator": "per_example_grads.dp.accumulation",
    "AccountantFallbackWarning": "per_example_grads.dp.accounting",
    "PrivacyAccountant": "per_example_grads.dp.accounting",
    "adaptive_clipping_noise_multiplier": "per_example_grads.dp.accounting",
    "compute_epsilon": "per_example_grads.dp.accounting",
    "noise_multiplier_for_epsilon": "per_example_grads.dp.accounting",
    "AdaptiveClipping": "per_example_grads.dp.adaptive",
    "ClippedSum": "per_example_grads.dp.aggregator",
    "DPAggregator": "per_example_grads.dp.aggregator",
    "AppliedSteps": "per_example_grads.dp.applied_steps",
    "private_gradients": "per_example_grads.dp.private",
    "fix_model": "per_example_grads.dp.model_fixer",
    "RepeatedNoiseWarning": "per_example_grads.dp.noise",
    "BISR": "per_example_grads.dp.bisr",
    "BLT": "per_example_grads.dp.mechanisms",
    "BandMF": "per_example_grads.dp.mechanisms",
    "GaussianNoise": "per_example_grads.dp.mechanisms",
    "NoiseMechanism": "per_example_grads.dp.mechanisms",
    "PrivacyBudget": "per_example_grads.dp.budget",
    "MemoryFit": "per_example_grads.dp.memory_budget",
    "physical_batch_size_for_memory": "per_example_grads.dp.memory_budget",
    "MinSepSampling": "per_example_grads.dp.min_sep",
    "MonteCarloEpsilon": "per_example_grads.dp.monte_carlo",
    "MonteCarloNoise": "per_example_grads.dp.monte_carlo",
    "monte_carlo_epsilon": "per_example_grads.dp.monte_carlo",
    "monte_carlo_noise_multiplier": "per_example_grads.dp.monte_carlo",
    "min_sep_batches": "per_example_grads.dp.min_sep",
    "MechanismChoice": "per_example_grads.dp.planning",
    "rank_mechanisms": "per_example_grads.dp.planning",
    "FixedSizeSampling": "per_example_grads.dp.sampling",
    "PhysicalChunk": "per_example_grads.dp.sampling",
    "PoissonSampling": "per_example_grads.dp.sampling",
    "default_max_batch_size": "per_example_grads.dp.sampling",
    "physical_chunks": "per_example_grads.dp.sampling",
    "physical_chunks_dataset": "per_example_grads.dp.sampling",
    "poisson_batches": "per_example_grads.dp.sampling",
    "poisson_batches_from_dataset": "per_example_grads.dp.sampling",
    "SparseEmbeddings": "per_example_grads.dp.sparse_embeddings",
    "TruncatedPoissonSampling": "per_example_grads.dp.truncated",
    "truncated_poisson_batches": "per_example_grads.dp.truncated",
    "truncated_poisson_batches_from_dataset": "per_example_grads.dp.truncated",
    "ValidationReport": "per_example_grads.dp.validation",
    "check_model": "per_example_grads.dp.validation",
    "validate": "per_example_grads.dp.validation",
}

# Subpackages reached as attributes: peg.dp.audit.epsilon_one_run, ...
_SUBPACKAGES = ("audit",)

__all__ = sorted([*_EXPORTS, *_SUBPACKAGES], key=str.lower)

if _TYPE_CHECKING:  # what static tools see; at run time __getattr__ does this
    from per_example_grads.dp import audit  # noqa: F401
    from per_example_grads.dp.accounting import (
        AccountantFallbackWarning,  # noqa: F401
        PrivacyAccountant,  # noqa: F401
        adaptive_clipping_noise_multiplier,  # noqa: F401
        compute_epsilon,  # noqa: F401
        noise_multiplier_for_epsilon,  # noqa: F401
    )
    from per_example_grads.dp.accumulation import GradientAccumulator  # noqa: F401
    from per_example_grads.dp.adaptive import AdaptiveClipping  # noqa: F401
    from per_example_grads.dp.aggregator import (
        ClippedSum,  # noqa: F401
        DPAggregator,  # noqa: F401
    )
    from per_example_grads.dp.applied_steps import AppliedSteps  # noqa: F401
    from per_example_grads.dp.bisr import BISR  # noqa: F401
    from per_example_grads.dp.budget import PrivacyBudget  # noqa: F401
    from per_example_grads.dp.mechanisms import BLT, BandMF, GaussianNoise, NoiseMechanism  # noqa: F401
    from per_example_grads.dp.memory_budget import MemoryFit, physical_batch_size_for_memory  # noqa: F401
    from per_example_grads.dp.min_sep import MinSepSampling, min_sep_batches  # noqa: F401
    from per_example_grads.dp.model_fixer import fix_model  # noqa: F401
    from per_example_grads.dp.monte_carlo import (  # noqa: F401
        MonteCarloEpsilon,
        MonteCarloNoise,
        monte_carlo_epsilon,
        monte_carlo_noise_multiplier,
    )
    from per_example_grads.dp.noise import RepeatedNoiseWarning  # noqa: F401
    from per_example_grads.dp.planning import MechanismChoice, rank_mechanisms  # noqa: F401
    from per_example_grads.dp.private import private_gradients  # noqa: F401
    from per_example_grads.dp.sampling import (
        FixedSizeSampling,  # noqa: F401
        PhysicalChunk,  # noqa: F401
        PoissonSampling,  # noqa: F401
        default_max_batch_size,  # noqa: F401
        physical_chunks,  # noqa: F401
        physical_chunks_dataset,  # noqa: F401
        poisson_batches,  # noqa: F401
        poisson_batches_from_dataset,  # noqa: F401
    )
    from per_example_grads.dp.sparse_embeddings import SparseEmbeddings  # noqa: F401
    from per_example_grads.dp.truncated import (  # noqa: F401
        TruncatedPoissonSampling,
        truncated_poisson_batches,
        truncated_poisson_batches_from_dataset,
    )
    from per_example_grads.dp.validation import (
        ValidationReport,  # noqa: F401
        check_model,  # noqa: F401
        validate,  # noqa: F401
    )

__getattr__, __dir__ = _lazy.exports(globals(), _EXPORTS)
