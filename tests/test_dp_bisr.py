"""BISR (``per_example_grads.dp.bisr``): its noise, its accounting against jax_privacy, and where it meets the other parts.

The reference figures in ``data/jax_privacy_reference.json`` were computed by
jax_privacy 2.0.0 in its own virtualenv
(``benchmarks/peers/jax_privacy_reference.py``, whose docstring has the
command): ``C`` from jax_privacy's own square-root coefficients and Toeplitz
inverse, its sensitivity by ``minsep_sensitivity_squared``, the epsilon of one
Gaussian release at that sensitivity by dp_accounting's PLD accountant at the
grid step this library uses (1e-4).
"""

from __future__ import annotations

import json
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from per_example_grads.dp import mf_strategies
from per_example_grads.dp.accounting import compute_epsilon
from per_example_grads.dp.aggregator import ClippedSum, DPAggregator
from per_example_grads.dp.bisr import inverse_square_root_band
from per_example_grads.dp.sparse_embeddings import SparseEmbeddings
from tolerances import ACCOUNTING_SAME_RTOL, rounding_rtol

REFERENCE = json.loads((pathlib.Path(__file__).parent / "data" / "jax_privacy_reference.json").read_text())
# Sensitivities: the same float64 series by two programs (ours by Newton iteration with FFT products,
# jax_privacy's by its own inversion): a few hundred roundings of values below n.
SENSITIVITY_RTOL = 1e-10
# Epsilon of a Gaussian whose noise multipliers differ by at most SENSITIVITY_RTOL / 2 relative: PLD's
# epsilon moves by less than that relative change times |d log eps / d log sigma| (below 10 on this grid).
EPSILON_RTOL = 10 * SENSITIVITY_RTOL


def _bisr(bands=3, num_steps=8, cycle_length=2):
    return peg.dp.BISR(bands=bands, num_steps=num_steps, cycle_length=cycle_length)


# ---------------------------------------------------------------------------------------------------------
# The mechanism
# ---------------------------------------------------------------------------------------------------------


def test_the_band_is_the_square_root_series_of_one_minus_z():
    # (1 - z)^{1/2} squared is 1 - z: the band's full series, squared, gives that exactly to float64.
    d = inverse_square_root_band(40)
    square = np.convolve(d, d)[:40]
    # Each coefficient of the square is a sum of at most 40 products of magnitude <= 1: 40 float64 roundings.
    np.testing.assert_allclose(square, np.r_[1.0, -1.0, np.zeros(38)], rtol=0, atol=40 * np.finfo(np.float64).eps)
    assert inverse_square_root_band(1).tolist() == [1.0]


@pytest.mark.parametrize("bands", [2, 5])
def test_the_noise_is_the_banded_combination_of_the_last_draws(bands):
    """x_t = sum_j d_j z_{t-j}, and C x = z with C the Toeplitz matrix of ``coefficients``."""
    n, size = 9, 64
    mechanism = peg.dp.BISR(bands=bands, num_steps=n, cycle_length=3)
    agg = DPAggregator(l2_norm_clip=1.0, noise_multiplier=1.0, seed=4, mechanism=mechanism)
    fresh = DPAggregator(l2_norm_clip=1.0, noise_multiplier=1.0, seed=4)  # DP-SGD: the draws z themselves
    for a in (agg, fresh):
        a.attach([tf.Variable(tf.zeros([size]))])
    zero = ClippedSum([tf.zeros([size])], tf.zeros([0]), tf.zeros([0]))
    x = np.stack([agg.release(zero, 1.0)[0].numpy() for _ in range(n)]).astype(np.float64)
    z = np.stack([fresh.release(zero, 1.0)[0].numpy() for _ in range(n)]).astype(np.float64)
    d = inverse_square_root_band(bands)
    want = np.stack([sum(d[j] * z[t - j] for j in range(min(bands, t + 1))) for t in range(n)])
    np.testing.assert_allclose(x, want, rtol=0, atol=rounding_rtol(2 * bands) * np.abs(z).max() * np.abs(d).sum())
    c = mf_strategies._toeplitz(mechanism.coefficients, n)
    np.testing.assert_allclose(
        c @ x, z, rtol=0, atol=rounding_rtol(4 * n) * np.abs(c).sum(axis=1).max() * np.abs(x).max()
    )
    assert mechanism.state_floats == (bands - 1) * size


def test_one_band_is_dp_sgd_and_keeps_no_state():
    mechanism = peg.dp.BISR(bands=1, num_steps=10, cycle_length=1)
    assert mechanism.coefficients.tolist() == [1.0] + [0.0] * 9
    assert mechanism.accounted_as(1.5, 0.1, 10) == pytest.approx((1.5 / np.sqrt(10), 1.0, 1), rel=1e-15)
    assert mechanism.state_floats == 0


def test_arguments_are_checked_by_name():
    with pytest.raises(ValueError, match="bands must be a positive integer"):
        peg.dp.BISR(bands=0, num_steps=10, cycle_length=2)
    with pytest.raises(ValueError, match=r"cycle_length \(11\) must be at most num_steps \(10\)"):
        peg.dp.BISR(bands=2, num_steps=10, cycle_length=11)
    with pytest.raises(TypeError, match="cycle_length"):
        peg.dp.BISR(bands=2, num_steps=10)


# ---------------------------------------------------------------------------------------------------------
# Accounting against jax_privacy
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", REFERENCE["bisr"], ids=lambda c: f"n{c['n']}-p{c['bands']}-sep{c['min_sep']}")
def test_sensitivity_and_epsilon_are_jax_privacys(case):
    n, sep = case["n"], case["min_sep"]
    mechanism = peg.dp.BISR(bands=case["bands"], num_steps=n, cycle_length=sep)
    assert mechanism.sensitivity(n) ** 2 == pytest.approx(case["sensitivity_squared"], rel=SENSITIVITY_RTOL)
    for point in case["epsilon"]:
        # batch_size 1 of N = 1000 examples: the part's rate q, which a correlated mechanism does not use.
        sigma, delta = point["noise_multiplier"], REFERENCE["delta"]
        got = compute_epsilon(1000, 1, None, sigma, delta, steps=n, mechanism=mechanism)
        assert got == pytest.approx(point["epsilon"], rel=EPSILON_RTOL)


@pytest.mark.parametrize("case", REFERENCE["blt"], ids=lambda c: f"n{c['n']}-sep{c['min_sep']}")
def test_blt_sensitivity_and_epsilon_are_jax_privacys_too(case):
    n, sep = case["n"], case["min_sep"]
    mechanism = peg.dp.BLT(len(case["theta"]), n, cycle_length=sep, theta=case["theta"], omega=case["omega"])
    assert mechanism.sensitivity(n) ** 2 == pytest.approx(case["sensitivity_squared"], rel=SENSITIVITY_RTOL)
    for point in case["epsilon"]:
        sigma, delta = point["noise_multiplier"], REFERENCE["delta"]
        got = compute_epsilon(1000, 1, None, sigma, delta, steps=n, mechanism=mechanism)
        assert got == pytest.approx(point["epsilon"], rel=EPSILON_RTOL)


def test_bisr_beats_dp_sgd_in_many_epochs():
    """The figure of merit sensitivity x prefix-sum error, for 8 epochs of 64 steps (participations 64 apart)."""
    n, sep = 512, 64
    k = n // sep

    def merit(c):
        return mf_strategies.sensitivity(
            c, n, min_separation=sep, max_participations=k
        ) * mf_strategies.prefix_sum_error(c, n)

    dpsgd = merit([1.0])
    assert merit(peg.dp.BISR(bands=16, num_steps=n, cycle_length=sep).coefficients) < 0.6 * dpsgd


# ---------------------------------------------------------------------------------------------------------
# With the other parts: DPModel, restore, budget, units, the composition table, the audit
# ---------------------------------------------------------------------------------------------------------

N = 24
X = np.random.default_rng(0).normal(size=(N, 3)).astype("float32")
Y = np.random.default_rng(1).normal(size=(N, 2)).astype("float32")


def _dp(mechanism=None, **kw):
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    kw.setdefault("noise_multiplier", 1.0)
    dp = peg.keras.DPModel(net, l2_norm_clip=1.0, seed=0, mechanism=mechanism, **kw)
    dp.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    return dp


def _batches(cycle_length=2, seed=3, steps=None, **kw):
    return peg.dp.poisson_batches(
        X, Y, sampling_probability=0.5, cycle_length=cycle_length, steps=steps, seed=seed, **kw
    )


@pytest.mark.slow
def test_a_dpmodel_run_is_accounted_as_compute_epsilon_and_restores_exactly(tmp_path):
    whole = _dp(_bisr())
    whole.fit(_batches(steps=4), epochs=2, verbose=0)
    assert int(whole.dp_steps.numpy()) == 8
    want = compute_epsilon(N, N * 0.5 / 2, None, 1.0, 1e-5, steps=8, mechanism=_bisr())
    assert whole.epsilon(1e-5) == pytest.approx(want, rel=ACCOUNTING_SAME_RTOL)

    first = _dp(_bisr())
    first.fit(_batches(steps=4), epochs=1, verbose=0)
    first.save_weights(tmp_path / "dp.weights.h5")
    for how in ("weights", "network"):
        restored = _dp(_bisr())
        if how == "weights":
            restored.load_weights(tmp_path / "dp.weights.h5")
        else:  # the wrapped network's own .keras file carries the ledger and the noise buffers
            first.model.save(tmp_path / "net.keras")
            restored = _dp(_bisr())
            restored.load_weights(str(tmp_path / "net.keras"))
        restored.fit(_batches(steps=4), epochs=1, verbose=0)  # a second fit, resumed at the ledger's step
        assert int(restored.dp_steps.numpy()) == 8
        for a, b in zip(restored.model.get_weights(), whole.model.get_weights()):
            np.testing.assert_array_equal(a, b)
        assert restored.epsilon(1e-5) == whole.epsilon(1e-5)


@pytest.mark.slow
def test_a_run_of_another_mechanism_or_band_is_refused_naming_both(tmp_path):
    dp = _dp(None)
    dp.fit(_batches(cycle_length=1, steps=2), epochs=1, verbose=0)
    dp.save_weights(tmp_path / "sgd.weights.h5")
    with pytest.raises(ValueError, match=r"taken with a GaussianNoise mechanism, and this DPModel's is a BISR"):
        _dp(_bisr()).load_weights(tmp_path / "sgd.weights.h5")
    banded = _dp(_bisr(bands=3))
    banded.fit(_batches(steps=2), epochs=1, verbose=0)
    banded.save_weights(tmp_path / "bisr.weights.h5")
    both = r"taken with a BISR mechanism with other parameters, and this DPModel's is a BISR"
    for other in (
        _bisr(bands=2),
        peg.dp.BISR(bands=3, num_steps=8, cycle_length=4),
    ):  # other buffers; same, other cycle
        with pytest.raises(ValueError, match=both):
            _dp(other).load_weights(tmp_path / "bisr.weights.h5")


@pytest.mark.slow
def test_a_budget_stops_a_bisr_run_at_its_epsilon():
    mechanism = _bisr(num_steps=40)
    limit = compute_epsilon(N, N * 0.5 / 2, None, 1.0, 1e-5, steps=6, mechanism=_bisr(num_steps=40))
    budget = peg.dp.PrivacyBudget(epsilon=limit * (1 + 1e-6), delta=1e-5)
    dp = _dp(mechanism, budget=budget)
    assert budget.max_steps(noise_multiplier=1.0, sampling_probability=0.5, mechanism=dp.mechanism) == 6
    dp.fit(_batches(steps=20), epochs=1, verbose=0)
    assert int(dp.dp_steps.numpy()) == 6
    assert dp.epsilon(1e-5) <= limit * (1 + 1e-6)


@pytest.mark.slow
def test_per_unit_with_a_cycle_is_accounted_per_unit():
    units = np.arange(N) // 3
    dp = _dp(_bisr(), privacy_unit="unit")
    dp.fit(_batches(steps=4, unit_ids=units), epochs=1, verbose=0)
    want = compute_epsilon(N // 3, N // 3 * 0.5 / 2, None, 1.0, 1e-5, steps=4, mechanism=_bisr())
    assert dp.epsilon(1e-5) == pytest.approx(want, rel=ACCOUNTING_SAME_RTOL)


def _bag():
    inputs = keras.Input((3,), dtype="int32")
    pooled = keras.ops.mean(keras.layers.Embedding(20, 4)(inputs), axis=1)
    return keras.Model(inputs, keras.layers.Dense(2)(pooled))


REFUSED = [  # (front door, build, the message's pairing), as for BandMF (tests/test_dp_composition.py)
    (
        lambda: _dp(_bisr(), adaptive_clipping=peg.dp.AdaptiveClipping()),
        "DPModel: adaptive_clipping cannot be combined with a correlated mechanism (BISR)",
    ),
    (
        lambda: peg.keras.DPModel(
            _bag(), noise_multiplier=1.0, mechanism=_bisr(), sparse_embeddings=SparseEmbeddings()
        ),
        "DPModel: sparse_embeddings cannot be combined with a correlated mechanism (BISR)",
    ),
    (
        lambda: _dp(_bisr()).fit(X, Y, batch_size=4, verbose=0),
        "DPModel: the BISR mechanism cannot be combined with data not sampled by peg.dp.poisson_batches",
    ),
    (
        lambda: _dp(_bisr()).fit(_batches(cycle_length=1), verbose=0),
        "DPModel: the BISR mechanism (accounted for cycle_length=2) cannot be combined with a poisson_batches "
        "dataset of cycle_length=1",
    ),
    (
        lambda: _dp(_bisr()).train_on_batch(X[:4], Y[:4]),
        "DPModel.train_on_batch: the BISR mechanism cannot be combined with data",
    ),
]


@pytest.mark.parametrize("build, message", REFUSED, ids=[m.split(": ")[1][:40] for _, m in REFUSED])
def test_pairings_refused_for_correlated_noise_are_refused_for_bisr(build, message):
    with pytest.raises(ValueError) as refused:
        build()
    assert message in str(refused.value)


def test_the_gradient_accumulator_adds_bisr_noise():
    """Release t = s + sum_j d_j z_{t-j}: s the clipped sum (noiseless twin), z DP-SGD's noise with the same seed."""
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    common = dict(l2_norm_clip=1.0, expected_batch_size=1.0, seed=2)
    twins = [
        peg.GradientAccumulator(net, "mse", noise_multiplier=sigma, mechanism=m, **common)
        for sigma, m in ((1.0, _bisr(bands=3)), (1.0, None), (0.0, None))
    ]
    releases = [[], [], []]
    for _ in range(4):  # no update is applied: every step has the same clipped sum
        for acc, out in zip(twins, releases):
            acc.accumulate(X[:4], Y[:4])
            out.append(np.concatenate([g.numpy().ravel() for g in acc.result()]).astype(np.float64))
            acc.reset()
    got, fresh, sums = map(np.stack, releases)
    z = fresh - sums
    d = inverse_square_root_band(3)
    want = sums + np.stack([sum(d[j] * z[t - j] for j in range(min(3, t + 1))) for t in range(4)])
    np.testing.assert_allclose(got, want, rtol=0, atol=rounding_rtol(16) * 8 * np.abs(fresh).max())
