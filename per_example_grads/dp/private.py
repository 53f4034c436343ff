"""``private_gradients``: one DP-SGD gradient, ready for ``optimizer.apply_gradients``.

For a batch with per-example gradients ``g_i``:

    g_tilde = ( sum_i clip_C(g_i) + N(0, (sigma * C)^2 I) ) / expected_batch_size

with ``clip_C(g) = g * min(1, C / ||g||)``. Noise is added exactly once, to the
sum, and the division is by the *expected* batch size (``q * N`` under Poisson
sampling), not by the realized one, which would itself leak information.

Inside ``strategy.run`` each replica clips its own shard and adds its share
of the noise, ``N(0, (sigma C)^2 / R)``; the optimizer's all-reduce sums the
shares into one noised gradient (``per_example_grads.replicas``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import tensorflow as tf

from per_example_grads import replicas
from per_example_grads.batch import batch_size, make_batch
from per_example_grads.clipping import clipped_gradients, dense_sums
from per_example_grads.dp.noise import NoiseSeed, gaussian_like


def check_dp_arguments(l2_norm_clip, noise_multiplier, expected_batch_size=None) -> None:
    """Raises ``ValueError`` naming the bad argument."""
    clips = (
        list(l2_norm_clip.values()) if isinstance(l2_norm_clip, Mapping)
        else list(l2_norm_clip) if isinstance(l2_norm_clip, Sequence) else [l2_norm_clip]
    )
    for c in clips:
        if isinstance(c, (int, float)) and not (c > 0 and math.isfinite(c)):
            raise ValueError(f"l2_norm_clip must be a finite number > 0; got {c!r}.")
    if isinstance(noise_multiplier, (int, float)) and not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be a finite number >= 0; got {noise_multiplier!r}.")
    if expected_batch_size is not None and isinstance(expected_batch_size, (int, float)) and not expected_batch_size > 0:
        raise ValueError(f"expected_batch_size must be > 0; got {expected_batch_size!r}.")


def noise_stddev(l2_norm_clip, noise_multiplier):
    """``sigma * C``; for per-layer clipping ``C = sqrt(sum_l C_l^2)``, the bound on the whole clipped gradient."""
    if isinstance(l2_norm_clip, Mapping):
        l2_norm_clip = list(l2_norm_clip.values())
    if isinstance(l2_norm_clip, Sequence):
        total = math.sqrt(sum(float(c) ** 2 for c in l2_norm_clip))
    else:
        total = l2_norm_clip
    return noise_multiplier * total


def private_gradients(
    model: Any,
    loss_fn: Any,
    x: Any,
    y: Any = None,
    *,
    l2_norm_clip,
    noise_multiplier: float,
    seed: NoiseSeed = None,
    expected_batch_size: float | None = None,
    sample_weight: Any = None,
    method: str = "auto",
    variables: Sequence | None = None,
    training: bool = False,
) -> list[tf.Tensor]:
    """The noised, averaged clipped gradient of one DP-SGD step.

    Args:
      model, loss_fn, x, y, variables, training, method: as in
        ``per_example_gradients``.
      l2_norm_clip: ``C > 0``, or per-layer clip norms (see
        ``clipped_gradients``).
      noise_multiplier: ``sigma >= 0``; the noise std is ``sigma * C``.
      seed: where the noise comes from; see ``per_example_grads.dp.noise``.
        ``None`` seeds from the operating system's entropy.
      expected_batch_size: the divisor; pass ``q * N`` with Poisson sampling.
        Defaults to the number of rows ``B`` (of the global batch, inside
        ``strategy.run``).
      sample_weight: ``[B]``; a Poisson batch's mask goes here (padded rows
        weigh 0 and contribute exactly nothing).

    Returns:
      list of ``[*var.shape]`` tensors aligned with the variables, for
      ``optimizer.apply_gradients(zip(grads, variables))``. Inside
      ``strategy.run``, this replica's share: the shares sum (as the
      optimizer's all-reduce does) to the noised gradient of the global batch.

    Example:
      >>> import keras, numpy as np
      >>> import per_example_grads as peg
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
      >>> grads = peg.dp.private_gradients(model, loss, np.ones((8, 3), "float32"),
      ...     np.arange(8) % 2, l2_norm_clip=1.0, noise_multiplier=1.1, seed=(0, 1))
      >>> [tuple(g.shape) for g in grads]
      [(3, 2), (2,)]
    """
    check_dp_arguments(l2_norm_clip, noise_multiplier, expected_batch_size)
    sums = clipped_gradients(
        model, loss_fn, x, y, l2_norm_clip=l2_norm_clip, sample_weight=sample_weight,
        method=method, variables=variables, training=training,
    )
    if expected_batch_size is None:
        expected_batch_size = tf.maximum(replicas.global_sum(batch_size(make_batch(model, x))), 1)
    return noised_average(sums, noise_stddev(l2_norm_clip, noise_multiplier), expected_batch_size, seed)


def noised_average(sums: Sequence[tf.Tensor], stddev, expected_batch_size, seed: NoiseSeed = None) -> list[tf.Tensor]:
    """``(sums[k] + N(0, stddev^2)) / expected_batch_size`` for every k: the noise is added once.

    Inside ``strategy.run`` the noise std is ``stddev / sqrt(R)`` on each of
    the ``R`` replicas, so the sum of the replicas' results has it once.
    """
    sums = dense_sums(sums)  # the noise is dense: every row of an embedding table gets some
    noise = gaussian_like(sums, replicas.noise_share(stddev), seed)
    return [(s + n) / tf.cast(expected_batch_size, s.dtype) for s, n in zip(sums, noise)]
