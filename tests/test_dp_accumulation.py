"""Gradient accumulation (plain and DP) and the compute/apply split."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_clipped_sums_close, assert_grads_close, reference_gradients, reference_norms, sparse_ce
from tolerances import GRADIENT_RTOL, Z, weighted_sum_rtol

rng = np.random.default_rng(5)


def _case(n=12):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    return model, rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n).astype("int32")


@pytest.mark.parametrize("splits", [[12], [4, 4, 4], [1, 7, 0, 4]])
def test_plain_accumulation_equals_full_batch_mean_gradient(splits):
    model, x, y = _case()
    acc = peg.GradientAccumulator(model, sparse_ce)
    start = 0
    for n in splits:
        acc.accumulate(x[start : start + n], y[start : start + n])
        start += n
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(sparse_ce(y, model(x)))
    want = tape.gradient(loss, model.trainable_variables)
    assert float(acc.count.numpy()) == 12
    # The mean over 12 examples of gradients that agree to GRADIENT_RTOL, relative to the mean of their magnitudes.
    rtol = weighted_sum_rtol(12, GRADIENT_RTOL)
    scale = max(float(np.max(np.abs(r).mean(axis=0))) for r in reference_gradients(model, sparse_ce, x, y))
    for g, w in zip(acc.result(), want):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("splits", [[12], [5, 7], [2, 2, 8]])
def test_dp_accumulation_equals_one_clipped_batch(splits):
    model, x, y = _case()
    ref = reference_gradients(model, sparse_ce, x, y)
    factors = np.minimum(1, 0.2 / reference_norms(ref))
    acc = peg.GradientAccumulator(model, sparse_ce, l2_norm_clip=0.2, noise_multiplier=0.0, expected_batch_size=12.0)
    start = 0
    for n in splits:
        acc.accumulate(x[start : start + n], y[start : start + n])
        start += n
    assert_clipped_sums_close(acc.result(), ref, factors, divisor=12.0)


def test_dp_noise_is_added_once_per_logical_batch():
    """k micro-batches of pure noise: the logical step's noise std is sigma*C, not sqrt(k) times it."""
    model = keras.Sequential([keras.Input((100,)), keras.layers.Dense(100)])
    x, y = rng.normal(size=(8, 100)).astype("float32"), rng.integers(0, 100, 8)
    acc = peg.GradientAccumulator(
        model, sparse_ce, l2_norm_clip=1.0, noise_multiplier=2.0, seed=3, expected_batch_size=1.0
    )
    opt = keras.optimizers.SGD(1.0)
    for i in range(4):  # four micro-batches with zero data contribution
        acc.accumulate(x[2 * i : 2 * i + 2], y[2 * i : 2 * i + 2], sample_weight=np.zeros(2, "float32"))
    before = [v.numpy().copy() for v in model.trainable_variables]
    acc.apply(opt)
    step = np.concatenate([(b - v.numpy()).ravel() for b, v in zip(before, model.trainable_variables)])
    n = step.size
    assert abs(step.std() - 2.0) < Z * 2.0 / np.sqrt(2 * n)
    assert int(acc.steps.numpy()) == 1
    assert float(acc.count.numpy()) == 0.0 and all(np.all(s.numpy() == 0) for s in acc.sums)


@pytest.mark.slow
def test_accumulate_in_tf_function_without_retracing_and_checkpoint(tmp_path):
    model, x, y = _case(16)
    acc = peg.GradientAccumulator(model, sparse_ce)
    step = tf.function(acc.accumulate, input_signature=[tf.TensorSpec([None, 6]), tf.TensorSpec([None], tf.int32)])
    for i in range(4):
        step(x[4 * i : 4 * i + 4], y[4 * i : 4 * i + 4])
    assert step.experimental_get_tracing_count() == 1
    ckpt = tf.train.Checkpoint(acc=acc)
    path = ckpt.save(tmp_path / "acc")
    saved = [s.numpy().copy() for s in acc.sums]
    acc.reset()
    ckpt.restore(path)
    for a, b in zip(acc.sums, saved):
        np.testing.assert_array_equal(a.numpy(), b)
    assert float(acc.count.numpy()) == 16


def test_bad_accumulator_arguments():
    model, _, _ = _case()
    with pytest.raises(ValueError, match="noise_multiplier only applies in DP mode, which l2_norm_clip enables"):
        peg.GradientAccumulator(model, sparse_ce, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="noise_multiplier is required"):
        peg.GradientAccumulator(model, sparse_ce, l2_norm_clip=1.0)


@pytest.mark.parametrize("mode", ["mean", "sum", "per_example", "clipped_sum"])
def test_compute_gradients_modes(mode):
    model, x, y = _case(6)
    ref = reference_gradients(model, sparse_ce, x, y)
    clip = dict(l2_norm_clip=0.1) if mode == "clipped_sum" else {}  # refused by the other modes
    pairs = peg.compute_gradients(model, sparse_ce, x, y, mode=mode, **clip)
    assert [v for _, v in pairs] == list(model.trainable_variables)
    got = [g for g, _ in pairs]
    if mode == "per_example":
        assert_grads_close(got, ref)
    elif mode == "clipped_sum":
        assert_clipped_sums_close(got, ref, np.minimum(1, 0.1 / reference_norms(ref)))
    else:  # a plain sum or mean of 6 examples: weights 1, no clipping
        divisor = 6.0 if mode == "mean" else 1.0
        assert_clipped_sums_close(got, ref, np.ones(6), divisor=divisor, rtol=weighted_sum_rtol(6, GRADIENT_RTOL))


def test_export_import_round_trip_and_errors(tmp_path):
    model, x, y = _case(6)
    pairs = peg.compute_gradients(model, sparse_ce, x, y)
    arrays = peg.export_gradients(pairs)
    np.savez(tmp_path / "g.npz", **{k.replace("/", "|"): v for k, v in arrays.items()})
    loaded = {k.replace("|", "/"): v for k, v in np.load(tmp_path / "g.npz").items()}
    clone = keras.models.clone_model(model)
    clone.set_weights(model.get_weights())
    back = peg.import_gradients(loaded, clone.trainable_variables)
    for (g, v), (g0, v0) in zip(back, pairs):
        np.testing.assert_array_equal(g, g0)
        assert v.path == v0.path
    keras.optimizers.SGD(0.5).apply_gradients(back)  # the documented one-liner
    with pytest.raises(ValueError, match="missing gradients"):
        peg.import_gradients({k: v for k, v in list(arrays.items())[1:]}, clone.trainable_variables)
    bad = dict(arrays)
    first = next(iter(bad))
    bad[first] = bad[first][:1]
    with pytest.raises(ValueError, match="shape"):
        peg.import_gradients(bad, clone.trainable_variables)
    bad[first] = arrays[first].astype("float64")
    with pytest.raises(ValueError, match="dtype float64"):
        peg.import_gradients(bad, clone.trainable_variables)
    with pytest.raises(ValueError, match="unknown variables"):
        peg.import_gradients({**arrays, "other/kernel": arrays[first]}, clone.trainable_variables)


# -- epsilon of an accumulator's releases ----------------------------------


def _dp_accumulator(model, **kw):
    return peg.GradientAccumulator(
        model, sparse_ce, l2_norm_clip=1.0, noise_multiplier=1.2, expected_batch_size=6, seed=0, **kw
    )


def _releases(acc, x, y, count):
    for _ in range(count):
        acc.accumulate(x[:4], y[:4])
        acc.accumulate(x[4:6], y[4:6])
        acc.result()
        acc.reset()


def _dp_accounting_epsilon(parts, delta):
    """dp_accounting's PLD epsilon of ``[(steps, sigma, q)]`` composed (an independent reference)."""
    import dp_accounting

    events = [
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
        )
        for steps, sigma, q in parts
    ]
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    return accountant.compose(dp_accounting.ComposedDpEvent(events)).get_epsilon(delta)


def test_epsilon_of_releases_without_sampling_counts_every_example_in_every_step():
    model, x, y = _case()
    acc = _dp_accumulator(model)
    assert acc.epsilon(1e-5) == 0.0
    _releases(acc, x, y, 3)
    eps = acc.epsilon(1e-5)
    assert eps == peg.dp.compute_epsilon(12, 12, None, 1.2, 1e-5, steps=3, sampling_probability=1.0)
    units = _dp_accumulator(model, privacy_unit="unit")  # per unit: each unit in every release
    for _ in range(3):
        units.accumulate(x[:6], y[:6], unit_ids=np.arange(6) // 2)
        units.result()
        units.reset()
    assert units.epsilon(1e-5) == eps
    # dp_accounting at a finer discretization: the PLD's pessimistic rounding moves epsilon by under 1 %.
    np.testing.assert_allclose(eps, _dp_accounting_epsilon([(3, 1.2, 1.0)], 1e-5), rtol=1e-2)


def test_epsilon_with_a_sampling_probability_survives_a_checkpoint_and_composes_with_another(tmp_path):
    model, x, y = _case()
    acc = _dp_accumulator(model, sampling_probability=0.25)
    _releases(acc, x, y, 4)
    assert acc.epsilon(1e-5) == peg.dp.compute_epsilon(24, 6, None, 1.2, 1e-5, steps=4, sampling_probability=0.25)
    path = tf.train.Checkpoint(acc=acc).write(str(tmp_path / "acc"))

    again = _dp_accumulator(model, sampling_probability=0.5)  # a restart, now sampling at another rate
    tf.train.Checkpoint(acc=again).read(path).assert_consumed()
    assert again.epsilon(1e-5) == acc.epsilon(1e-5)  # the restored ledger, not a new run
    _releases(again, x, y, 2)
    assert int(again.steps.numpy()) == 6
    eps = again.epsilon(1e-5)
    np.testing.assert_allclose(eps, _dp_accounting_epsilon([(4, 1.2, 0.25), (2, 1.2, 0.5)], 1e-5), rtol=1e-2)
    assert eps > acc.epsilon(1e-5)


def test_epsilon_is_refused_in_plain_mode_and_for_a_mechanism_whose_sampling_it_cannot_see():
    model, x, y = _case()
    with pytest.raises(ValueError, match="plain mode .* not private"):
        peg.GradientAccumulator(model, sparse_ce).epsilon(1e-5)
    banded = _dp_accumulator(model, mechanism=peg.dp.BandMF(bands=2, num_steps=4, cycle_length=2))
    with pytest.raises(ValueError, match=r"cannot account BandMF's releases: .* peg\.dp\.compute_epsilon"):
        banded.epsilon(1e-5)
    with pytest.raises(ValueError, match="sampling_probability only applies in DP mode"):
        peg.GradientAccumulator(model, sparse_ce, sampling_probability=0.1)
    with pytest.raises(ValueError, match="sampling_probability"):
        _dp_accumulator(model, sampling_probability=1.5)


# -- a privacy budget on an accumulator's releases ---------------------------


def test_budget_in_steps_stops_releases_in_eager_and_traced_code_and_across_a_restore(tmp_path):
    model, x, y = _case()
    acc = _dp_accumulator(model, budget=peg.dp.PrivacyBudget(steps=3))
    assert acc.max_steps() == 3
    _releases(acc, x, y, 2)
    path = tf.train.Checkpoint(acc=acc).write(str(tmp_path / "acc"))

    again = _dp_accumulator(model, budget=peg.dp.PrivacyBudget(steps=3))
    tf.train.Checkpoint(acc=again).read(path).assert_consumed()

    @tf.function
    def release(a, b):
        again.accumulate(a, b)
        return again.result()

    release(x[:6], y[:6])  # the third release of the run
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"budget \(3 steps\) allows no more releases"):
        release(x[:6], y[:6])
    assert int(again.steps.numpy()) == 3  # the refused release is not counted
    again.reset()
    with pytest.raises(tf.errors.InvalidArgumentError, match="allows no more releases"):
        again.result()  # eagerly too


def test_budget_in_epsilon_is_spent_exactly_to_its_last_allowed_release():
    model, x, y = _case()
    budget = peg.dp.PrivacyBudget(epsilon=6.0, delta=1e-5, accountant="rdp")  # RDP: a quick search
    acc = _dp_accumulator(model, sampling_probability=0.5, budget=budget)
    limit = acc.max_steps()
    assert limit == budget.max_steps(noise_multiplier=1.2, sampling_probability=0.5) and limit >= 2
    _releases(acc, x, y, limit)
    assert acc.epsilon(1e-5, accountant="rdp") <= 6.0
    with pytest.raises(tf.errors.InvalidArgumentError, match="allows no more releases"):
        _releases(acc, x, y, 1)
    # The limit is the largest within the target, to the budget's rtol (1 %): a few releases more go past it.
    past = math.ceil(limit * 1.01) + 1
    assert peg.dp.compute_epsilon(24, 12, None, 1.2, 1e-5, steps=past, sampling_probability=0.5, accountant="rdp") > 6.0


def test_budget_refused_where_the_accumulator_cannot_count_what_releases_spend():
    model, _, _ = _case()
    with pytest.raises(ValueError, match=r"GradientAccumulator: budget cannot be combined with a correlated mechanism"):
        _dp_accumulator(
            model, mechanism=peg.dp.BandMF(bands=2, num_steps=4, cycle_length=2), budget=peg.dp.PrivacyBudget(steps=2)
        )
    with pytest.raises(ValueError, match="budget only applies in DP mode"):
        peg.GradientAccumulator(model, sparse_ce, budget=peg.dp.PrivacyBudget(steps=2))
    with pytest.raises(TypeError, match="budget must be a peg.dp.PrivacyBudget"):
        _dp_accumulator(model, budget=3)
