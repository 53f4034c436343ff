"""Gaussian noise for DP-SGD, drawn once per optimizer step.

Where the randomness comes from (``seed``):

- ``None`` (the default, and what a real deployment should use): a
  process-wide ``tf.random.Generator`` seeded from the operating system's
  entropy (``Generator.from_non_deterministic_state``), so the noise cannot be
  predicted or replayed.
- a ``tf.random.Generator``: draws advance its state (reproducible if you
  seeded it with ``from_seed``; it also checkpoints with ``tf.train.Checkpoint``).
- an ``int``, or a pair of ints / a ``[2]`` int tensor: a *stateless* draw,
  ``tf.random.stateless_normal`` with that seed. The same seed gives the same
  noise, so vary it every step (for example ``seed=(run_seed, step)``). For
  experiments and tests only.

Inside ``strategy.run`` every replica must draw independently (see
``per_example_grads.replicas``): generators already give each replica its
own stream, and stateless seeds are folded with the replica id here.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from per_example_grads import replicas

NoiseSeed = int | tuple | tf.Tensor | tf.random.Generator | None

_os_entropy_generator: tf.random.Generator | None = None


def os_entropy_generator() -> tf.random.Generator:
    """The process-wide generator seeded from OS entropy (created once, eagerly)."""
    global _os_entropy_generator
    if _os_entropy_generator is None:
        with tf.init_scope():
            _os_entropy_generator = tf.random.Generator.from_non_deterministic_state()
    return _os_entropy_generator


def gaussian_like(tensors: Sequence[tf.Tensor], stddev, seed: NoiseSeed = None) -> list[tf.Tensor]:
    """Independent ``N(0, stddev^2)`` noise shaped like each of ``tensors``.

    Args:
      tensors: list of tensors of any shapes (the summed clipped gradients).
      stddev: scalar, ``noise_multiplier * l2_norm_clip`` for DP-SGD.
      seed: see the module docstring.

    Returns:
      list of noise tensors, same shapes and dtypes as ``tensors``.
    """
    if isinstance(seed, tf.random.Generator) or seed is None:
        generator = seed if seed is not None else os_entropy_generator()
        draws = [generator.normal(tf.shape(t), dtype=tf.float32) for t in tensors]
    else:
        base = _stateless_seed(seed)
        if replicas.num_replicas() > 1:
            base = tf.cast(tf.random.experimental.stateless_fold_in(base, replicas.replica_id()), tf.int64)
        draws = [
            tf.random.stateless_normal(tf.shape(t), seed=base + tf.constant([0, 1], tf.int64) * (1_000_003 * i), dtype=tf.float32)
            for i, t in enumerate(tensors)
        ]
    return [tf.cast(d * tf.cast(stddev, tf.float32), t.dtype) for d, t in zip(draws, tensors)]


def _stateless_seed(seed) -> tf.Tensor:
    if isinstance(seed, int):
        return tf.constant([seed, 0], tf.int64)
    seed = tf.cast(tf.convert_to_tensor(seed), tf.int64)
    if seed.shape != (2,):
        raise ValueError(f"seed must be an int, a pair of ints or a tf.random.Generator; got shape {seed.shape}.")
    return seed
