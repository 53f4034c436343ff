"""The one DP step of dp/aggregator.py, as DPModel, GradientAccumulator and private_gradients take it.

References are independent: a one-example ``tf.GradientTape`` loop, clipped
and summed in NumPy, and the noise of the same key and step drawn from a
second aggregator's release of a zero sum.
"""

import importlib
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_close, reference_gradients
from per_example_grads.dp.aggregator import ClippedSum, DPAggregator
from tolerances import EPS32, clipped_sum_rtol

sparse_ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
CLIP = 0.5


def _net():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)])


def _data(n=12):
    rng = np.random.RandomState(1)
    return rng.normal(size=(n, 5)).astype("float32"), (np.arange(n) % 3).astype("int32")


def _reference_clipped(net, x, y, weights=None):
    """``(sum_i clip_C(w_i g_i), norms)`` in NumPy, from the one-example loop."""
    grads = reference_gradients(net, sparse_ce, x, y, sample_weight=weights)
    flat = np.concatenate([g.reshape(len(x), -1) for g in grads], axis=1).astype(np.float64)
    norms = np.linalg.norm(flat, axis=1)
    factors = np.minimum(1.0, CLIP / np.maximum(norms, 1e-30))
    return [np.tensordot(factors, g.astype(np.float64), axes=1) for g in grads], norms


def _noise(seed, shapes, divisor):
    """The noise of step 0 of an aggregator seeded ``seed``, divided by ``divisor``: a zero sum's release."""
    fresh = DPAggregator(l2_norm_clip=CLIP, noise_multiplier=1.0, seed=seed)
    return [g.numpy() for g in fresh.release([tf.zeros(s) for s in shapes], divisor)]


def _assert_sums_close(got, want, n):
    p = sum(w.size for w in want)
    rtol = clipped_sum_rtol(p, n)
    for g, w in zip(got, want):
        # entries of the noise (std sigma C / D) are rounded once more, relative to their size
        assert_close(np.asarray(g), w, rtol=rtol + 2 * EPS32, atol=rtol * n * CLIP)


@pytest.mark.slow  # a one-example reference loop
def test_step_is_the_clipped_sum_plus_this_steps_noise_over_the_divisor():
    net, (x, y) = _net(), _data()
    aggregator = DPAggregator(l2_norm_clip=CLIP, noise_multiplier=1.0, seed=7)
    step = aggregator.step(net, sparse_ce, x, y, divisor=4.0, sampling_probability=0.25, poisson=True)
    sums, norms = _reference_clipped(net, x, y)
    noise = _noise(7, [v.shape for v in net.trainable_variables], 4.0)
    _assert_sums_close(step.gradients, [s / 4.0 + z for s, z in zip(sums, noise)], len(x))
    assert int(aggregator.steps.numpy()) == 1
    assert float(aggregator.max_sampling_probability.numpy()) == 0.25
    assert float(step.counted.numpy()) == len(x)
    # clipped_count compares float32 norms with C: allow the examples within rounding of C either way
    near = np.abs(norms - CLIP) <= 1e-5 * CLIP
    assert np.sum(norms > CLIP) - near.sum() <= float(step.clipped_count.numpy()) <= np.sum(norms > CLIP) + near.sum()
    assert float(step.clipped_fraction.numpy()) == pytest.approx(float(step.clipped_count.numpy()) / len(x))


@pytest.mark.slow  # a one-example reference loop
def test_step_defaults_its_divisor_to_the_batch_rows():
    net, (x, y) = _net(), _data()
    step = DPAggregator(l2_norm_clip=CLIP, noise_multiplier=0.0, seed=0).step(net, sparse_ce, x, y)
    sums, _ = _reference_clipped(net, x, y)
    _assert_sums_close(step.gradients, [s / len(x) for s in sums], len(x))


def test_release_of_the_sums_alone_equals_release_of_their_clipped_sum():
    sums = [tf.constant(np.linspace(-1, 1, 6), tf.float32)]
    with_norms = DPAggregator(l2_norm_clip=CLIP, noise_multiplier=1.0, seed=3)
    alone = DPAggregator(l2_norm_clip=CLIP, noise_multiplier=1.0, seed=3)
    want = with_norms.release(ClippedSum(sums, tf.ones([2]), tf.ones([2])), 2.0)[0].numpy()
    got = alone.release(sums, 2.0)[0].numpy()
    np.testing.assert_array_equal(got, want)
    assert int(alone.steps.numpy()) == int(with_norms.steps.numpy()) == 1


def test_adaptive_clipping_refuses_a_release_without_the_norms():
    aggregator = DPAggregator(
        noise_multiplier=1.0, expected_batch_size=4.0, seed=0, adaptive_clipping=peg.dp.AdaptiveClipping()
    )
    with pytest.raises(ValueError, match="adaptive clipping .* needs the ClippedSum"):
        aggregator.release([tf.zeros([3])], 4.0)
    assert int(aggregator.steps.numpy()) == 0


@pytest.mark.slow  # a one-example reference loop
def test_private_gradients_leaves_zero_weight_rows_out_exactly():
    # The rows of weight 0 are not computed (the step's gathering of real rows); the divisor stays B.
    net, (x, y) = _net(), _data()
    weights = (np.arange(len(x)) % 3 != 0).astype("float32")
    got = peg.dp.private_gradients(
        net, sparse_ce, x, y, l2_norm_clip=CLIP, noise_multiplier=0.0, sample_weight=weights, seed=(0, 9)
    )
    sums, _ = _reference_clipped(net, x, y, weights)
    _assert_sums_close(got, [s / len(x) for s in sums], len(x))


def test_the_accumulator_has_one_home_and_the_old_path_still_imports_it():
    from per_example_grads.dp.accumulation import GradientAccumulator

    assert peg.GradientAccumulator is GradientAccumulator is peg.dp.GradientAccumulator
    sys.modules.pop("per_example_grads.accumulation", None)
    with pytest.warns(DeprecationWarning, match="per_example_grads.accumulation is deprecated"):
        old = importlib.import_module("per_example_grads.accumulation")
    assert old.GradientAccumulator is GradientAccumulator
