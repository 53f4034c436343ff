"""The ledger's segments: a run's steps as runs of identical releases, for the accountant.

A ``DPAggregator`` counts its steps and keeps, beside the count, a float64
``[SEGMENTS, 4]`` table (saved with it): row ``k`` is a segment of
``steps_k`` consecutive steps at noise multiplier ``sigma_k``, sampling
probability ``q_k``, and Poisson sampling or not (``1`` / ``0``). A step
extends the last segment when it has that segment's ``sigma`` and sampling
kind and, if Poisson sampled, its ``q`` (a fixed-size batch's ``q = rows /
N`` varies with the batch: the segment keeps the largest); otherwise it
opens the next row. So a run whose sampling changed (a second ``fit`` at
another ``q``, ``train_on_batch`` after a Poisson ``fit``, a restore into a
``DPModel`` with another ``sigma``) is accounted as the composition of its
segments,

    eps = accountant( compose_k PoissonSampled(q_k, Gaussian(sigma_k)) ^ steps_k )

instead of every step at the smallest ``sigma`` and the largest ``q``.
Adaptive composition makes this sound: each segment is a mechanism whose
privacy the accountant bounds whatever came before it.

Two cases keep the worst-case single segment (``min sigma``, ``max q``,
all steps): a correlated mechanism, whose noise spans segment boundaries
(its accounting covers the run as one); and a table that does not add up to
the step counter (a checkpoint saved before the table existed, restored into
a newer ``DPModel``), which ``events`` reports as None. The last row takes
every step past ``SEGMENTS - 1`` changes, merged at the worst case of its
steps (smallest ``sigma``, largest ``q``, Poisson only if all were), which
can only over-report.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf

SEGMENTS = 16  # rows of the table


class Segment(NamedTuple):
    """``steps`` consecutive releases at ``noise_multiplier`` and ``sampling_probability``."""

    steps: int
    noise_multiplier: float
    sampling_probability: float
    poisson: bool


def empty() -> np.ndarray:
    """The table of a run without steps: ``[SEGMENTS, 4]`` zeros."""
    return np.zeros((SEGMENTS, 4), np.float64)


def recorded(table: tf.Tensor, noise_multiplier, sampling_probability, poisson) -> tf.Tensor:
    """``table`` with one more step at ``(sigma, q, poisson)``: the last segment extended, or the next row opened.

    A graph function of tensors (XLA and replicas alike): no branch on values.
    """
    table = tf.convert_to_tensor(table, tf.float64)
    sigma, q, p = (_float64(v) for v in (noise_multiplier, sampling_probability, poisson))
    used = tf.reduce_sum(tf.cast(table[:, 0] > 0, tf.int32))
    last = table[tf.maximum(used - 1, 0)]
    same = (used > 0) & tf.equal(last[1], sigma) & tf.equal(last[3], p) & (tf.equal(p, 0.0) | tf.equal(last[2], q))
    full = used >= SEGMENTS  # no row left: the last one takes the step at the worst case
    extend = same | full
    index = tf.where(extend, tf.maximum(used - 1, 0), used)
    old = table[index]
    fresh = tf.stack([1.0, sigma, q, p])
    merged = tf.stack([old[0] + 1.0, tf.minimum(old[1], sigma), tf.maximum(old[2], q), tf.minimum(old[3], p)])
    row = tf.where(extend, merged, fresh)
    return tf.tensor_scatter_nd_update(table, [[index]], [row])


def _float64(value) -> tf.Tensor:
    """``value`` in float64; a Python number exactly (``tf.cast`` would round it through float32 first)."""
    return tf.cast(value, tf.float64) if tf.is_tensor(value) else tf.constant(value, tf.float64)


def events(table: np.ndarray, steps: int) -> list[Segment] | None:
    """The segments of ``table``, or None when they do not add up to ``steps`` (a table older than its run)."""
    table = np.asarray(table, np.float64)
    rows = [Segment(int(r[0]), float(r[1]), float(r[2]), bool(r[3])) for r in table if r[0] > 0]
    if sum(s.steps for s in rows) != steps:
        return None
    return rows


def projection(
    rows: list[Segment], noise_multiplier: float, sampling_probability: float, poisson: bool
) -> list[Segment]:
    """``rows`` as ``recorded`` will hold further steps at ``(sigma, q, poisson)``: the last row is the one that grows.

    The first further step extends the last row when it is the same release
    or the table is full, merged as ``recorded`` merges (smallest ``sigma``,
    largest ``q``); otherwise it opens a row, here of 0 steps. Every later
    step at the same ``(sigma, q, poisson)`` extends that row, so the run's
    ledger after ``n`` more steps is the rows returned with ``n`` added to the
    last one's steps (what a budget searches over).
    """
    sigma, q = float(noise_multiplier), float(sampling_probability)
    if rows:
        last = rows[-1]
        same = (
            last.noise_multiplier == sigma
            and last.poisson == poisson
            and (not poisson or last.sampling_probability == q)
        )
        if same or len(rows) >= SEGMENTS:
            merged = Segment(
                last.steps,
                min(last.noise_multiplier, sigma),
                max(last.sampling_probability, q),
                last.poisson and poisson,
            )
            return [*rows[:-1], merged]
    return [*rows, Segment(0, sigma, q, poisson)]
