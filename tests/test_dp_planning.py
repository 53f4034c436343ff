"""rank_mechanisms: every candidate calibrated to the target, ranked by its amplified prefix-sum error."""

import math

import keras
import numpy as np
import pytest

import per_example_grads as peg
from per_example_grads.dp.planning import rank_mechanisms

N, B, STEPS, EPSILON, DELTA = 1000, 20, 100, 2.0, 1e-5


def _prefix_error(coefficients, n):
    """``||A C^{-1}||_F / sqrt(n)`` from the n x n matrices themselves (independent of mf_strategies' series)."""
    c = np.zeros(n)
    c[: min(n, len(coefficients))] = coefficients[:n]
    big_c = np.array([[c[i - j] if i >= j else 0.0 for j in range(n)] for i in range(n)])
    a = np.tril(np.ones((n, n)))
    return np.linalg.norm(a @ np.linalg.inv(big_c)) / math.sqrt(n)


@pytest.fixture(scope="module")
def ranked():
    # RDP calibrates in milliseconds; the PLD path is the doctest's and the trained run's below
    return rank_mechanisms(
        EPSILON, DELTA, N, B, STEPS, bands=[2, 5], blt_buffers=(1,), bisr_bands=(4,), accountant="rdp", progress=False
    )


def test_each_candidate_spends_the_target_and_no_less_noise_would(ranked):
    names = ["BISR(4)", "BLT(1)", "BandMF(2)", "BandMF(5)", "DP-SGD"]
    assert [c.name for c in sorted(ranked, key=lambda c: c.name)] == names
    for c in ranked:
        kw = dict(delta=DELTA, steps=STEPS, mechanism=c.mechanism, accountant="rdp")
        spent = peg.dp.compute_epsilon(N, B, None, noise_multiplier=c.noise_multiplier, **kw)
        below = peg.dp.compute_epsilon(N, B, None, noise_multiplier=c.noise_multiplier * 0.99, **kw)
        assert spent <= EPSILON < below, (c.name, spent, below)
        assert c.accounting == "rdp"


def test_the_sampling_is_each_mechanisms_own(ranked):
    by_name = {c.name: c for c in ranked}
    assert (by_name["DP-SGD"].cycle_length, by_name["DP-SGD"].sampling_probability) == (1, B / N)
    assert (by_name["BandMF(5)"].cycle_length, by_name["BandMF(5)"].sampling_probability) == (5, 5 * B / N)
    for whole in ("BLT(1)", "BISR(4)"):
        assert (by_name[whole].cycle_length, by_name[whole].sampling_probability) == (N // B, 1.0)
        assert by_name[whole].mechanism.cycle_length == N // B
    assert type(by_name["BISR(4)"].mechanism) is peg.dp.BISR and by_name["BISR(4)"].mechanism.bands == 4
    for name in ("BandMF(5)", "BLT(1)", "BISR(4)"):
        assert by_name[name].mechanism.num_steps == STEPS
    # 1000 / 30: 33 whole parts of 30.3 examples, q = 1 exactly (Monte Carlo refuses BLT at q < 1)
    odd = rank_mechanisms(EPSILON, DELTA, N, 30, STEPS, bands=[], blt_buffers=(1,), accountant="rdp", progress=False)
    (blt,) = [c for c in odd if c.name == "BLT(1)"]
    assert (blt.cycle_length, blt.sampling_probability) == (33, 1.0)


def test_candidates_are_ranked_by_noise_times_the_prefix_sum_error(ranked):
    for c in ranked:
        coefficients = np.ones(1) if c.name == "DP-SGD" else c.mechanism.coefficients
        expected = c.noise_multiplier * _prefix_error(coefficients, STEPS)
        assert c.error == pytest.approx(expected, rel=1e-9), c.name
    dpsgd = next(c for c in ranked if c.name == "DP-SGD")
    assert dpsgd.error == pytest.approx(dpsgd.noise_multiplier * math.sqrt((STEPS + 1) / 2), rel=1e-12)
    assert [c.error for c in ranked] == sorted(c.error for c in ranked)


def test_a_run_trained_with_the_choice_spends_the_target():
    """The choice's mechanism, sigma and sampling, in a DPModel run: its ledger spends the planned epsilon."""
    n, b, steps = 200, 10, 20
    ranked = rank_mechanisms(EPSILON, DELTA, n, b, steps, bands=[4], blt_buffers=(), accountant="rdp", progress=False)
    (choice,) = [c for c in ranked if c.name == "BandMF(4)"]
    x = np.random.default_rng(0).normal(size=(n, 4)).astype("float32")
    y = np.arange(n) % 2
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    dp = peg.keras.DPModel(
        model, l2_norm_clip=1.0, noise_multiplier=choice.noise_multiplier, mechanism=choice.mechanism,
        num_examples=n, expected_batch_size=b, seed=0,
    )  # fmt: skip
    dp.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batches = peg.dp.poisson_batches(
        x, y, sampling_probability=choice.sampling_probability, cycle_length=choice.cycle_length, steps=steps, seed=0
    )
    dp.fit(batches, verbose=0)
    assert int(dp.dp_steps.numpy()) == steps
    spent = dp.epsilon(DELTA, accountant="rdp")
    assert spent == pytest.approx(EPSILON, rel=1e-2) and spent <= EPSILON


@pytest.mark.slow
def test_monte_carlo_calibrates_blt_and_bisr_by_their_random_part():
    kw = dict(bands=[], blt_buffers=(1,), bisr_bands=(3,), monte_carlo=True, progress=False)
    with pytest.warns(UserWarning, match="much smaller than 1/num_examples"):  # delta 1e-2: Monte Carlo in seconds
        ranked = [c for c in rank_mechanisms(2.0, 1e-2, 1000, 100, 20, **kw) if c.name != "DP-SGD"]
    assert sorted(c.name for c in ranked) == ["BISR(3)", "BLT(1)"]
    for choice in ranked:
        assert choice.accounting == "monte_carlo" and (choice.cycle_length, choice.sampling_probability) == (10, 1.0)
        direct = peg.dp.monte_carlo_noise_multiplier(
            choice.mechanism, 2.0, 20, delta=1e-2, sampling_probability=1.0, seed=0
        )
        assert choice.noise_multiplier == direct.noise_multiplier


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bands=[64]), "bands=64"),  # 50 parts of 20
        (dict(bands=[0]), "bands"),
        (dict(steps=40, blt_buffers=(2,)), "blt_buffers"),  # 50 parts > 40 steps
        (dict(steps=40, bisr_bands=(2,)), "bisr_bands"),
        (dict(bisr_bands=(0,)), "bisr_bands"),
        (dict(batch_size=2000), "batch_size"),
    ],
)
def test_refusals_name_the_argument(kwargs, match):
    args = dict(num_examples=N, batch_size=B, steps=STEPS, bands=[2], blt_buffers=(), progress=False) | kwargs
    with pytest.raises(ValueError, match=match):
        rank_mechanisms(EPSILON, DELTA, **args)


def test_blt_is_a_default_candidate_only_where_a_cycle_fits_in_the_run():
    kw = dict(bands=[2], accountant="rdp", progress=False)
    assert [c.name for c in rank_mechanisms(EPSILON, DELTA, N, B, STEPS, **kw) if c.name.startswith("BLT")] == [
        "BLT(2)"
    ]
    assert all(not c.name.startswith("BLT") for c in rank_mechanisms(EPSILON, DELTA, N, B, 40, **kw))  # 50 parts
