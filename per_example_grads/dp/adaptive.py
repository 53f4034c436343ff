"""Adaptive clipping: a clip norm that tracks a quantile of the gradient norms.

Andrew, Thakkar, McMahan and Ramaswamy (2021), "Differentially Private
Learning with Adaptive Clipping". Each step, with clip norm ``C`` and the
fraction of examples whose gradient norm is at most ``C`` estimated privately
as

    b = ( sum_i 1[||g_i|| <= C] + N(0, sigma_b^2) ) / expected_batch_size,

the clip norm moves geometrically towards the target quantile ``gamma``:

    C <- C * exp(-eta * (b - gamma)).

The count is a second noisy release per step. To keep the total privacy cost
equal to that of plain DP-SGD with noise multiplier ``sigma``, the gradient's
own noise multiplier is lowered to
``sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)`` (the paper's Theorem 1;
``per_example_grads.dp.accounting.adaptive_clipping_noise_multiplier``), and
the accountant is run with ``sigma``.

Inside ``strategy.run`` each replica counts its own shard and adds
``N(0, sigma_b^2 / R)``; the noisy counts are all-reduced, so every replica
computes the same next ``C`` from one global noisy count.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from per_example_grads._core import replicas
from per_example_grads.dp.noise import NoiseSeed, gaussian_like


@dataclasses.dataclass(frozen=True)
class AdaptiveClipping:
    """Settings of adaptive clipping.

    Attributes:
      target_quantile: ``gamma`` in (0, 1), the fraction of unclipped examples aimed for.
      learning_rate: ``eta > 0`` of the geometric update.
      clipped_count_stddev: ``sigma_b``, std of the noise on the unclipped count;
        the paper suggests about ``expected_batch_size / 20``.
      initial_l2_norm_clip: the starting ``C``.
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    clipped_count_stddev: float = 1.0
    initial_l2_norm_clip: float = 1.0

    def __post_init__(self):
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"target_quantile must be in (0, 1); got {self.target_quantile}.")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0; got {self.learning_rate}.")
        if not self.clipped_count_stddev > 0:
            raise ValueError(f"clipped_count_stddev must be > 0; got {self.clipped_count_stddev}.")
        if not self.initial_l2_norm_clip > 0:
            raise ValueError(f"initial_l2_norm_clip must be > 0; got {self.initial_l2_norm_clip}.")


def updated_clip(
    settings: AdaptiveClipping,
    clip: tf.Tensor,
    norms: tf.Tensor,
    real: tf.Tensor,
    expected_batch_size,
    seed: NoiseSeed = None,
    *,
    step=None,
) -> tf.Tensor:
    """The next clip norm, from this step's norms.

    Args:
      clip: the current ``C``, scalar float32.
      norms: ``[B]`` per-example gradient norms before clipping.
      real: ``[B]`` 1 for real examples, 0 for padding (padded rows have norm
        0 and must not count as unclipped).
      expected_batch_size: the divisor of the noisy count.
      seed, step: the noise source and the step it draws for
        (``per_example_grads.dp.noise.gaussian_like``).
    """
    centred = tf.reduce_sum((tf.cast(norms <= clip, tf.float32) - 0.5) * tf.cast(real, tf.float32))
    noise = gaussian_like([centred], replicas.noise_share(settings.clipped_count_stddev), seed, step=step)[0]
    noisy = replicas.global_sum(centred + noise)
    fraction = noisy / tf.cast(expected_batch_size, tf.float32) + 0.5
    return clip * tf.exp(-settings.learning_rate * (fraction - settings.target_quantile))
