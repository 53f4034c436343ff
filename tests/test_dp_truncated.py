"""Truncated Poisson sampling (``per_example_grads.dp.truncated``): its law, its accounting, and where it meets the rest.

The law is checked against an enumeration of every subset (tiny N) and a
simulation against it (participation frequencies, batch sizes); every
epsilon against dp_accounting's own event, built here; the ledger's merge
against its stated dominating event; and DPModel runs across a second fit,
train_on_batch, save and restore, a new process, a budget, physical chunks
and XLA (replicas: tests/test_distribute_mirrored.py; refused pairings:
tests/test_dp_composition.py).
"""

from __future__ import annotations

import itertools
import json
import math
import re

import dp_accounting
import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import per_example_grads as peg
from helpers import run_here, run_in_new_process
from per_example_grads.apps import cli
from per_example_grads.dp import accounting, ledger
from per_example_grads.dp.truncated import inclusion_probability
from tolerances import PRINTED_RTOL, Z_EACH, Z, clipped_sum_rtol, sgd_steps_atol

N, Q, B = 64, 0.25, 18  # expected batch 16, sd 3.5: truncation in about a third of the steps
X = np.random.default_rng(0).normal(size=(N, 4)).astype("float32")
Y = (np.arange(N) % 3).astype("int64")
DELTA = 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _batches(seed=0, steps=None, **kw):
    return peg.dp.truncated_poisson_batches(
        X, Y, sampling_probability=Q, truncated_batch_size=B, seed=seed, steps=steps, **kw
    )


def _dp(sigma=2.0, **kw):
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    dp = peg.keras.DPModel(net, noise_multiplier=sigma, seed=0, **kw)
    dp.compile(optimizer="sgd", loss=LOSS)
    return dp


def _pld(*events):
    """dp_accounting's PLD epsilon at DELTA of ``events`` composed (built here, independently of the library)."""
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent(list(events)))
    return accountant.get_epsilon(DELTA)


def _truncated(steps, sigma=2.0, q=Q, b=B, n=N):
    return dp_accounting.SelfComposedDpEvent(dp_accounting.TruncatedSubsampledGaussianDpEvent(n, q, b, sigma), steps)


def _poisson(steps, sigma=2.0, q=Q):
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )


# ---------------------------------------------------------------------------------------------------------
# The law
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, q, b", [(4, 0.5, 2), (5, 0.3, 1), (5, 0.9, 3), (3, 0.5, 3)])
def test_the_inclusion_probability_is_that_of_every_subset_enumerated(n, q, b):
    # P(example 0 kept) = sum over the sampled sets S that hold it of P(S) * min(1, b / |S|).
    want = sum(
        q ** len(s) * (1 - q) ** (n - len(s)) * min(1.0, b / len(s))
        for k in range(1, n + 1)
        for s in itertools.combinations(range(n), k)
        if 0 in s
    )
    assert inclusion_probability(n, q, b) == pytest.approx(want, rel=1e-12)


def test_participations_and_batch_sizes_follow_the_law():
    n, q, b, steps = 40, 0.5, 15, 1500
    ds = peg.dp.truncated_poisson_batches(
        np.arange(n, dtype="float32")[:, None], sampling_probability=q, truncated_batch_size=b, steps=steps, seed=3
    )
    counts, sizes = np.zeros(n), []
    for xb, yb, mask in ds:
        real = int(mask.numpy().sum())
        rows = xb.numpy()[:, 0]
        ids = rows[:real].astype(int)
        assert yb is None and xb.shape == (b, 1) and mask.numpy()[:real].all()
        assert (np.diff(ids) > 0).all() and not rows[real:].any()  # kept in index order, then zero padding
        counts[ids] += 1
        sizes.append(real)
    p = inclusion_probability(n, q, b)
    # Every example's count is Binomial(steps, p): each within Z_EACH standard errors (tolerances).
    se = math.sqrt(steps * p * (1 - p))
    assert np.abs(counts - steps * p).max() <= Z_EACH * se
    # The batch has min(Binomial(n, q), b) rows: its mean and its chance to be full.
    k = np.arange(n + 1)
    pmf = stats.binom.pmf(k, n, q)
    mean, full = float(np.dot(pmf, np.minimum(k, b))), float(stats.binom.sf(b - 1, n, q))
    sd = math.sqrt(float(np.dot(pmf, np.minimum(k, b) ** 2)) - mean**2)
    assert abs(np.mean(sizes) - mean) <= Z * sd / math.sqrt(steps)
    assert abs(np.mean(np.array(sizes) == b) - full) <= Z * math.sqrt(full * (1 - full) / steps)


def test_batches_are_reproducible_and_a_later_first_step_continues_them():
    def rows(ds):
        return [xb.numpy()[mask.numpy() == 1, 0].tolist() for xb, _, mask in ds]

    whole = rows(_batches(seed=7, steps=6))
    assert whole == rows(_batches(seed=7, steps=6))
    assert rows(_batches(seed=7, steps=3, first_step=3)) == whole[3:]
    assert whole != rows(_batches(seed=8, steps=6))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(truncated_batch_size=0), "truncated_batch_size"),
        (dict(truncated_batch_size=2.5), "truncated_batch_size"),
        (dict(sampling_probability=0.0), "sampling_probability"),
        (dict(steps=0), "steps"),
        (dict(first_step=-1), "first_step"),
    ],
)
def test_bad_arguments_are_named(kw, match):
    args = dict(sampling_probability=Q, truncated_batch_size=B) | kw
    with pytest.raises((ValueError, TypeError), match=match):
        peg.dp.truncated_poisson_batches(X, Y, **args)


def test_a_dataset_of_examples_gives_the_batches_of_its_stacked_arrays():
    def rows(ds):
        return [(xb.numpy()[mask.numpy() == 1].tolist(), yb.numpy()[mask.numpy() == 1].tolist()) for xb, yb, mask in ds]

    examples = tf.data.Dataset.from_tensor_slices((X, Y))
    read = peg.dp.truncated_poisson_batches_from_dataset(
        examples, N, sampling_probability=Q, truncated_batch_size=B, seed=7, steps=6
    )
    assert rows(read) == rows(_batches(seed=7, steps=6))
    fields = lambda s: (type(s), s.sampling_probability, s.num_examples, s.max_batch_size, s.steps, s.truncation)  # noqa: E731
    assert fields(read.pegrad_sampling) == fields(_batches(seed=7, steps=6).pegrad_sampling)
    assert read.pegrad_sampling.truncation == (B, N)


@pytest.mark.parametrize(
    "dataset, kw, match",
    [
        (lambda: tf.data.Dataset.from_tensor_slices((X, Y)).repeat(2), {}, "repeat"),
        (lambda: tf.data.Dataset.from_tensor_slices((X, Y)), dict(num_examples=N + 1), "num_examples"),
        (lambda: tf.data.Dataset.from_tensor_slices((X, Y)), dict(truncated_batch_size=0), "truncated_batch_size"),
        (lambda: X, {}, "tf.data.Dataset"),
    ],
)
def test_a_dataset_is_checked_as_poisson_batches_from_dataset_checks_it(dataset, kw, match):
    args = dict(sampling_probability=Q, truncated_batch_size=B) | kw
    with pytest.raises((ValueError, TypeError), match=match):
        peg.dp.truncated_poisson_batches_from_dataset(dataset(), **args)


# ---------------------------------------------------------------------------------------------------------
# Planning: compute_epsilon and noise_multiplier_for_epsilon
# ---------------------------------------------------------------------------------------------------------


def test_compute_epsilon_is_dp_accountings_truncated_event():
    got = peg.dp.compute_epsilon(N, Q * N, None, 2.0, DELTA, steps=20, truncated_batch_size=B)
    assert got == pytest.approx(_pld(_truncated(20)), rel=1e-12)
    # Truncation costs epsilon; at B = N it never happens.
    never = peg.dp.compute_epsilon(N, Q * N, None, 2.0, DELTA, steps=20, truncated_batch_size=N)
    assert got > never == pytest.approx(peg.dp.compute_epsilon(N, Q * N, None, 2.0, DELTA, steps=20), rel=1e-9)


def test_the_rdp_accountant_accounts_the_dominating_event_which_bounds_the_truncated_one():
    rdp = peg.dp.compute_epsilon(N, Q * N, None, 2.0, DELTA, steps=20, truncated_batch_size=B, accountant="rdp")
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(_poisson(20, sigma=1.0))  # sensitivity 2: sigma / 2
    assert rdp == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-12)
    # The dominating event's own PLD is above the truncated one's, at every B (the lemma in accounting).
    for b in (12, 24):
        assert _pld(_truncated(20, b=b)) <= _pld(_poisson(20, sigma=1.0))


def test_noise_multiplier_for_epsilon_meets_the_target_within_rtol():
    args = dict(steps=30, truncated_batch_size=B)
    sigma = peg.dp.noise_multiplier_for_epsilon(4.0, DELTA, N, Q * N, None, rtol=1e-2, **args)
    assert peg.dp.compute_epsilon(N, Q * N, None, sigma, DELTA, **args) <= 4.0
    assert peg.dp.compute_epsilon(N, Q * N, None, sigma / 1.02, DELTA, **args) > 4.0


def test_planning_refuses_what_the_event_does_not_account():
    with pytest.raises(ValueError, match="truncated_batch_size accounts DP-SGD's independent noise.*BandMF"):
        peg.dp.compute_epsilon(
            N, 8, None, 2.0, DELTA, steps=4, truncated_batch_size=B, mechanism=peg.dp.BandMF(bands=2, num_steps=4)
        )
    with pytest.raises(ValueError, match="not rows_per_user"):
        peg.dp.compute_epsilon(N, 8, None, 2.0, DELTA, steps=4, truncated_batch_size=B, rows_per_user=2)
    with pytest.raises(ValueError, match="truncated_batch_size"):
        peg.dp.compute_epsilon(N, 8, None, 2.0, DELTA, steps=4, truncated_batch_size=0)


def test_a_truncated_event_survives_the_accountants_saved_state():
    accountant = peg.dp.PrivacyAccountant(2.0, Q)
    accountant.step(3)
    accountant.record_event(accounting.truncated_poisson_event(2.0, Q, B, N, 5))
    restored = peg.dp.PrivacyAccountant.from_state(json.loads(json.dumps(accountant.get_state())))
    assert restored.epsilon(DELTA) == accountant.epsilon(DELTA) == pytest.approx(_pld(_poisson(3), _truncated(5)))


def test_pegrad_epsilon_plans_a_truncated_run(capsys):
    argv = ["epsilon", "--num-examples", str(N), "--batch-size", str(Q * N), "--steps", "20", "--delta", str(DELTA)]
    assert cli.main([*argv, "--noise-multiplier", "2", "--truncated-batch-size", str(B)]) == 0
    out = capsys.readouterr().out
    printed = float(re.search(r"epsilon = ([0-9.eE+-]+)", out).group(1))
    assert printed == pytest.approx(_pld(_truncated(20)), rel=PRINTED_RTOL) and f"truncated to {B} rows" in out
    for extra, message in (
        (["--mechanism", "bandmf", "--bands", "2"], "--truncated-batch-size needs --mechanism dp-sgd"),
        (["--sampling", "shuffle"], "--truncated-batch-size needs --sampling poisson"),
        (["--rows-per-user", "2"], "not with --rows-per-user"),
        (["--monte-carlo"], "not with --monte-carlo"),
    ):
        with pytest.raises(SystemExit):
            cli.main([*argv, "--noise-multiplier", "2", "--truncated-batch-size", str(B), *extra])
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# The ledger
# ---------------------------------------------------------------------------------------------------------


def test_the_ledger_keeps_b_and_n_per_segment():
    t = ledger.empty()
    for truncation in [(B, N), (B, N), (B + 2, N), (0, 0)]:
        t = ledger.recorded(t, 1.0, Q, True, truncation)
    assert ledger.events(t.numpy(), 4) == [
        ledger.Segment(2, 1.0, Q, True, B, N),
        ledger.Segment(1, 1.0, Q, True, B + 2, N),
        ledger.Segment(1, 1.0, Q, True),
    ]


def test_a_full_table_merges_a_truncated_step_at_its_dominating_event_once():
    t = ledger.empty()
    for i in range(ledger.SEGMENTS):
        t = ledger.recorded(t, 2.0 + i, 0.25, True)
    t = ledger.recorded(t, 1.0, 0.5, True, (B, N))  # truncated: at sigma / 2, q = max(0.25, 0.5)
    t = ledger.recorded(t, 0.8, 0.1, True)  # untruncated: at its own sigma, not halved again
    last = ledger.events(t.numpy(), ledger.SEGMENTS + 2)[-1]
    assert last == ledger.Segment(3, 0.5, 0.5, True, ledger.DOMINATING, 0)
    assert not last.truncated  # accounted as the Poisson-sampled Gaussian it is
    t = ledger.recorded(t, 0.4, 0.1, True)
    assert ledger.events(t.numpy(), ledger.SEGMENTS + 3)[-1].noise_multiplier == 0.4


def test_a_table_saved_before_truncation_is_read_as_untruncated():
    old = np.zeros((ledger.SEGMENTS, 4))
    old[0] = [5, 1.1, 0.25, 1]
    assert ledger.events(old, 5) == [ledger.Segment(5, 1.1, 0.25, True)]
    assert ledger.upgraded(old).shape == (ledger.SEGMENTS, ledger.COLUMNS)


# ---------------------------------------------------------------------------------------------------------
# DPModel
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def truncated_run():
    """Two passes of truncated Poisson steps (read, never changed, by the tests that take it)."""
    dp = _dp()
    dp.fit(_batches(), epochs=2, verbose=0)
    return dp


def test_fit_accounts_each_step_by_the_truncated_event(truncated_run):
    steps = int(truncated_run.dp_steps.numpy())
    assert steps == 8 and ledger.events(truncated_run.aggregator.segments.numpy(), steps) == [
        ledger.Segment(8, 2.0, Q, True, B, N)
    ]
    assert truncated_run.epsilon(DELTA) == pytest.approx(_pld(_truncated(8)), rel=1e-12)
    assert truncated_run.epsilon(DELTA) > _pld(_poisson(8))  # not the untruncated figure


def test_a_second_fit_and_train_on_batch_compose_with_the_truncated_steps():
    dp = _dp()
    dp.fit(_batches(), verbose=0)  # 4 truncated steps
    dp.fit(peg.dp.poisson_batches(X, Y, sampling_probability=Q, seed=1), verbose=0)  # 4 Poisson steps
    assert dp.epsilon(DELTA) == pytest.approx(_pld(_truncated(4), _poisson(4)), rel=1e-12)
    dp.train_on_batch(X[:8], Y[:8])  # a fixed-size step at q = 8 / N
    with pytest.warns(UserWarning, match="not a proven bound"):
        eps = dp.epsilon(DELTA)
    assert eps == pytest.approx(_pld(_truncated(4), _poisson(4), _poisson(1, q=8 / N)), rel=1e-12)


@pytest.mark.parametrize("how", ["save_weights", "network file"])
def test_a_restored_run_keeps_its_truncated_steps(tmp_path, truncated_run, how):
    path = str(tmp_path / ("run.weights.h5" if how == "save_weights" else "net.keras"))
    (truncated_run.save_weights if how == "save_weights" else truncated_run.model.save)(path)
    restored = _dp(sigma=3.0)
    restored.load_weights(path)
    restored.fit(_batches(seed=1), verbose=0)  # 4 more at sigma 3
    assert restored.epsilon(DELTA) == pytest.approx(_pld(_truncated(8), _truncated(4, sigma=3.0)), rel=1e-12)


_PROCESS = """
import sys
import keras, numpy as np
import per_example_grads as peg
path, what = sys.argv[1:]
x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = (np.arange(64) % 3).astype("int64")
net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
dp = peg.keras.DPModel(net, noise_multiplier=2.0, seed=0)
dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
if what == "load":
    dp.load_weights(path)
batches = peg.dp.truncated_poisson_batches(x, y, sampling_probability=0.25, truncated_batch_size=18, seed=None)
dp.fit(batches, verbose=0)
dp.save_weights(path)
print(int(dp.dp_steps.numpy()), repr(dp.epsilon(1e-5)))
"""


def test_a_new_process_continues_the_ledger(tmp_path):
    path = str(tmp_path / "run.weights.h5")
    assert run_here(_PROCESS, path, "first").split()[0] == "4"
    steps, eps = run_in_new_process(_PROCESS, path, "load").split()
    assert int(steps) == 8 and float(eps) == pytest.approx(_pld(_truncated(8)), rel=1e-12)


@pytest.mark.parametrize("how", ["save_weights", "network file"])
def test_a_file_older_than_the_truncation_columns_loads(tmp_path, how):
    dp = _dp()
    dp.fit(peg.dp.poisson_batches(X, Y, sampling_probability=Q, seed=0), verbose=0)
    path = str(tmp_path / "old.weights.h5")
    (dp.save_weights if how == "save_weights" else dp.model.save_weights)(path)
    with h5py.File(path, "a") as f:  # as an earlier version wrote it: 4 columns, in every copy of the ledger
        names = []
        f.visititems(
            lambda name, item: names.append(name) if name.endswith(("aggregator/vars/6", "segments")) else None
        )
        assert names
        for name in names:
            table = f[name][()]
            del f[name]
            f[name] = table[:, :4]
    old = _dp()
    old.load_weights(path)
    old.fit(_batches(seed=1), verbose=0)
    assert old.epsilon(DELTA) == pytest.approx(_pld(_poisson(4), _truncated(4)), rel=1e-12)


def test_a_ledger_without_segments_takes_truncated_steps_at_their_dominating_event(tmp_path):
    dp = _dp()
    dp.fit(peg.dp.poisson_batches(X, Y, sampling_probability=0.5, seed=0, steps=3), verbose=0)
    path = str(tmp_path / "older.weights.h5")
    dp.save_weights(path)
    with h5py.File(path, "a") as f:  # no segments at all: the worst case of every step
        del f["aggregator/vars/6"], f["layers/sequential/_dp_ledger/vars/segments"]
    old = _dp()
    old.load_weights(path)
    old.fit(_batches(seed=1), verbose=0)  # 4 truncated steps at q = 0.25
    # All 7 steps at the largest q and the dominating event's sigma / 2.
    assert old.epsilon(DELTA) == pytest.approx(_pld(_poisson(7, sigma=1.0, q=0.5)), rel=1e-12)


@pytest.mark.slow
def test_a_budget_stops_a_truncated_run_within_it():
    budget = peg.dp.PrivacyBudget(epsilon=4.0, delta=DELTA, rtol=0.1)
    dp = _dp(budget=budget)
    dp.fit(peg.dp.poisson_batches(X, Y, sampling_probability=Q, seed=0, steps=3), verbose=0)
    dp.fit(_batches(seed=1, steps=3), verbose=0)
    # The next fit extends the ledger's last row (3 truncated steps): the budget must count them too.
    taken = [(3, 2.0, Q), (3, 2.0, Q, B, N)]
    assert dp.max_steps() == budget.max_steps(
        noise_multiplier=2.0, sampling_probability=Q, taken=taken, truncation=(B, N)
    )
    with pytest.warns(UserWarning, match="stopped after DP step"):
        dp.fit(_batches(seed=2, steps=400), verbose=0)
    steps = int(dp.dp_steps.numpy()) - 3
    assert ledger.events(dp.aggregator.segments.numpy(), steps + 3)[-1].steps == steps
    assert dp.epsilon(DELTA) <= 4.0
    # At most rtol (10%) short of the most steps the budget allows (dp_accounting's events, built here).
    assert _pld(_poisson(3), _truncated(steps + max(1, int(0.1 * (steps + 3))) + 1)) > 4.0


def test_physical_chunks_and_xla_train_as_the_whole_batch():
    weights = []
    for kw in (dict(), dict(physical_batch_size=5), dict(jit_compile=True)):
        jit = kw.pop("jit_compile", False)
        dp = _dp(sigma=0.0, l2_norm_clip=0.5, **kw)
        dp.compile(optimizer=keras.optimizers.SGD(0.5), loss=LOSS, jit_compile=jit)
        dp.fit(_batches(steps=5), verbose=0)
        assert ledger.events(dp.aggregator.segments.numpy(), 5) == [ledger.Segment(5, 0.0, Q, True, B, N)]
        weights.append(dp.model.get_weights())
    p = sum(w.size for w in weights[0])
    update_scale = B * 0.5 / (Q * N)  # at most B rows of clip 0.5 over q N
    for other in weights[1:]:
        for got, want in zip(other, weights[0]):
            atol = sgd_steps_atol(5, 0.5, clipped_sum_rtol(p, B), update_scale, np.abs(want) + 5 * 0.5 * update_scale)
            np.testing.assert_allclose(got, want, rtol=0, atol=float(np.max(atol)))
