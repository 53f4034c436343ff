"""The ledger's segments: a run's steps as runs of identical releases, for the accountant.

A ``DPAggregator`` counts its steps and keeps, beside the count, a float64
``[SEGMENTS, 6]`` table (saved with it): row ``k`` is a segment of
``steps_k`` consecutive steps at noise multiplier ``sigma_k``, sampling
probability ``q_k``, Poisson sampling or not (``1`` / ``0``), and, for
truncated Poisson sampling (``per_example_grads.dp.truncated``), the
truncated batch size ``B_k`` and the dataset size ``N_k`` (both ``0``
without truncation). A step extends the last segment when it has that
segment's ``sigma``, sampling kind and truncation and, if Poisson sampled,
its ``q`` (a fixed-size batch's ``q = rows / N`` varies with the batch: the
segment keeps the largest); otherwise it opens the next row. So a run whose
sampling changed (a second ``fit`` at another ``q``, ``train_on_batch`` after
a Poisson ``fit``, a restore into a ``DPModel`` with another ``sigma``) is
accounted as the composition of its segments,

    eps = accountant( compose_k PoissonSampled(q_k, Gaussian(sigma_k)) ^ steps_k )

(a truncated segment: ``TruncatedSubsampledGaussian(N_k, q_k, B_k,
sigma_k) ^ steps_k``) instead of every step at the smallest ``sigma`` and the
largest ``q``. Adaptive composition makes this sound: each segment is a
mechanism whose privacy the accountant bounds whatever came before it.

Two cases keep the worst-case single segment (``min sigma``, ``max q``,
all steps): a correlated mechanism, whose noise spans segment boundaries
(its accounting covers the run as one); and a table that does not add up to
the step counter (a checkpoint saved before the table existed, restored into
a newer ``DPModel``), which ``events`` reports as None. The last row takes
every step past ``SEGMENTS - 1`` changes, merged at the worst case of its
steps (smallest ``sigma``, largest ``q``, Poisson only if all were), which
can only over-report. A merge that involves a truncated step, unless it is
the same release, is made a **dominating** row (``B = DOMINATING``): a
Poisson-sampled Gaussian at the largest ``q`` and the smallest of the steps'
``sigma``, each truncated step's halved, which dominates every step it holds
(``accounting.truncated_dominating_event`` states why).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf

SEGMENTS = 16  # rows of the table
COLUMNS = 6  # steps, sigma, q, poisson, truncated batch size, dataset size
DOMINATING = -1  # a row's truncated batch size once truncated steps were merged at their dominating event


class Segment(NamedTuple):
    """``steps`` consecutive releases at ``noise_multiplier`` and ``sampling_probability``.

    ``truncated_batch_size`` and ``dataset_size``: ``B`` and ``N`` of
    truncated Poisson sampling; ``0`` without truncation; ``B =
    DOMINATING`` for a merged row accounted as plain Poisson sampling at its
    (already halved) ``noise_multiplier`` (module docstring).
    """

    steps: int
    noise_multiplier: float
    sampling_probability: float
    poisson: bool
    truncated_batch_size: int = 0
    dataset_size: int = 0

    @property
    def truncated(self) -> bool:
        """Whether the segment is accounted as truncated Poisson sampling (its own event)."""
        return self.truncated_batch_size > 0


def empty() -> np.ndarray:
    """The table of a run without steps: ``[SEGMENTS, COLUMNS]`` zeros."""
    return np.zeros((SEGMENTS, COLUMNS), np.float64)


def upgraded(table: np.ndarray) -> np.ndarray:
    """A saved table in this version's shape: one saved before truncation had 4 columns, read as untruncated rows."""
    table = np.asarray(table, np.float64)
    if table.ndim == 2 and table.shape[1] < COLUMNS:
        table = np.pad(table, [(0, 0), (0, COLUMNS - table.shape[1])])
    return table


def recorded(table: tf.Tensor, noise_multiplier, sampling_probability, poisson, truncation=(0, 0)) -> tf.Tensor:
    """``table`` with one more step at ``(sigma, q, poisson, (B, N))``: the last segment extended, or the next row opened.

    ``truncation``: ``(B, N)`` of a truncated Poisson step, ``(0, 0)`` otherwise.
    A graph function of tensors (XLA and replicas alike): no branch on values.
    """
    table = tf.convert_to_tensor(table, tf.float64)
    sigma, q, p, b, n = (_float64(v) for v in (noise_multiplier, sampling_probability, poisson, *truncation))
    used = tf.reduce_sum(tf.cast(table[:, 0] > 0, tf.int32))
    # Rows are read with tf.gather: indexing with a tensor is a strided slice, whose bounds XLA must know when it
    # compiles, so the table became a compile-time constant and every step of a jit_compile'd DPModel recompiled.
    last = tf.gather(table, tf.maximum(used - 1, 0))
    same = (
        (used > 0)
        & tf.equal(last[1], sigma)
        & tf.equal(last[3], p)
        & (tf.equal(p, 0.0) | tf.equal(last[2], q))
        & tf.equal(last[4], b)
        & tf.equal(last[5], n)
    )
    full = used >= SEGMENTS  # no row left: the last one takes the step at the worst case
    extend = same | full
    index = tf.where(extend, tf.maximum(used - 1, 0), used)
    old = tf.gather(table, index)
    fresh = tf.stack([1.0, sigma, q, p, b, n])
    worst = [old[0] + 1.0, tf.maximum(old[2], q), tf.minimum(old[3], p)]
    merged = tf.stack([worst[0], tf.minimum(old[1], sigma), worst[1], worst[2], old[4], old[5]])
    # a truncated step merged with another release: both at their dominating Poisson-sampled Gaussian
    halved = lambda s, rows: tf.where(rows > 0, s / 2.0, s)  # noqa: E731
    dominating = tf.stack(
        [worst[0], tf.minimum(halved(old[1], old[4]), halved(sigma, b)), worst[1], worst[2], DOMINATING, 0.0]
    )
    row = tf.where(extend, tf.where(same | (tf.equal(old[4], 0.0) & tf.equal(b, 0.0)), merged, dominating), fresh)
    return tf.tensor_scatter_nd_update(table, [[index]], [row])


def _float64(value) -> tf.Tensor:
    """``value`` in float64; a Python number exactly (``tf.cast`` would round it through float32 first)."""
    return tf.cast(value, tf.float64) if tf.is_tensor(value) else tf.constant(value, tf.float64)


def events(table: np.ndarray, steps: int) -> list[Segment] | None:
    """The segments of ``table``, or None when they do not add up to ``steps`` (a table older than its run)."""
    table = upgraded(table)
    rows = [Segment(int(r[0]), float(r[1]), float(r[2]), bool(r[3]), int(r[4]), int(r[5])) for r in table if r[0] > 0]
    if sum(s.steps for s in rows) != steps:
        return None
    return rows


def holds_truncated(table: np.ndarray) -> bool:
    """Whether ``table`` has a truncated row, or one merged at a truncated step's dominating event."""
    return bool((upgraded(table)[:, 4] != 0).any())


def projection(
    rows: list[Segment],
    noise_multiplier: float,
    sampling_probability: float,
    poisson: bool,
    truncation: tuple[int, int] = (0, 0),
) -> list[Segment]:
    """``rows`` as ``recorded`` will hold further steps at ``(sigma, q, poisson, truncation)``: the last row grows.

    The first further step extends the last row when it is the same release
    or the table is full, merged as ``recorded`` merges (smallest ``sigma``,
    largest ``q``; a truncated step's merge at the dominating event);
    otherwise it opens a row, here of 0 steps. Every later step at the same
    release extends that row, so the run's ledger after ``n`` more steps is
    the rows returned with ``n`` added to the last one's steps (what a budget
    searches over).
    """
    sigma, q = float(noise_multiplier), float(sampling_probability)
    b, n = (int(v) for v in truncation)
    if rows:
        last = rows[-1]
        same = (
            last.noise_multiplier == sigma
            and last.poisson == poisson
            and (not poisson or last.sampling_probability == q)
            and (last.truncated_batch_size, last.dataset_size) == (b, n)
        )
        if same or len(rows) >= SEGMENTS:
            worst_q, both = max(last.sampling_probability, q), last.poisson and poisson
            if same or last.truncated_batch_size == b == 0:
                merged = Segment(last.steps, min(last.noise_multiplier, sigma), worst_q, both, b, n)
            else:  # the dominating row (module docstring)
                halved = lambda s, rows_: s / 2.0 if rows_ > 0 else s  # noqa: E731
                low = min(halved(last.noise_multiplier, last.truncated_batch_size), halved(sigma, b))
                merged = Segment(last.steps, low, worst_q, both, DOMINATING, 0)
            return [*rows[:-1], merged]
    return [*rows, Segment(0, sigma, q, poisson, b, n)]
