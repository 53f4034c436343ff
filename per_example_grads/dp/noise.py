"""Gaussian noise for DP-SGD: where it comes from, and why it never repeats.

A ``seed`` argument anywhere in the library means one of:

- ``None`` (the default, and what a real deployment should use): a
  ``tf.random.Generator`` seeded from the operating system's entropy. Draws
  advance its state atomically (also when several workers share it), and a
  new process starts from new entropy, so noise is never predictable and never
  replayed, not even after a restart.
- an ``int`` (or NumPy integer) ``s``: a key derived from ``s`` by hashing
  (``numpy.random.SeedSequence``), so different seeds give unrelated streams
  (``tf.random.Generator.from_seed`` does not: it puts ``s`` into Philox's
  counter, and seeds 0 and 1 give the same stream shifted by a few draws).
- a pair of ints or a ``[2]`` integer tensor: a stateless key used as it is.
- a ``tf.random.Generator``: draws advance its state; checkpoint it yourself.

A *stateful* user of noise (``DPAggregator``, hence ``DPModel`` and
``GradientAccumulator``) draws the noise of its logical step ``t`` from
``fold_in(key, t)``, with ``t`` its step counter, which is saved with the
weights. So with an integer seed every step gets different noise, runs are
reproducible, and a run restored from a checkpoint at step ``t`` continues
with the noise of steps ``t, t + 1, ...``: it never reuses the noise of a step
it took before the checkpoint. The steps it retakes after a crash (those
between the checkpoint and the crash) get the noise they had the first time;
that releases nothing new only if they also see the same batches (a seeded
``poisson_batches`` resumed at the same step does; ``DPModel.fit`` arranges
it). Integer seeds are for experiments; use ``None`` for real runs.

``private_gradients`` is one-shot: it has no step counter, so the same
integer or pair seed gives the same noise, and it is the caller's job to vary
it (for example ``seed=(run_seed, step)``).

Inside ``strategy.run`` every replica must draw independently (see
``per_example_grads._core.replicas``): generators already give each replica its
own stream, and stateless keys are folded with the replica id here.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from per_example_grads._core import replicas
from per_example_grads._core.example_ops import graph_constant
from per_example_grads._core.xla_context import in_xla_context

NoiseSeed = int | tuple | tf.Tensor | tf.random.Generator | None


class RepeatedNoiseWarning(UserWarning):
    """A fixed seed would give a release the same noise as another (``private_gradients``)."""


def entropy_generator() -> tf.random.Generator:
    """A new generator seeded from the operating system's entropy (made outside any ``tf.function``)."""
    with tf.init_scope():
        return tf.random.Generator.from_non_deterministic_state()


_process_generator: tf.random.Generator | None = None


def process_generator() -> tf.random.Generator:
    """One process-wide entropy generator, for one-shot draws with ``seed=None``."""
    global _process_generator
    if _process_generator is None:
        _process_generator = entropy_generator()
    return _process_generator


def hashed_key(seed: int) -> np.ndarray:
    """``[2]`` int64 stateless key derived from a non-negative integer by hashing."""
    words = np.random.SeedSequence(int(seed)).generate_state(2, np.uint64)
    return words.view(np.int64)


def stateless_key(seed) -> tf.Tensor:
    """``[2]`` int64 key: an int is hashed (``hashed_key``), a pair or ``[2]`` tensor is used as given."""
    expected = "seed must be None, an int, a pair of ints or a tf.random.Generator"
    if isinstance(seed, (bool, np.bool_)):
        raise TypeError(f"{expected}; got {seed!r}.")
    if isinstance(seed, numbers.Integral):
        if seed < 0:
            raise ValueError(f"seed must be a non-negative integer; got {seed}.")
        return tf.constant(hashed_key(seed), tf.int64)
    integer = seed.dtype.is_integer if tf.is_tensor(seed) else np.asarray(seed).dtype.kind in "iu"
    if not integer:
        raise TypeError(f"{expected}; got {seed!r}.")
    seed = tf.cast(tf.convert_to_tensor(seed), tf.int64)
    if seed.shape != (2,):
        raise ValueError(f"{expected}; got shape {seed.shape}.")
    return seed


# Folded into every stateless noise key first, so that noise never shares a key
# with anything else derived from the same seed (``poisson_batches`` draws batch
# ``t`` from ``fold_in(key, t)``: the noise of step ``t`` must not reuse it).
NOISE_TAG = 0x6E6F697365  # "noise"


# The most coordinates one draw covers: small tensors share a draw (a few graph
# operations per draw instead of a score per tensor), while the temporaries of
# any one draw stay bounded (a larger tensor has a draw of its own).
MAX_DRAW = 2**22


def draw_groups(tensors: Sequence[tf.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` in the order they are drawn, one list per draw (``gaussian_like``).

    Consecutive tensors of one dtype and static shape share a draw while
    their sizes add up to at most ``MAX_DRAW``; a tensor of unknown shape, or
    larger than that, has one of its own.
    """
    groups: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        n = t.shape.num_elements() if t.shape.is_fully_defined() else None
        last = groups[-1] if groups else None
        joins = (
            last is not None
            and n is not None
            and tensors[last[0]].dtype == t.dtype
            and tensors[last[0]].shape.is_fully_defined()
            and size + n <= MAX_DRAW
        )
        if joins:
            last.append(i)
            size += n
        else:
            groups.append([i])
            size = n if n is not None else MAX_DRAW + 1
    return groups


def gaussian_like(
    tensors: Sequence[tf.Tensor],
    stddev,
    seed: NoiseSeed = None,
    *,
    step=None,
    combine: Callable[[tf.Tensor, tf.Tensor], tf.Tensor] | None = None,
) -> list[tf.Tensor]:
    """Independent ``N(0, stddev^2)`` noise shaped like each of ``tensors``.

    Every coordinate of every tensor gets its own standard normal draw,
    times ``stddev``: the tensors are drawn in groups (``draw_groups``:
    consecutive tensors of one dtype, up to ``MAX_DRAW`` coordinates), each
    group as one flat ``standard_normal`` vector split into its tensors'
    shapes, so no coordinate's draw is shared with another's. Group ``j``
    draws from the key ``fold_in(fold_in(fold_in(key, NOISE_TAG), step), j)``,
    or, from a generator, from the ``j``-th of the fresh keys that one
    ``make_seeds`` call takes from its stream. So a new ``step`` (or a
    generator's next call) gives fresh noise, and the same key and step give
    the same noise.

    Args:
      tensors: list of tensors of any shapes (the summed clipped gradients).
      stddev: scalar, ``noise_multiplier * l2_norm_clip`` for DP-SGD.
      seed: see the module docstring.
      step: with a stateless seed, the logical step the noise is for; the key
        is folded with it, so every step gets its own noise.
      combine: if given, ``combine(tensors[i], noise[i])`` is returned
        instead of the noise, and in a graph each group is drawn only once
        its own tensors and the previous group's results exist, so one
        group's noise (and its draw's temporaries) is alive at a time. (A
        draw depends on nothing but its key: unordered, every draw runs as
        the step starts and all the noise lives until the last tensor it is
        added to is ready, a whole model's worth during a DP step's chunk
        loop.) The draws are the same either way.

    Returns:
      list of noise tensors, same shapes and dtypes as ``tensors`` (or what
      ``combine`` returns for each).
    """
    if not tensors:
        return []
    if seed is None:
        seed = process_generator()
    groups = draw_groups(tensors)
    if isinstance(seed, tf.random.Generator):
        keys = tf.unstack(seed.make_seeds(len(groups)), axis=1)
    else:
        key = tf.random.experimental.stateless_fold_in(stateless_key(seed), NOISE_TAG)
        if step is not None:
            key = tf.random.experimental.stateless_fold_in(key, tf.cast(step, tf.int64))
        if replicas.num_replicas() > 1:
            key = tf.random.experimental.stateless_fold_in(key, replicas.replica_id())
        keys = [tf.random.experimental.stateless_fold_in(key, j) for j in range(len(groups))]
    scale = tf.cast(stddev, tf.float32)
    out: list = [None] * len(tensors)
    after: list = []  # what the next group's draw waits for (with combine)
    for group, k in zip(groups, keys):
        first = tensors[group[0]]
        if combine and not tf.executing_eagerly():
            # The draw waits through its key, the one op given the control inputs: every op of the draw made
            # under them got them all, constants included (thousands of graph edges on a large model).
            with tf.control_dependencies(after + [tensors[i] for i in group]):
                k = tf.identity(k)
        if not first.shape.is_fully_defined():  # a group of its own
            n = tf.size(first, out_type=tf.int64)
            parts = [tf.cast(tf.reshape(standard_normal(n, k) * scale, tf.shape(first)), first.dtype)]
        else:
            sizes = [tensors[i].shape.num_elements() for i in group]
            z = tf.cast(standard_normal(sum(sizes), k) * scale, first.dtype)
            parts = tf.split(z, sizes) if len(group) > 1 else [z]
            parts = [tf.reshape(part, graph_constant(tensors[i].shape.as_list())) for i, part in zip(group, parts)]
        for i, part in zip(group, parts):
            out[i] = combine(tensors[i], part) if combine else part
        after = [out[i] for i in group]
    return out


def standard_normal(n: int | tf.Tensor, source: tf.Tensor | tf.random.Generator) -> tf.Tensor:
    """``[n]`` independent float32 ``N(0, 1)`` draws from a stateless ``[2]`` key or a generator.

    Box-Muller on TensorFlow's Philox uniforms: for ``u, v`` uniform on
    ``[0, 1)``, ``r = sqrt(-2 log(1 - u))`` and ``theta = 2 pi v`` give two
    independent standard normals ``r cos(theta)`` and ``r sin(theta)``. It is
    the transform ``tf.random.normal`` applies inside its kernel, with the
    same float32 uniforms (so about the same tails: ``1 - u >= 2^-23`` bounds
    ``|z|`` by 5.65, where the kernel's floor of 1e-7 bounds it by 5.68),
    written as vectorized elementwise ops, chosen for speed on CPU over the
    fused kernel (timings in ``benchmarks/RESULTS.md``). Under XLA, which
    compiles and fuses its own, the stateless normal op with the Threefry
    algorithm is used, which XLA compiles far faster on CPU than Philox
    (``benchmarks/RESULTS.md``). A generator supplies a fresh key from its
    stream.

    Args:
      n: a Python int (static sizes make no shape arithmetic in the graph)
        or a scalar integer tensor.
    """
    if isinstance(source, tf.random.Generator):
        source = source.make_seeds(1)[:, 0]
    if in_xla_context():
        return tf.random.stateless_normal(
            tf.reshape(tf.cast(n, tf.int64), [1]), seed=source, dtype=tf.float32, alg="threefry"
        )
    if isinstance(n, int):
        shape, exact = [2, (n + 1) // 2], n % 2 == 0
    else:
        n = tf.cast(n, tf.int64)
        shape, exact = tf.stack([tf.constant(2, tf.int64), (n + 1) // 2]), False
    u, v = tf.unstack(tf.random.stateless_uniform(shape, seed=source, dtype=tf.float32))
    radius = tf.sqrt(-2.0 * tf.math.log1p(-u))
    theta = (2.0 * math.pi) * v
    z = tf.concat([radius * tf.cos(theta), radius * tf.sin(theta)], axis=0)
    return z if exact else z[:n]


def noise_source(seed: NoiseSeed):
    """What a stateful DP step draws from: a generator (``None`` makes a fresh entropy one) or a stateless key."""
    if seed is None:
        return entropy_generator()
    if isinstance(seed, tf.random.Generator):
        return seed
    return stateless_key(seed)
