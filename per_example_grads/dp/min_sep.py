"""b-min-sep sampling: Poisson sampling that skips the examples of the last ``b - 1`` batches.

At step ``t`` every example that joined none of the batches ``t - b + 1 ..
t - 1`` joins with probability ``p``, independently of the others; the rest
sit out (jax_privacy's ``BMinSepSampling``; Choquette-Choo et al. 2026,
arXiv 2602.09338). So any two participations of an example are at least
``b`` steps apart, and an example joins at most ``ceil(T / b)`` of ``T``
steps: the participation schema that ``BLT``'s and ``BISR``'s sensitivity
covers. Their accounting claims no amplification by sampling (one Gaussian
release of noise multiplier ``sigma / s_T``), so it holds for this sampling
as it does for cyclic Poisson sampling with ``cycle_length = b``: b-min-sep
is then the same privacy with every example free to join at any step
(instead of only in its part's turns). No accountant this library uses
bounds b-min-sep's amplification (jax_privacy estimates it by Monte Carlo),
so mechanisms accounted with amplification (``GaussianNoise``, ``BandMF``)
are refused with it (``per_example_grads.dp.composition``).

The law. Each example follows its own chain; started at its stationary law
(``warm_start``, the default: with probability ``w = (b - 1) p / (1 + (b - 1)
p)`` it joined one of the ``b - 1`` steps before the first, uniformly which,
else it is free), it joins every step with probability ``r = p / (1 + (b -
1) p) = 1 / (b - 1 + 1 / p)``, independently of the other examples. A batch
is thus ``Binomial(N, r)`` at every step (its expected size ``N r``), and
``max_batch_size`` defaults to ``default_max_batch_size(N, r)`` (overflow at
most 1e-12 per step; a batch over it stops iteration, never drops rows).
Without a warm start the first batches are larger (every example is free at
step 0: ``Binomial(N, p)``), and so is the default ``max_batch_size``.

Determinism and restarts. Step ``t``'s draw is keyed by ``(key, t)``, and the
state (every example's last step) is a function of the draws of steps ``0 ..
t - 1``: each pass replays them from step 0 to its first step (``O(t N)``
operations, in the graph; about a second per 10,000 steps of 10,000
examples), then scans its own steps. A run restored at step ``t`` therefore
continues the batches of an uninterrupted one, and a new dataset (another
``seed``, or ``seed=None``) takes the run's key from the ledger
(``partition``, ``take_partition``), so no restart can let an example join
sooner than ``b`` steps after its last participation; a dataset of other
rows is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf

from per_example_grads._core.arguments import check_positive_int, check_sampling_probability
from per_example_grads.dp.sampling import (
    DEFAULT_OVERFLOW_PROBABILITY,
    PoissonSampling,
    _padded_batch,
    _rows_digest,
    _steps_and_key,
    check_partition_scheme,
    default_max_batch_size,
    sampled_inputs,
)

# Folded into the key for the warm start's draw, so that it shares no key with a step's.
_WARM_TAG = 0x7761726D  # "warm"


@dataclasses.dataclass
class MinSepSampling(PoissonSampling):
    """A ``min_sep_batches`` dataset's sampling (its ``pegrad_sampling``): ``PoissonSampling``'s fields, and

    Attributes:
      key: int64 ``[2]`` variable, the sampling key (``take_partition`` sets
        the run's).
      warm_start: whether the chains start at their stationary law.

    ``sampling_probability`` is ``p`` (an example's chance to join a step
    when it is free), ``cycle_length`` the minimum separation ``b``.
    """

    key: tf.Variable | None = None
    warm_start: bool = True
    scheme = "min_sep"

    @property
    def participation_rate(self) -> float:
        """``r = p / (1 + (b - 1) p)``: the chance that an example joins a given step (module docstring)."""
        p, b = self.sampling_probability, self.cycle_length
        return p / (1.0 + (b - 1) * p)

    @property
    def expected_batch_size(self) -> float:
        """``N r``."""
        return self.num_examples * self.participation_rate

    @property
    def partition(self) -> np.ndarray:
        """``int64 [5]`` ``[-b, key, digest]``: what fixes every batch of the run, given the rows (a ledger saves it).

        ``-b``: the sampler, for ``sampling.check_partition_scheme``.
        """
        return np.concatenate([[-self.cycle_length], self.key.numpy(), self.rows_digest]).astype(np.int64)

    def take_partition(self, partition: np.ndarray) -> None:
        """Makes the run's key (``partition``) this dataset's, if it holds the same rows with the same ``b``.

        Raises:
          ValueError: another sampler (``sampling.check_partition_scheme``;
            a ledger saved before min-sep runs recorded ``-b`` reads as a
            cyclic one), another ``b``, or other rows (or the same rows in
            another order), for which the run's key does not give the run's
            batches.
        """
        partition = check_partition_scheme(partition, self.scheme)
        if int(partition[0]) != -self.cycle_length or not np.array_equal(partition[3:], self.rows_digest):
            raise ValueError(
                f"the run's earlier steps were b-min-sep sampled with min_separation={-int(partition[0])} from other "
                f"rows than this dataset's (min_separation={self.cycle_length}; other rows, or the same rows in "
                "another order): its batches could put an example in a step sooner than min_separation steps "
                "after its last one, which the accounting excludes. Build the dataset from the same rows, in the "
                "same order, with the same min_separation."
            )
        self.key.assign(partition[1:3])


def min_sep_batches(
    x: Any,
    y: Any = None,
    *,
    sampling_probability: float,
    min_separation: int,
    steps: int | None = None,
    seed: int | None = None,
    max_batch_size: int | None = None,
    first_step: int = 0,
    warm_start: bool = True,
) -> tf.data.Dataset:
    """Batches of b-min-sep sampling (module docstring), padded to ``max_batch_size`` rows, as ``(x, y, mask)``.

    Args:
      x, y: as for ``poisson_batches`` (leaves ``[N, ...]``).
      sampling_probability: ``p`` in ``(0, 1]``, a free example's chance to
        join a step.
      min_separation: ``b >= 2``, the fewest steps between two participations
        of an example (``b = 1`` is ``poisson_batches``); at most ``N``.
      steps: batches per pass; default one epoch in expectation,
        ``round(b - 1 + 1 / p)``.
      seed: a non-negative int for reproducible batches; None (real runs)
        seeds from OS entropy.
      max_batch_size: ``M``; default ``default_max_batch_size(N, r)``, or
        ``(N, p)`` without a warm start (every example is free at step 0).
      first_step: the global index of the first batch (``DPModel.fit`` sets
        it to its ledger's steps).
      warm_start: start every example's chain at its stationary law.

    Returns:
      A ``tf.data.Dataset`` of ``steps`` elements ``(x_batch, y_batch,
      mask)`` (``mask`` float32 ``[M]``, 1 on the real rows, which come first
      in index order), with attribute ``pegrad_sampling`` (a
      ``MinSepSampling``).

    Raises:
      ValueError, TypeError: an argument as above, named.

    Examples:
      >>> import numpy as np
      >>> ds = min_sep_batches(np.arange(12.0)[:, None], sampling_probability=1.0, min_separation=3, seed=0)
      >>> rows = [set(xb.numpy()[m.numpy() == 1, 0].astype(int)) for xb, _, m in ds]  # the examples of each step
      >>> len(rows), sorted(set.union(*rows)) == list(range(12)), sum(map(len, rows))  # p = 1: each once in 3 steps
      (3, True, 12)
    """
    p = check_sampling_probability(sampling_probability)
    b = check_positive_int("min_separation", min_separation)
    if b < 2:
        raise ValueError(
            "min_separation must be at least 2 (min_separation=1 is ordinary Poisson sampling: "
            "use peg.dp.poisson_batches)."
        )
    if not isinstance(warm_start, bool):
        raise TypeError(f"warm_start must be a bool; got {warm_start!r}.")
    inputs, n = sampled_inputs(x, y)
    if b > n:
        raise ValueError(f"min_separation ({b}) must be at most the number of examples N={n}.")
    rate = p / (1.0 + (b - 1) * p)
    # One pass is one epoch in expectation, 1 / r steps: Poisson sampling's default at the rate r.
    steps, key = _steps_and_key(steps, 1, rate, seed, first_step)
    m = check_positive_int(
        "max_batch_size",
        default_max_batch_size(n, rate if warm_start else p) if max_batch_size is None else max_batch_size,
    )
    with tf.init_scope():
        key = tf.Variable(key, trainable=False, name="min_sep_key")
        next_step = tf.Variable(int(first_step), dtype=tf.int64, trainable=False, name="next_step")
    sampling = MinSepSampling(
        p, n, m, steps, next_step, b, rows_digest=_rows_digest(inputs), key=key, warm_start=warm_start
    )
    overflow = (
        f"examples, more than max_batch_size={m} (N={n}, sampling_probability={p}, min_separation={b}). Dropping "
        "the extra examples would invalidate the privacy analysis; pass a larger max_batch_size "
        f"(default_max_batch_size(N, r) overflows with probability <= {DEFAULT_OVERFLOW_PROBABILITY:g} per step)."
    )
    unconverted = tf.autograph.experimental.do_not_convert

    def joins(last, t, step_key):
        """``[N]`` bool: who joins step ``t``, given every example's ``last`` step."""
        u = tf.random.stateless_uniform(
            [n], seed=tf.random.experimental.stateless_fold_in(step_key, t), dtype=tf.float64
        )
        return (t - last >= b) & (u < p)

    def start_state(step_key):
        """Every example's last step before step 0: ``-b`` (free), or ``-j`` for ``j`` in ``1 .. b - 1``."""
        if not warm_start:
            return tf.fill([n], tf.constant(-b, tf.int64))
        warm = tf.random.experimental.stateless_fold_in(step_key, _WARM_TAG)
        u = tf.random.stateless_uniform([n], seed=warm, dtype=tf.float64)
        w = (b - 1) * p / (1.0 + (b - 1) * p)
        # u < w: joined a step before the first, each of the b - 1 equally likely (u / w is uniform on [0, 1)).
        j = tf.minimum(tf.cast(tf.floor(u / w * (b - 1)), tf.int64), b - 2) + 1
        return tf.where(u < w, -j, tf.constant(-b, tf.int64))

    def pass_batches(_):
        start = next_step.assign_add(steps) - steps
        step_key = tf.convert_to_tensor(key)

        def replay(t, last):
            return t + 1, tf.where(joins(last, t, step_key), t, last)

        _, last = tf.while_loop(
            lambda t, _: t < start, replay, (tf.constant(0, tf.int64), start_state(step_key)), parallel_iterations=1
        )

        def scan(last, t):
            chosen = joins(last, t, step_key)
            return tf.where(chosen, t, last), tf.where(chosen)[:, 0]

        return tf.data.Dataset.range(start, start + steps).scan(last, unconverted(scan))

    def batch(chosen):
        xb, yb, mask, _ = _padded_batch(inputs, chosen, m, "A b-min-sep batch sampled", overflow)
        return xb, yb, mask

    ds = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).flat_map(unconverted(pass_batches))
    ds = ds.apply(tf.data.experimental.assert_cardinality(steps))
    ds = ds.map(unconverted(batch), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).prefetch(tf.data.AUTOTUNE)
    ds.pegrad_sampling = sampling
    return ds


__all__ = ["MinSepSampling", "min_sep_batches"]
