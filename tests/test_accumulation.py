"""Gradient accumulation (plain and DP) and the compute/apply split."""

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
