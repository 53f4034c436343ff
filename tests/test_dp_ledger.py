"""The ledger's segments (``per_example_grads.dp.ledger``): a run whose sampling or noise changed is accounted as it ran.

Checked against dp_accounting's own composition of the same events, built
here independently of the library; against the worst case the ledger gave
before (every step at the smallest sigma and the largest q), which must stay
the answer where segments cannot be trusted (a file older than them, a
correlated mechanism); and across save, restore and a DPModel of another
sigma.
"""

from __future__ import annotations

import functools
import warnings

import dp_accounting
import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from per_example_grads.dp import ledger

N = 64
X = np.random.default_rng(0).normal(size=(N, 4)).astype("float32")
Y = (np.arange(N) % 3).astype("int64")
DELTA = 1e-5


def _dp(sigma=1.0, **kw):
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    dp = peg.keras.DPModel(net, noise_multiplier=sigma, seed=0, **kw)
    dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return dp


def _batches(q, seed=0):
    return peg.dp.poisson_batches(X, Y, sampling_probability=q, seed=seed)


@functools.lru_cache(maxsize=None)  # ~1 s each; several tests compose the same runs
def _exact(*segments):
    """dp_accounting's PLD epsilon of the composition of ``(steps, sigma, q)`` Poisson-sampled Gaussian runs."""
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
            )
            for steps, sigma, q in segments
        ]
    )
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(event)
    return accountant.get_epsilon(DELTA)


def _table(*rows):
    """The ``[SEGMENTS, COLUMNS]`` table of ``rows``, each padded with zeros (no truncation)."""
    rows = [list(r) + [0] * (ledger.COLUMNS - len(r)) for r in rows]
    return np.array(rows + [[0] * ledger.COLUMNS] * (ledger.SEGMENTS - len(rows)), np.float64)


def test_a_step_extends_the_last_segment_or_opens_the_next():
    t = ledger.empty()
    t = ledger.recorded(t, 1.0, 0.25, True)
    t = ledger.recorded(t, 1.0, 0.25, True)
    t = ledger.recorded(t, 1.0, 0.5, True)  # another q: a new segment
    t = ledger.recorded(t, 1.0, 0.3, False)  # not Poisson: a new one
    t = ledger.recorded(t, 1.0, 0.4, False)  # fixed-size batches keep the largest q
    t = ledger.recorded(t, 2.0, 0.4, False)  # another sigma
    np.testing.assert_array_equal(
        t.numpy(), _table([2, 1.0, 0.25, 1], [1, 1.0, 0.5, 1], [2, 1.0, 0.4, 0], [1, 2.0, 0.4, 0])
    )
    assert ledger.events(t.numpy(), 6) == [
        ledger.Segment(2, 1.0, 0.25, True),
        ledger.Segment(1, 1.0, 0.5, True),
        ledger.Segment(2, 1.0, 0.4, False),
        ledger.Segment(1, 2.0, 0.4, False),
    ]
    assert ledger.events(t.numpy(), 7) is None  # a table that does not add up to the counter is not used


def test_past_the_last_row_steps_merge_at_the_worst_case():
    t = ledger.empty()
    record = tf.function(ledger.recorded, jit_compile=True)  # as a DPModel step under XLA records it
    for i in range(ledger.SEGMENTS + 3):
        t = record(t, 1.0 + (i % 2), 0.1 * (1 + i % 3), i % 5 != 0)
    events = ledger.events(t.numpy(), ledger.SEGMENTS + 3)
    assert len(events) == ledger.SEGMENTS and events[-1].steps == 4
    last = [(1.0 + (i % 2), 0.1 * (1 + i % 3), i % 5 != 0) for i in range(ledger.SEGMENTS - 1, ledger.SEGMENTS + 3)]
    assert events[-1].noise_multiplier == min(s for s, _, _ in last)
    assert events[-1].sampling_probability == pytest.approx(max(q for _, q, _ in last))
    assert events[-1].poisson == all(p for _, _, p in last)


def test_the_table_is_read_without_slices_xla_would_need_constant():
    """Under XLA a strided slice's bounds are compile-time constants: one computed from the table made the table one,
    and a jit_compile'd DPModel recompiled its step at every step (2 s a step for a small MLP). Rows are gathered."""
    spec = tf.TensorSpec([ledger.SEGMENTS, ledger.COLUMNS], tf.float64)
    scalar = tf.TensorSpec([], tf.float64)
    graph = tf.function(ledger.recorded, autograph=False).get_concrete_function(spec, scalar, scalar, True).graph
    slices = [op for op in graph.get_operations() if op.type == "StridedSlice"]
    assert slices and all(op.inputs[k].op.type == "Const" for op in slices for k in (1, 2, 3))


@pytest.fixture(scope="module")
def two_fits():
    """A run of two fits at different q (read, never changed, by the tests that take it)."""
    dp = _dp()
    dp.fit(_batches(0.25), epochs=1, verbose=0)  # 4 steps
    dp.fit(_batches(0.5, seed=1), epochs=4, verbose=0)  # 8 steps
    return dp


def test_two_fits_at_different_q_are_accounted_as_two_segments(two_fits):
    # The ledger took all 12 steps at q = 0.5.
    dp = two_fits
    assert int(dp.dp_steps.numpy()) == 12
    expected = _exact((4, 1.0, 0.25), (8, 1.0, 0.5))
    assert dp.epsilon(DELTA) == pytest.approx(expected, rel=1e-9)
    assert expected < _exact((12, 1.0, 0.5))  # the worst case it replaces


def test_train_on_batch_after_a_poisson_fit_is_its_own_segment():
    dp = _dp()
    dp.fit(_batches(0.25), epochs=1, verbose=0)
    dp.train_on_batch(X[:8], Y[:8])  # a fixed-size batch at q = 8 / 64
    with pytest.warns(UserWarning, match="not a proven bound"):
        eps = dp.epsilon(DELTA)
    assert eps == pytest.approx(_exact((4, 1.0, 0.25), (1, 1.0, 8 / N)), rel=1e-9)


@pytest.mark.parametrize("how", ["save_weights", "network file"])
def test_a_run_restored_into_a_dpmodel_of_another_sigma_composes_both(tmp_path, how):
    first = _dp(sigma=1.0)
    first.fit(_batches(0.25), epochs=2, verbose=0)  # 8 steps at sigma 1
    path = str(tmp_path / ("run.weights.h5" if how == "save_weights" else "net.keras"))
    (first.save_weights if how == "save_weights" else first.model.save)(path)
    second = _dp(sigma=2.0)
    second.load_weights(path)
    second.fit(_batches(0.25, seed=1), epochs=1, verbose=0)  # 4 more at sigma 2
    expected = _exact((8, 1.0, 0.25), (4, 2.0, 0.25))
    assert second.epsilon(DELTA) == pytest.approx(expected, rel=1e-9)
    assert expected < _exact((12, 1.0, 0.25))  # every step at the smallest sigma, as before


def test_a_file_older_than_the_segments_is_accounted_by_its_worst_case(tmp_path, two_fits):
    path = str(tmp_path / "old.weights.h5")
    two_fits.save_weights(path)
    with h5py.File(path, "a") as f:  # such a file: no segments, here or in the network's copy of the ledger
        assert f["aggregator/vars/6"].shape == (ledger.SEGMENTS, ledger.COLUMNS)
        del f["aggregator/vars/6"], f["layers/sequential/_dp_ledger/vars/segments"]
    old = _dp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no network-ledger complaint: a file without the entry is older
        old.load_weights(path)
    assert int(old.dp_steps.numpy()) == 12
    assert old.epsilon(DELTA) == pytest.approx(_exact((12, 1.0, 0.5)), rel=1e-9)


def test_a_correlated_mechanism_is_still_accounted_as_one_run():
    # Its noise spans segment boundaries: the segments must not split its accounting.
    band = peg.dp.BandMF(bands=2, num_steps=16)
    dp = _dp(mechanism=band)
    dp.fit(peg.dp.poisson_batches(X, Y, sampling_probability=0.5, cycle_length=2, seed=0), epochs=2, verbose=0)
    steps = int(dp.dp_steps.numpy())
    expected = peg.dp.compute_epsilon(N, 16, None, 1.0, DELTA, steps=steps, mechanism=band)
    assert dp.epsilon(DELTA) == pytest.approx(expected, rel=1e-12)


def test_the_segments_hold_sigma_and_q_exactly():
    # Through float32 they would round (0.1 -> 0.10000000149), and epsilon with them.
    dp = _dp(sigma=1.1)
    dp.fit(peg.dp.poisson_batches(X, Y, sampling_probability=0.3, seed=0), epochs=1, verbose=0)
    (segment,) = ledger.events(dp.aggregator.segments.numpy(), int(dp.dp_steps.numpy()))
    assert (segment.noise_multiplier, segment.sampling_probability) == (1.1, 0.3)
    expected = peg.dp.compute_epsilon(N, 0.3 * N, None, 1.1, DELTA, steps=segment.steps)
    assert dp.epsilon(DELTA) == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------------------------------------------------
# The budget reads the segments too
# ---------------------------------------------------------------------------------------------------------

PROJECTED = {  # the ledger's rows, then further steps at (sigma, q, poisson)
    "empty": ([], (1.0, 0.25, True)),
    "same Poisson release": ([[2, 1.0, 0.25, 1]], (1.0, 0.25, True)),
    "another q": ([[2, 1.0, 0.25, 1]], (1.0, 0.5, True)),
    "fixed-size, same sigma, smaller q": ([[2, 1.0, 0.4, 0]], (1.0, 0.1, False)),
    "fixed-size after Poisson": ([[2, 1.0, 0.25, 1]], (1.0, 0.1, False)),
    "full table": ([[1, 1.0 + i, 0.25, 1] for i in range(ledger.SEGMENTS)], (0.5, 0.75, False)),
    # truncated Poisson steps, (B, N) last
    "truncated, same release": ([[2, 1.0, 0.25, 1, 20, 64]], (1.0, 0.25, True, (20, 64))),
    "truncated after Poisson": ([[2, 1.0, 0.25, 1]], (1.0, 0.25, True, (20, 64))),
    "another B": ([[2, 1.0, 0.25, 1, 20, 64]], (1.0, 0.25, True, (24, 64))),
    "full table, then truncated": ([[1, 1.0 + i, 0.25, 1] for i in range(ledger.SEGMENTS)], (3.0, 0.5, True, (20, 64))),
    "full table of truncated, then fixed-size": (
        [[1, 1.0 + i, 0.25, 1, 20, 64] for i in range(ledger.SEGMENTS)],
        (0.5, 0.75, False, (0, 0)),
    ),
    "dominating row, then truncated": (
        [[1, 1.0 + i, 0.25, 1] for i in range(ledger.SEGMENTS - 1)] + [[3, 0.4, 0.5, 1, ledger.DOMINATING, 0]],
        (0.6, 0.25, True, (20, 64)),
    ),
}


@pytest.mark.parametrize("case", sorted(PROJECTED))
def test_the_projection_is_what_recording_the_steps_makes(case):
    rows, (sigma, q, poisson, *truncation) = PROJECTED[case]
    truncation = tuple(truncation[0]) if truncation else (0, 0)
    table = _table(*rows)
    taken = sum(int(r[0]) for r in rows)
    for _ in range(3):
        table = ledger.recorded(table, sigma, q, poisson, truncation)
    *kept, growing = ledger.projection(ledger.events(_table(*rows), taken) or [], sigma, q, poisson, truncation)
    assert ledger.events(table.numpy(), taken + 3) == [*kept, growing._replace(steps=growing.steps + 3)]


@pytest.mark.slow
def test_a_budget_counts_earlier_steps_at_their_own_sampling():
    """A second fit at a smaller q runs until the composed epsilon, not the worst case, reaches the budget."""
    budget = peg.dp.PrivacyBudget(epsilon=9.0, delta=DELTA)
    dp = _dp(budget=budget)
    dp.fit(peg.dp.poisson_batches(X, Y, sampling_probability=0.5, steps=4, seed=0), verbose=0)
    with pytest.warns(UserWarning, match="stopped after DP step"):
        dp.fit(peg.dp.poisson_batches(X, Y, sampling_probability=0.125, steps=200, seed=1), verbose=0)
    steps = int(dp.dp_steps.numpy())
    # Within the budget, and at most rtol (1%) short of the most steps it allows (dp_accounting, built here).
    assert _exact((4, 1.0, 0.5), (steps - 4, 1.0, 0.125)) <= 9.0
    assert _exact((4, 1.0, 0.5), (steps - 4 + max(1, int(0.01 * steps)) + 1, 1.0, 0.125)) > 9.0
    assert dp.epsilon(DELTA) <= 9.0
    # Every step at the worst case (q = 0.5) would have stopped the run far earlier: 30 steps fewer already exceed
    # the budget (dp_accounting, built here; at least as strict as the search's max_steps < steps - 30, and one
    # epsilon instead of a search).
    assert _exact((steps - 30, 1.0, 0.5)) > 9.0


@pytest.mark.slow
def test_a_budget_after_fixed_size_steps_counts_them_at_their_largest_q():
    budget = peg.dp.PrivacyBudget(epsilon=9.0, delta=DELTA, accountant="rdp")
    dp = _dp(budget=budget, num_examples=N)
    for _ in range(3):
        dp.train_on_batch(X[:16], Y[:16])  # fixed-size, q = 16 / 64
    limit = dp._max_steps_for(dp._unknown_sampling(largest_batch=4))  # more fixed-size steps, q = 4 / 64
    # The ledger merges them into the same row at the largest q (recorded): the limit is that row's.
    assert limit == budget.max_steps(noise_multiplier=1.0, sampling_probability=16 / N)
