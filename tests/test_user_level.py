"""User-level DP (issue 29, the DP side): sampling units, accounting per unit, training per unit.

The engine's grouped norms and clipped sums are tested against a one-row loop
in tests/test_units.py; here: the unit sampler, the ledger over the number of
units, the mismatches DPModel refuses, and training steps that clip each
unit's summed gradient.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from per_example_grads.dp.sampling import poisson_batches

# Uneven units: unit u has 1 + (u mod 5) rows, rows of units interleaved (not adjacent).
U = 120
SIZES = 1 + np.arange(U) % 5
IDS = np.random.default_rng(0).permutation(np.repeat(1000 + 3 * np.arange(U), SIZES))  # any integer ids
ROWS = len(IDS)


def _batches(q, steps, k=None, seed=0, **kwargs):
    x = np.arange(ROWS, dtype="float32")[:, None]  # each row's own index, to check which rows came
    ds = poisson_batches(x, unit_ids=IDS, rows_per_unit=k, sampling_probability=q, steps=steps, seed=seed, **kwargs)
    out = []
    for xb, yb, mask, ids in ds:
        b = int(mask.numpy().sum())
        rows = xb.numpy()[:b, 0].astype(int)
        out.append((rows, ids.numpy(), mask.numpy(), xb.numpy()))
    return ds, out


def test_unit_inclusion_frequency_matches_q():
    q, steps, k = 0.25, 80, 3
    _, batches = _batches(q, steps, k)
    included = np.zeros(U)
    for rows, *_ in batches:
        included[np.searchsorted(1000 + 3 * np.arange(U), np.unique(IDS[rows]))] += 1
    # Every (unit, step) is an independent Bernoulli(q): the total is Binomial(U T, q).
    total, n = included.sum(), U * steps
    assert abs(total - n * q) <= 5 * math.sqrt(n * q * (1 - q))
    # Per unit, Binomial(T, q): no unit is sampled far more or less often (5 sd, over 120 units).
    assert np.all(np.abs(included - steps * q) <= 5 * math.sqrt(steps * q * (1 - q)))
    # A unit's inclusion does not depend on its size (sizes 1..5 each cover 24 units).
    for size in range(1, 6):
        mine = included[SIZES == size].sum()
        m = (SIZES == size).sum() * steps
        assert abs(mine - m * q) <= 5 * math.sqrt(m * q * (1 - q))


def test_units_bring_at_most_rows_per_unit_rows_drawn_afresh_each_step():
    k = 3
    ds, batches = _batches(1.0, 60, k)
    sampling = ds.pegrad_sampling
    assert (sampling.privacy_unit, sampling.num_examples, sampling.num_rows, sampling.rows_per_unit) == ("unit", U, ROWS, k)
    assert sampling.expected_batch_size == pytest.approx(U)
    seen = set()
    big = IDS == IDS[np.argmax(SIZES[np.searchsorted(1000 + 3 * np.arange(U), IDS)])]  # rows of a 5-row unit
    chosen_from_big = np.zeros(ROWS)
    for rows, ids, mask, xb in batches:
        b = len(rows)
        assert np.array_equal(ids[:b], IDS[rows])  # each row's id is its unit's
        assert np.all(ids[b:] == -1) and np.all(mask[b:] == 0) and np.all(xb[b:] == 0)  # padding
        assert np.all(np.diff(ids[:b]) >= 0)  # a unit's rows are consecutive, units in id order
        assert len(set(rows)) == b  # without replacement
        unit_counts = np.unique(ids[:b], return_counts=True)[1]
        assert np.array_equal(unit_counts, np.minimum(SIZES, k))  # q = 1: every unit, min(size, k) rows
        seen.update(rows.tolist())
        chosen_from_big[rows] += 1
    assert seen == set(range(ROWS))  # the rows of larger units change from step to step
    # A 5-row unit's rows are each chosen with probability 3/5 (60 steps, 5 sd).
    freq = chosen_from_big[big]
    assert np.all(np.abs(freq - 60 * 0.6) <= 5 * math.sqrt(60 * 0.6 * 0.4))


def test_default_max_batch_size_holds_the_largest_units():
    q, k = 0.1, 4
    ds, _ = _batches(q, 1, k)
    units = peg.dp.default_max_batch_size(U, q)
    assert ds.pegrad_sampling.max_batch_size == np.sort(np.minimum(SIZES, k))[::-1][:units].sum()


def test_units_of_one_row_sample_as_examples():
    x = np.random.default_rng(1).normal(size=(40, 3)).astype("float32")
    rows = poisson_batches(x, sampling_probability=0.3, seed=5, steps=6)
    units = poisson_batches(x, unit_ids=np.arange(40), sampling_probability=0.3, seed=5, steps=6)
    for (xa, _, ma), (xb, _, mb, ids) in zip(rows, units):
        np.testing.assert_array_equal(xa.numpy(), xb.numpy())
        np.testing.assert_array_equal(ma.numpy(), mb.numpy())
    assert units.pegrad_sampling.num_examples == rows.pegrad_sampling.num_examples == 40


def test_cyclic_unit_sampling_keeps_each_unit_in_one_part():
    b = 3
    _, batches = _batches(1.0, 9, 2, cycle_length=b)
    part_of = {}
    for t, (rows, ids, *_) in enumerate(batches):
        for unit in np.unique(ids[: len(rows)]):
            assert part_of.setdefault(unit, t % b) == t % b
    assert len(part_of) == U  # q = 1: every unit in its part's steps


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(unit_ids=np.arange(3)), ValueError, r"unit_ids must have shape \[N\] = \[6\]"),
        (dict(unit_ids=np.zeros(6, "float32")), TypeError, "unit_ids must be integers"),
        (dict(unit_ids=np.zeros(6, int), rows_per_unit=0), ValueError, "rows_per_unit must be a positive integer"),
        (dict(rows_per_unit=2), ValueError, "rows_per_unit=2 needs unit_ids"),
        (dict(unit_ids=np.zeros(6, int), cycle_length=2), ValueError, "at most the number of units U=1"),
    ],
)
def test_sampler_refuses_bad_unit_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        poisson_batches(np.ones((6, 2)), sampling_probability=0.5, **kwargs)


def test_too_small_max_batch_size_names_it():
    ds = poisson_batches(np.ones((6, 2)), unit_ids=[0, 0, 0, 1, 1, 1], sampling_probability=1.0, max_batch_size=4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="max_batch_size=4"):
        next(iter(ds))
