"""Correlated noise in the DP paths (issue #28): the noise each mechanism adds, its state across restarts,
the sampling it needs, and its accounting, each against an independent NumPy or dp_accounting reference."""

import warnings

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from per_example_grads.dp.accounting import PrivacyAccountant, compute_epsilon
from per_example_grads.dp.aggregator import ClippedSum, DPAggregator
from per_example_grads.dp.bisr import inverse_square_root_band
from tolerances import ACCOUNTING_SAME_RTOL, Z, rounding_rtol


def _toeplitz(c, n):
    """The ``n x n`` lower-triangular Toeplitz matrix of coefficients ``c`` (zero past their length)."""
    m = np.zeros((n, n))
    for k, ck in enumerate(np.asarray(c)[:n]):
        m += ck * np.eye(n, k=-k)
    return m


def _releases(aggregator, steps, size):
    """The noise of ``steps`` consecutive releases of an all-zero clipped sum: ``[steps, size]``."""
    zero = ClippedSum([tf.zeros([size])], tf.zeros([0]), tf.zeros([0]))
    return np.stack([aggregator.release(zero, 1.0)[0].numpy() for _ in range(steps)])


def _aggregator(mechanism, size, seed=0, sigma=1.0):
    agg = DPAggregator(l2_norm_clip=1.0, noise_multiplier=sigma, seed=seed, mechanism=mechanism)
    agg.attach([tf.Variable(tf.zeros([size]))])
    return agg


MECHANISMS = {
    "bandmf": lambda: peg.dp.BandMF(bands=4, num_steps=12),
    "blt": lambda: peg.dp.BLT(buffers=2, num_steps=12, cycle_length=3),
    "bisr": lambda: peg.dp.BISR(bands=3, num_steps=12, cycle_length=3),
}


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_the_noise_is_c_inverse_of_the_fresh_draws_of_dp_sgd_with_the_same_seed(name):
    """x = C^{-1} z exactly (to float32 rounding), where z is what DP-SGD adds with the same seed at each step."""
    mechanism, n, size = MECHANISMS[name](), 12, 256
    fresh = _releases(_aggregator(None, size, seed=5), n, size)
    noise = _releases(_aggregator(mechanism, size, seed=5), n, size)
    c = mechanism.coefficients[:n]
    want = np.linalg.solve(_toeplitz(c, n), fresh.astype(np.float64))
    # Step t sums at most n terms of |C^{-1}| weight; float32 rounding of each.
    inverse_rows = np.abs(np.linalg.inv(_toeplitz(c, n))).sum(axis=1)
    atol = (
        rounding_rtol(n * max(len(c), mechanism.buffers if name == "blt" else 1))
        * inverse_rows[:, None]
        * np.abs(fresh).max()
    )
    assert np.all(np.abs(noise - want) <= atol * 4)
    assert not np.allclose(noise[1:], fresh[1:])  # it is correlated, not DP-SGD's


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_the_noise_covariance_over_steps_is_sigma_c_squared_times_c_inverse_c_inverse_transpose(name):
    """Every coordinate is an independent sample of the n-step sequence: its covariance is (sigma C)^2 C^-1 C^-T."""
    mechanism, n, size, sigma = MECHANISMS[name](), 8, 40_000, 1.5
    noise = _releases(_aggregator(mechanism, size, seed=None, sigma=sigma), n, size).astype(np.float64)
    inv = np.linalg.inv(_toeplitz(mechanism.coefficients[:n], n))
    want = sigma**2 * inv @ inv.T
    got = noise @ noise.T / size
    # The sample covariance of S pairs has std sqrt((s_ii s_jj + s_ij^2) / S).
    std = np.sqrt((np.outer(np.diag(want), np.diag(want)) + want**2) / size)
    assert np.all(np.abs(got - want) <= Z * std)


def test_bandmf_with_one_band_is_dp_sgd():
    mechanism = peg.dp.BandMF(bands=1, num_steps=10)
    np.testing.assert_array_equal(mechanism.coefficients, [1.0])
    np.testing.assert_array_equal(
        _releases(_aggregator(mechanism, 64, seed=3), 3, 64), _releases(_aggregator(None, 64, seed=3), 3, 64)
    )
    kw = dict(steps=40, accountant="rdp")
    assert compute_epsilon(1000, 10, None, 1.0, 1e-5, mechanism=mechanism, **kw) == compute_epsilon(
        1000, 10, None, 1.0, 1e-5, **kw
    )


@pytest.mark.parametrize("steps", [1, 7, 40, 41])
def test_bandmf_epsilon_is_dp_sgd_with_ceil_steps_over_b_at_the_cyclic_rate(steps):
    b, n, batch = 4, 1000, 10
    mechanism = peg.dp.BandMF(bands=b, num_steps=40)
    q = b * batch / n  # each step samples one part of n / b examples at rate q
    reference = PrivacyAccountant(1.0, q, accountant="rdp")
    reference.step(-(-steps // b))
    got = compute_epsilon(n, batch, None, 1.0, 1e-5, steps=steps, mechanism=mechanism, accountant="rdp")
    assert got == pytest.approx(reference.epsilon(1e-5), rel=ACCOUNTING_SAME_RTOL)


def test_blt_epsilon_is_one_gaussian_of_sigma_over_its_sensitivity():
    import dp_accounting

    mechanism = peg.dp.BLT(buffers=2, num_steps=12, cycle_length=3)
    s = mechanism.sensitivity(12)
    # Independent: the sensitivity from the explicit C, worst pattern over all, aligned contributions.
    c = _toeplitz(mechanism.coefficients, 12)
    gram = c.T @ c
    import itertools

    best = max(
        gram[np.ix_(p, p)].sum()
        for k in range(1, 5)
        for p in itertools.combinations(range(12), k)
        if all(b - a >= 3 for a, b in zip(p, p[1:]))
    )
    assert s == pytest.approx(np.sqrt(best), rel=1e-12)
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(dp_accounting.GaussianDpEvent(2.0 / s))
    got = compute_epsilon(120, 10, None, 2.0, 1e-5, steps=12, mechanism=mechanism)
    assert got == pytest.approx(pld.get_epsilon(1e-5), rel=1e-9)


def test_noise_multiplier_for_epsilon_calibrates_a_mechanism():
    mechanism = peg.dp.BandMF(bands=4, num_steps=100)
    sigma = peg.dp.noise_multiplier_for_epsilon(
        2.0, 1e-5, 1000, 10, None, steps=100, mechanism=mechanism, accountant="rdp"
    )
    at = lambda s: compute_epsilon(1000, 10, None, s, 1e-5, steps=100, mechanism=mechanism, accountant="rdp")  # noqa: E731
    assert at(sigma) <= 2.0 < at(sigma / 1.01)


def test_cyclic_poisson_batches_sample_only_the_part_in_turn():
    n, b, q = 60, 3, 0.5
    x = np.arange(n, dtype="float32")[:, None]
    ds = peg.dp.poisson_batches(x, sampling_probability=q, cycle_length=b, steps=30, seed=1)
    assert ds.pegrad_sampling.cycle_length == b and ds.pegrad_sampling.expected_batch_size == q * n / b
    seen = {}
    counts = np.zeros(n)
    for t, (xb, _, mask) in enumerate(ds):
        rows = xb.numpy()[mask.numpy() == 1, 0].astype(int)
        counts[rows] += 1
        for r in rows:
            seen.setdefault(r, set()).add(t % b)
    assert all(len(parts) == 1 for parts in seen.values())  # an example belongs to one part
    sizes = np.bincount([next(iter(p)) for p in seen.values()], minlength=b)
    assert sizes.sum() == n  # q = 0.5 over 10 turns: everyone seen (w.h.p.)
    # Each example's part is drawn on its own (not an equal split): part sizes are Binomial(n, 1 / b).
    assert np.all(np.abs(sizes - n / b) <= Z * np.sqrt(n * (1 / b) * (1 - 1 / b)))
    # Each example is eligible 10 times in 30 steps: Binomial(10, q) participations.
    mean, std = 10 * q, np.sqrt(10 * q * (1 - q) / n)
    assert abs(counts.mean() - mean) <= Z * std


def _dp_model(mechanism, seed=0, **kw):
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    dp = peg.keras.DPModel(net, l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed, mechanism=mechanism, **kw)
    dp.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
    return dp


def _data(n=24):
    rng = np.random.RandomState(0)
    return rng.normal(size=(n, 3)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def test_dp_model_refuses_data_the_mechanism_is_not_accounted_for():
    x, y = _data()
    dp = _dp_model(peg.dp.BandMF(bands=2, num_steps=20))
    with pytest.raises(ValueError, match="cycle_length=2"):
        dp.fit(x, y, batch_size=4, epochs=1, verbose=0)
    with pytest.raises(ValueError, match="cannot be combined with a poisson_batches dataset of cycle_length=1"):
        dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.5, seed=0), epochs=1, verbose=0)
    with pytest.raises(
        ValueError, match=r"adaptive_clipping cannot be combined with a correlated mechanism \(BandMF\)"
    ):
        _dp_model(peg.dp.BandMF(bands=2, num_steps=20), adaptive_clipping=peg.dp.AdaptiveClipping())
    with pytest.raises(ValueError, match="cannot be shared"):
        mechanism = peg.dp.BandMF(bands=2, num_steps=20)
        _dp_model(mechanism), _dp_model(mechanism)
    with pytest.raises(TypeError, match="mechanism must be"):
        _dp_model("bandmf")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_a_restored_run_continues_the_noise_sequence_exactly(name, tmp_path):
    x, y = _data()
    cycle = MECHANISMS[name]().cycle_length

    def batches():
        return peg.dp.poisson_batches(x, y, sampling_probability=0.5, cycle_length=cycle, steps=cycle * 2, seed=3)

    whole = _dp_model(MECHANISMS[name]())
    whole.fit(batches(), epochs=2, verbose=0)
    first = _dp_model(MECHANISMS[name]())
    first.fit(batches(), epochs=1, verbose=0)
    first.save_weights(tmp_path / "dp.weights.h5")
    restored = _dp_model(MECHANISMS[name]())
    restored.load_weights(tmp_path / "dp.weights.h5")
    restored.fit(batches(), epochs=1, verbose=0)
    assert int(restored.dp_steps.numpy()) == int(whole.dp_steps.numpy()) == 4 * cycle
    for a, b in zip(restored.model.get_weights(), whole.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert restored.epsilon(1e-5) == whole.epsilon(1e-5)


@pytest.mark.parametrize("name", sorted(MECHANISMS))
def test_without_a_seed_the_noise_is_fresh(name):
    a, b = (_releases(_aggregator(MECHANISMS[name](), 512, seed=None), 3, 512) for _ in range(2))
    # Two independent runs: their noise is uncorrelated (|r| of 512 pairs within 6 / sqrt(512)).
    for t in range(3):
        assert abs(np.corrcoef(a[t], b[t])[0, 1]) < 6 / np.sqrt(512)


@pytest.mark.slow
def test_dp_model_epsilon_with_bandmf_is_the_cyclic_dp_sgd_epsilon():
    x, y = _data(40)
    dp = _dp_model(peg.dp.BandMF(bands=4, num_steps=16))
    dp.fit(
        peg.dp.poisson_batches(x, y, sampling_probability=0.5, cycle_length=4, steps=16, seed=0), epochs=1, verbose=0
    )
    assert dp.num_examples == 40 and dp.expected_batch_size is None
    reference = PrivacyAccountant(1.0, 0.5)
    reference.step(4)
    assert dp.epsilon(1e-3) == pytest.approx(reference.epsilon(1e-3), rel=ACCOUNTING_SAME_RTOL)
    # A budget of exactly that epsilon allows 16 steps and the rest of their cycle (4 participations).
    reference = PrivacyAccountant(1.0, 0.5, accountant="rdp")
    reference.step(4)
    budget = peg.dp.PrivacyBudget(epsilon=reference.epsilon(1e-3) * 1.0001, delta=1e-3, accountant="rdp", rtol=0.001)
    assert budget.max_steps(noise_multiplier=1.0, sampling_probability=0.5, mechanism=dp.mechanism) == 16


def test_gradient_accumulator_takes_a_mechanism_and_refuses_it_outside_dp_mode():
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    mechanism = peg.dp.BandMF(bands=3, num_steps=10)
    common = dict(l2_norm_clip=1.0, expected_batch_size=1.0, seed=2)
    acc = peg.GradientAccumulator(net, "mse", noise_multiplier=1.0, mechanism=mechanism, **common)
    plain = peg.GradientAccumulator(net, "mse", noise_multiplier=1.0, **common)
    noiseless = peg.GradientAccumulator(net, "mse", noise_multiplier=0.0, **common)
    x, y = _data(4)
    got, fresh = [], []
    for _ in range(4):  # no update is applied: every step has the same clipped sum
        for a, out in ((acc, got), (plain, fresh), (noiseless, [])):
            a.accumulate(x, y)
            out.append(np.concatenate([g.numpy().ravel() for g in a.result()]))
            a.reset()
    sums = np.concatenate([g.numpy().ravel() for g in (noiseless.accumulate(x, y), noiseless.result())[1]])
    want = sums + np.linalg.solve(_toeplitz(mechanism.coefficients, 4), (np.stack(fresh) - sums).astype(np.float64))
    np.testing.assert_allclose(np.stack(got), want, atol=rounding_rtol(16) * 8 * np.abs(want).max())
    with pytest.raises(ValueError, match="mechanism only applies in DP mode"):
        peg.GradientAccumulator(net, "mse", mechanism=peg.dp.BandMF(bands=2, num_steps=4))


def test_mechanism_arguments_are_checked():
    with pytest.raises(ValueError, match="cycle_length .* at least bands"):
        peg.dp.BandMF(bands=4, num_steps=10, cycle_length=2)
    with pytest.raises(ValueError, match="bands must be a positive integer"):
        peg.dp.BandMF(bands=0, num_steps=10)
    with pytest.raises(ValueError, match="theta must lie in"):
        peg.dp.BLT(buffers=1, num_steps=10, cycle_length=2, theta=[1.5], omega=[0.1])
    with pytest.raises(ValueError, match="build the model"):
        DPAggregator(noise_multiplier=1.0, mechanism=peg.dp.BandMF(bands=2, num_steps=4)).attach([])
    warnings.simplefilter("default")


def test_a_run_restored_into_another_factorization_is_refused(tmp_path):
    x, y = _data()
    dp = _dp_model(peg.dp.BandMF(bands=2, num_steps=20))
    dp.save_weights(tmp_path / "dp.weights.h5")
    other = _dp_model(peg.dp.BandMF(bands=2, num_steps=4))  # same shapes, other coefficients
    other.load_weights(tmp_path / "dp.weights.h5")
    with pytest.raises(ValueError, match="other parameters"):
        other.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.5, cycle_length=2, seed=0), epochs=1, verbose=0)
    with pytest.raises(ValueError, match="other parameters"):
        other.epsilon(1e-5)


@pytest.mark.parametrize("how", ["checkpoint", "load_weights", "skip_mismatch"])
def test_a_dp_sgd_run_restored_into_bandmf_is_refused_naming_both(tmp_path, how):
    # Restored through a checkpoint or load_weights(skip_mismatch=True), DP-SGD's steps were accounted
    # as BandMF's (about half the epsilon); plain load_weights failed with Keras's count of variables.
    x, y = _data()
    dp = _dp_model(None)
    dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.25, steps=8, seed=0), epochs=1, verbose=0)
    other = _dp_model(peg.dp.BandMF(bands=4, num_steps=64))
    both = "8 step\\(s\\) were taken with a GaussianNoise mechanism, and this DPModel's is a BandMF"
    if how == "checkpoint":
        path = tf.train.Checkpoint(model=dp).write(str(tmp_path / "run"))
        tf.train.Checkpoint(model=other).read(path).expect_partial()
        with pytest.raises(ValueError, match=both):
            other.epsilon(1e-5)
        with pytest.raises(ValueError, match=both):
            other.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.5, cycle_length=4, seed=0), verbose=0)
    else:
        dp.save_weights(tmp_path / "run.weights.h5")
        with pytest.raises(ValueError, match=both):
            other.load_weights(tmp_path / "run.weights.h5", skip_mismatch=how == "skip_mismatch")
    # The same mechanism takes the run over, and accounts it as the run did.
    same = _dp_model(None)
    path = tf.train.Checkpoint(model=dp).write(str(tmp_path / "same"))
    tf.train.Checkpoint(model=same).read(path).expect_partial()
    assert same.epsilon(1e-5) == pytest.approx(dp.epsilon(1e-5), rel=ACCOUNTING_SAME_RTOL)


def test_bandmf_states_its_sensitivity_for_the_planned_participations():
    mechanism = peg.dp.BandMF(bands=4, num_steps=16)
    c = _toeplitz(mechanism.coefficients, 16)
    # Participations 4 apart touch disjoint rows: the norm of the sum of their columns, worst at 0, 4, 8, 12.
    want = np.linalg.norm(c[:, [0, 4, 8, 12]].sum(axis=1))
    assert mechanism.sensitivity() == pytest.approx(want, rel=1e-12)
    assert mechanism.sensitivity() == pytest.approx(2.0, rel=1e-12)  # four full columns of norm 1


@pytest.mark.parametrize("name", ["dp_sgd", *sorted(MECHANISMS)])
def test_prefix_sum_error_is_that_of_the_explicit_matrices(name):
    from per_example_grads.dp.mechanisms import prefix_sum_error

    mechanism = peg.dp.GaussianNoise() if name == "dp_sgd" else MECHANISMS[name]()
    n = 20  # past the planned 12 steps: BLT's and BISR's C go on with the same generating function
    if name == "bisr":  # C^{-1} is the band itself
        inverse = _toeplitz(inverse_square_root_band(mechanism.bands), n)
    else:
        c = mechanism.coefficients
        if name == "blt":
            c = peg.dp.mf_strategies.blt_coefficients(mechanism.theta, mechanism.omega, n)
        inverse = np.linalg.inv(_toeplitz(c, n))
    a = np.tril(np.ones((n, n)))
    want = np.linalg.norm(a @ inverse) / np.sqrt(n)
    assert prefix_sum_error(mechanism, n) == pytest.approx(want, rel=1e-10)
    if name == "dp_sgd":
        assert want == pytest.approx(np.sqrt((n + 1) / 2), rel=1e-12)


class _HalfNoise(peg.dp.NoiseMechanism):
    """A mechanism of one's own: half DP-SGD's noise, and accounted as such."""

    def build_state(self, variables):
        return  # stateless

    def correlate(self, fresh, step):
        return [z / 2 for z in fresh]

    def accounted_as(self, noise_multiplier, sampling_probability, steps):
        return noise_multiplier / 2, sampling_probability, steps


def test_a_mechanism_of_ones_own_is_accounted_as_it_says():
    # Its accounting was consulted only for a mechanism flagged correlated: this one reported
    # DP-SGD's epsilon at the full noise, and a budget let the run past it.
    x, y = _data()
    budget = peg.dp.PrivacyBudget(epsilon=30.0, delta=1e-5, accountant="rdp")  # PLD at sigma 0.5 takes seconds
    dp = _dp_model(_HalfNoise(), budget=budget)
    dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.5, steps=6, seed=0), epochs=1, verbose=0)
    half = PrivacyAccountant(0.5, 0.5, accountant="rdp")  # the reference: dp_accounting at the noise it adds
    half.step(6)
    assert dp.epsilon(1e-5, accountant="rdp") == pytest.approx(half.epsilon(1e-5), rel=ACCOUNTING_SAME_RTOL)
    assert dp.max_steps() == budget.max_steps(noise_multiplier=0.5, sampling_probability=0.5)
    mechanism = _HalfNoise()
    assert compute_epsilon(24, 12, None, 1.0, 1e-5, steps=6, mechanism=mechanism, accountant="rdp") == pytest.approx(
        half.epsilon(1e-5), rel=ACCOUNTING_SAME_RTOL
    )


class _HalfNoiseAsZCDP(_HalfNoise):
    """Half DP-SGD's noise, stating its event instead of a triple: each step rho-zCDP, rho = 1 / (2 (sigma / 2)^2).

    True without sampling (the Gaussian mechanism's zCDP; it forgoes amplification), and no Poisson-sampled Gaussian
    step: the accountant composes the event as it is.
    """

    accounted_as = peg.dp.NoiseMechanism.accounted_as  # not stated: dp_event is

    def dp_event(self, noise_multiplier, sampling_probability, steps):
        return dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(2.0 / noise_multiplier**2), steps)


def test_a_mechanism_that_states_its_dp_event_is_accounted_by_it():
    # The reference: dp_accounting's RDP of the Gaussian mechanism at the noise it adds, without sampling (the
    # same Renyi curve, alpha / (2 (sigma / 2)^2), as the stated zCDP).
    x, y = _data()
    budget = peg.dp.PrivacyBudget(epsilon=60.0, delta=1e-5, accountant="rdp")
    dp = _dp_model(_HalfNoiseAsZCDP(), budget=budget)
    dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.5, steps=4, seed=0), epochs=1, verbose=0)
    dp.fit(peg.dp.poisson_batches(x, y, sampling_probability=0.25, steps=2, seed=1), epochs=1, verbose=0)

    def rdp_epsilon(steps):
        event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(0.5), steps)
        accountant = dp_accounting.rdp.RdpAccountant()
        return accountant.compose(event).get_epsilon(1e-5)

    assert dp.epsilon(1e-5, accountant="rdp") == pytest.approx(rdp_epsilon(6), rel=ACCOUNTING_SAME_RTOL)
    assert rdp_epsilon(dp.max_steps()) <= 60.0 < rdp_epsilon(dp.max_steps() + 1)
    mechanism = _HalfNoiseAsZCDP()
    assert compute_epsilon(24, 12, None, 1.0, 1e-5, steps=6, mechanism=mechanism, accountant="rdp") == pytest.approx(
        rdp_epsilon(6), rel=ACCOUNTING_SAME_RTOL
    )
    with pytest.raises(ValueError, match="'pld' accountant of dp_accounting cannot account"):  # zCDP: RDP only
        dp.epsilon(1e-5)


def test_a_mechanism_that_states_no_accounting_is_refused():
    class Silent(peg.dp.NoiseMechanism):
        def correlate(self, fresh, step):
            return list(fresh)

    for make in (
        lambda: _dp_model(Silent()),
        lambda: compute_epsilon(24, 12, None, 1.0, 1e-5, steps=6, mechanism=Silent()),
        lambda: peg.dp.PrivacyBudget(epsilon=1.0, delta=1e-5).max_steps(
            noise_multiplier=1.0, sampling_probability=0.5, mechanism=Silent()
        ),
    ):
        with pytest.raises(
            TypeError, match="Silent does not say how its steps are accounted: implement accounted_as.* or dp_event"
        ):
            make()
    with pytest.raises(TypeError, match="mechanism must be a peg.dp.NoiseMechanism .* got str 'BandMF'"):
        compute_epsilon(24, 12, None, 1.0, 1e-5, steps=6, mechanism="BandMF")
