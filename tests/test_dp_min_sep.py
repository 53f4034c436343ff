"""b-min-sep sampling (``per_example_grads.dp.min_sep``): its law against jax_privacy's, and where it meets the other parts.

The reference law in ``data/jax_privacy_reference.json`` ("min_sep") was
drawn by jax_privacy 2.0.0's ``BMinSepSampling`` (warm start) in its own
virtualenv (``benchmarks/peers/jax_privacy_reference.py``).
"""

from __future__ import annotations

import json
import pathlib

import keras
import numpy as np
import pytest

import per_example_grads as peg
from helpers import run_here, run_in_new_process
from per_example_grads.dp.accounting import compute_epsilon
from tolerances import ACCOUNTING_SAME_RTOL, EPS32, Z, clipped_sum_rtol

REFERENCE = json.loads((pathlib.Path(__file__).parent / "data" / "jax_privacy_reference.json").read_text())


def _rows(ds) -> list[np.ndarray]:
    """Every batch's example indices (x holds each row's index)."""
    return [xb.numpy()[: int(m.numpy().sum()), 0].astype(np.int64) for xb, _, m in ds]


def _index(n):
    return np.arange(n, dtype="float32")[:, None]


def _participations(rows: list[np.ndarray], n: int, first: int = 0) -> tuple[np.ndarray, list[int]]:
    """Each example's participations, and every gap between two of an example's."""
    last, count, gaps = np.full(n, -(10**9)), np.zeros(n, np.int64), []
    for t, batch in enumerate(rows, start=first):
        gaps.extend((t - last[batch]).tolist())
        last[batch] = t
        count[batch] += 1
    return count, gaps


@pytest.mark.parametrize("case", REFERENCE["min_sep"], ids=lambda c: f"N{c['n']}-p{c['p']}-b{c['min_sep']}")
def test_the_law_is_jax_privacys(case):
    n, p, b, steps, runs = case["n"], case["p"], case["min_sep"], case["steps"], case["runs"]
    counts, gaps = [], []
    for run in range(runs):
        ds = peg.dp.min_sep_batches(_index(n), sampling_probability=p, min_separation=b, steps=steps, seed=100 + run)
        count, g = _participations(_rows(ds), n)
        counts.append(count)
        gaps.extend(g)
    counts = np.concatenate(counts).astype(np.float64)
    assert min(gaps) >= b and case["smallest_gap"] >= b  # the guarantee, in both
    # Examples' chains are independent: each mean is over n * runs independent counts.
    size = n * runs
    se = np.sqrt(counts.var(ddof=1) / size + case["count_variance"] / size)
    assert abs(counts.mean() - case["count_mean"]) <= Z * se
    rate = p / (1 + (b - 1) * p)  # the stationary participation rate (module docstring), from step 0 with warm start
    assert abs(counts.mean() - steps * rate) <= Z * np.sqrt(counts.var(ddof=1) / size)
    # The variance of a sample variance of s counts is about 2 v^2 / s (near normal counts); both sides' sampling.
    v, w = counts.var(ddof=1), case["count_variance"]
    assert abs(v - w) <= Z * np.sqrt(2 * v * v / size + 2 * w * w / size)


def test_a_pass_from_a_later_step_continues_the_same_batches():
    kw = dict(sampling_probability=0.3, min_separation=3, seed=7)
    whole = _rows(peg.dp.min_sep_batches(_index(50), steps=30, **kw))
    later = _rows(peg.dp.min_sep_batches(_index(50), steps=10, first_step=20, **kw))
    assert all(np.array_equal(a, b) for a, b in zip(later, whole[20:]))
    ds = peg.dp.min_sep_batches(_index(50), steps=10, **kw)  # two passes: the second goes on from step 10
    assert all(np.array_equal(a, b) for a, b in zip(_rows(ds) + _rows(ds), whole[:20]))


def test_without_warm_start_every_example_is_free_at_step_0():
    ds = peg.dp.min_sep_batches(_index(400), sampling_probability=1.0, min_separation=4, steps=8, warm_start=False)
    rows = _rows(ds)
    assert len(rows[0]) == 400 and all(len(r) == 0 for r in rows[1:4]) and len(rows[4]) == 400


def test_the_sampling_states_its_rate_and_the_arguments_are_checked():
    ds = peg.dp.min_sep_batches(_index(100), sampling_probability=0.5, min_separation=3, seed=0)
    s = ds.pegrad_sampling
    assert s.participation_rate == pytest.approx(0.25) and s.expected_batch_size == pytest.approx(25.0)
    assert s.steps == 4 and s.max_batch_size == peg.dp.default_max_batch_size(100, 0.25)
    with pytest.raises(ValueError, match="min_separation must be at least 2"):
        peg.dp.min_sep_batches(_index(10), sampling_probability=0.5, min_separation=1)
    with pytest.raises(ValueError, match=r"min_separation \(11\) must be at most the number of examples N=10"):
        peg.dp.min_sep_batches(_index(10), sampling_probability=0.5, min_separation=11)
    with pytest.raises(ValueError, match="sampling_probability"):
        peg.dp.min_sep_batches(_index(10), sampling_probability=0.0, min_separation=2)
    with pytest.raises(TypeError, match="warm_start must be a bool"):
        peg.dp.min_sep_batches(_index(10), sampling_probability=0.5, min_separation=2, warm_start=1)
    with pytest.raises(Exception, match="more than max_batch_size=1"):
        list(peg.dp.min_sep_batches(_index(10), sampling_probability=1.0, min_separation=2, max_batch_size=1))


# ---------------------------------------------------------------------------------------------------------
# With the other parts
# ---------------------------------------------------------------------------------------------------------

N = 32
X = np.random.default_rng(0).normal(size=(N, 3)).astype("float32")
Y = np.random.default_rng(1).normal(size=(N, 2)).astype("float32")


def _dp(mechanism=None, **kw):
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    dp = peg.keras.DPModel(
        net, l2_norm_clip=1.0, noise_multiplier=kw.pop("sigma", 1.0), seed=0, mechanism=mechanism, **kw
    )
    dp.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    return dp


def _bisr(b=4, n=16):
    return peg.dp.BISR(bands=4, num_steps=n, cycle_length=b)


def _batches(b=4, steps=8, seed=3, x=X):
    return peg.dp.min_sep_batches(x, Y, sampling_probability=0.5, min_separation=b, steps=steps, seed=seed)


@pytest.mark.slow
def test_bisr_on_min_sep_batches_has_jax_privacys_epsilon():
    case = next(c for c in REFERENCE["bisr"] if (c["n"], c["bands"], c["min_sep"]) == (16, 4, 4))
    point = case["epsilon"][0]
    dp = _dp(_bisr(), sigma=point["noise_multiplier"])
    dp.fit(_batches(steps=16), verbose=0)
    assert int(dp.dp_steps.numpy()) == 16
    assert dp.epsilon(REFERENCE["delta"]) == pytest.approx(point["epsilon"], rel=1e-9)
    assert dp.expected_batch_size is None and dp.num_examples == N


@pytest.mark.slow
@pytest.mark.parametrize("how", ["weights", "new dataset without a seed"])
def test_a_restored_run_keeps_the_runs_batches_and_noise(tmp_path, how):
    whole = _dp(_bisr())
    whole.fit(_batches(), epochs=2, verbose=0)
    first = _dp(_bisr())
    first.fit(_batches(), epochs=1, verbose=0)
    first.save_weights(tmp_path / "dp.weights.h5")
    restored = _dp(_bisr())
    restored.load_weights(tmp_path / "dp.weights.h5")
    data = (
        _batches()
        if how == "weights"
        else peg.dp.min_sep_batches(X, Y, sampling_probability=0.5, min_separation=4, steps=8, seed=None)
    )
    restored.fit(data, epochs=1, verbose=0)  # resumed at step 8, with the run's key from the ledger
    assert int(restored.dp_steps.numpy()) == 16
    for a, b in zip(restored.model.get_weights(), whole.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert restored.epsilon(1e-5) == whole.epsilon(1e-5)


@pytest.mark.slow
def test_a_second_dataset_of_other_rows_is_refused():
    dp = _dp(_bisr())
    dp.fit(_batches(), verbose=0)
    with pytest.raises(ValueError, match="b-min-sep sampled with min_separation=4 from other rows"):
        dp.fit(_batches(x=X[::-1].copy()), verbose=0)


@pytest.mark.slow
@pytest.mark.parametrize("first", ["min_sep", "cyclic"])
@pytest.mark.parametrize("restored", [False, True], ids=["same model", "restored from weights"])
def test_a_run_cannot_switch_between_min_sep_and_cyclic_sampling(tmp_path, first, restored):
    """Both keep b steps between turns, by other rules: a switch could put an example in consecutive steps.

    Before the partition recorded its sampler (-b for b-min-sep), either one
    continued the other's run silently (the BLT below, 5 steps each way).
    """
    cyclic = peg.dp.poisson_batches(X, Y, sampling_probability=0.5, cycle_length=4, steps=5, seed=3)
    min_sep = _batches(steps=5)
    first_data, second_data = (min_sep, cyclic) if first == "min_sep" else (cyclic, min_sep)
    dp = _dp(peg.dp.BLT(buffers=1, num_steps=16, cycle_length=4))
    dp.fit(first_data, verbose=0)
    if restored:
        dp.save_weights(tmp_path / "run.weights.h5")
        dp = _dp(peg.dp.BLT(buffers=1, num_steps=16, cycle_length=4))
        dp.load_weights(tmp_path / "run.weights.h5")
    was, now = ("b-min-sep", "cyclic Poisson") if first == "min_sep" else ("cyclic Poisson", "b-min-sep")
    with pytest.raises(
        ValueError, match=f"earlier steps were drawn by {was} sampling \\(b = 4\\) and this dataset by {now}"
    ):
        dp.fit(second_data, verbose=0)
    assert int(dp.dp_steps.numpy()) == 5


@pytest.mark.slow
def test_blt_and_a_budget_on_min_sep_batches():
    blt = peg.dp.BLT(buffers=2, num_steps=16, cycle_length=4)
    limit = compute_epsilon(
        N, 4, None, 1.0, 1e-5, steps=6, mechanism=peg.dp.BLT(buffers=2, num_steps=16, cycle_length=4)
    )
    dp = _dp(blt, budget=peg.dp.PrivacyBudget(epsilon=limit * (1 + 1e-9), delta=1e-5))
    with pytest.warns(UserWarning, match="stopped after DP step 6"):
        dp.fit(_batches(steps=16), verbose=0)
    assert int(dp.dp_steps.numpy()) == 6
    assert dp.epsilon(1e-5) == pytest.approx(limit, rel=ACCOUNTING_SAME_RTOL)


REFUSED = [
    (
        lambda: _dp().fit(_batches(), verbose=0),
        "DPModel: the GaussianNoise mechanism (accounted with amplification by Poisson sampling) cannot be combined "
        "with b-min-sep sampling (a min_sep_batches dataset)",
    ),
    (
        lambda: _dp(peg.dp.BandMF(bands=4, num_steps=8)).fit(_batches(), verbose=0),
        "DPModel: the BandMF mechanism (accounted with amplification by Poisson sampling) cannot be combined",
    ),
    (
        lambda: _dp(_bisr(b=3)).fit(_batches(b=4), verbose=0),
        "DPModel: the BISR mechanism (accounted for cycle_length=3) cannot be combined with a min_sep_batches "
        "dataset of min_separation=4",
    ),
    (
        lambda: _dp(_bisr(), privacy_unit="unit").fit(_batches(), verbose=0),
        "DPModel: privacy_unit='unit' cannot be combined with data without unit ids",
    ),
]


@pytest.mark.parametrize("build, message", REFUSED, ids=[m.split(": ")[1][:48] for _, m in REFUSED])
def test_pairings_it_cannot_serve_are_refused(build, message):
    with pytest.raises(ValueError) as refused:
        build()
    assert message in str(refused.value)


@pytest.mark.slow
def test_physical_chunks_give_the_same_run():
    whole, chunked = _dp(_bisr()), _dp(_bisr(), physical_batch_size=4)
    for dp in (whole, chunked):
        dp.fit(_batches(), verbose=0)
    assert int(chunked.dp_steps.numpy()) == 8 and chunked.epsilon(1e-5) == whole.epsilon(1e-5)
    # The same noise (same seed); the clipped sums differ by their float32 rounding (clipped_sum_rtol of at most
    # M rows of norm <= C = 1), scaled by lr / divisor, at each of the 8 steps, plus each update's rounding.
    source = _batches().pegrad_sampling
    p = sum(int(np.prod(v.shape)) for v in whole.model.trainable_variables)
    per_step = clipped_sum_rtol(p, source.max_batch_size) * source.max_batch_size * 0.5 / source.expected_batch_size
    for a, b in zip(whole.model.get_weights(), chunked.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=8 * (per_step + 2 * EPS32 * np.abs(a).max()))


_PROCESS = """
import sys
import keras
import numpy as np
import per_example_grads as peg

x = np.arange(32, dtype="float32")[:, None].repeat(3, axis=1)  # row i is recognisable by its first input
y = np.zeros((32, 2), "float32")
keras.utils.set_random_seed(0)
net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
dp = peg.keras.DPModel(net, noise_multiplier=1.0, mechanism=peg.dp.BISR(bands=3, num_steps=8, cycle_length=4))
dp.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
if sys.argv[2] == "load":
    dp.load_weights(sys.argv[1])
ds = peg.dp.min_sep_batches(x, y, sampling_probability=0.5, min_separation=4, steps=4)  # seed=None
dp.fit(ds, epochs=1, verbose=0)
dp.save_weights(sys.argv[1])
ds.pegrad_sampling.next_step.assign(int(dp.dp_steps.numpy()) - 4)  # the steps this process trained on, again
print("ROWS", [sorted(xb.numpy()[m.numpy() == 1, 0].astype(int).tolist()) for xb, _, m in ds])
print("KEY", ds.pegrad_sampling.partition.tolist())
"""


@pytest.mark.slow
def test_a_new_process_with_an_unseeded_dataset_continues_the_runs_batches(tmp_path):
    path = str(tmp_path / "run.weights.h5")

    def run(mode, where):
        out = where(_PROCESS, path, mode)
        lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("ROWS", "KEY")))
        return json.loads(lines["ROWS"]), json.loads(lines["KEY"])

    first_rows, first_key = run("new", run_here)  # only the continuing run needs a new process
    later_rows, later_key = run("load", run_in_new_process)
    assert later_key == first_key  # the second process took the run's key from the ledger
    # Its steps 4..7 are the run's: what that key gives from step 4 here, and no example within 4 steps of its last.
    x = np.arange(32, dtype="float32")[:, None].repeat(3, axis=1)
    ds = peg.dp.min_sep_batches(x, np.zeros((32, 2), "float32"), sampling_probability=0.5, min_separation=4, steps=4)
    ds.pegrad_sampling.take_partition(np.array(first_key))
    ds.pegrad_sampling.next_step.assign(4)
    assert [r.tolist() for r in map(np.sort, _rows(ds))] == later_rows
    _, gaps = _participations([np.array(r, np.int64) for r in first_rows + later_rows], 32)
    assert min(gaps) >= 4
