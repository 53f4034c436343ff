"""DP-SGD through private_gradients: the step against a hand computation, clipping, noise and its seeding, padding, argument checks."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_clipped_sums_close, hand_dp_step, mlp, reference_norms, sparse_ce
from per_example_grads.dp.private import private_gradients
from tolerances import (
    ELEMENTWISE_RTOL,
    EPS64,
    Z,
    clipped_sum_rtol,
    norm_rtol,
    rounding_rtol,
)

rng = np.random.default_rng(11)


@pytest.mark.parametrize("method", ["layerwise", "vectorized"])
def test_noiseless_step_equals_hand_computation(method):
    model = mlp()
    x, y = rng.normal(size=(6, 6)).astype("float32") * 5, rng.integers(0, 3, 6)
    ref, factors = hand_dp_step(model, x, y, clip=0.3)
    got = private_gradients(
        model, sparse_ce, x, y, l2_norm_clip=0.3, noise_multiplier=0.0, expected_batch_size=10.0, method=method
    )
    assert_clipped_sums_close(got, ref, factors, divisor=10.0)
    # numpy's n * min(1, C / n): two float64 roundings.
    assert np.all(reference_norms(ref) * factors <= 0.3 * (1 + rounding_rtol(2, EPS64)))


def test_huge_gradients_are_clipped_to_c():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    x, y = rng.normal(size=(5, 6)).astype("float32") * 1e6, rng.integers(0, 3, 5)
    grads = peg.per_example_gradients(model, sparse_ce, x, y)
    clipped, norms = peg.clip_by_global_norm(grads, 0.5)
    assert norms.numpy().max() > 1e3
    p = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    # Entries scaled by a factor (a few roundings), then their norm taken again in float32.
    assert np.all(peg.global_norms(clipped).numpy() <= 0.5 * (1 + norm_rtol(p, ELEMENTWISE_RTOL)))
    sums, norms = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.5, return_norms=True)
    # Five contributions of norm C up to their factors' error (the library's own norms), summed in float32.
    assert np.sqrt(sum(np.sum(np.square(s)) for s in sums)) <= 5 * 0.5 * (1 + clipped_sum_rtol(p, 5))


def test_noise_statistics_and_seeding():
    """Noise alone: zero data contribution (sample weights 0), sigma * C = 3."""
    model = keras.Sequential([keras.Input((200,)), keras.layers.Dense(100)])
    x, y = rng.normal(size=(4, 200)).astype("float32"), rng.integers(0, 100, 4)
    kwargs = dict(l2_norm_clip=2.0, noise_multiplier=1.5, expected_batch_size=1.0, sample_weight=np.zeros(4, "float32"))
    grads = private_gradients(model, sparse_ce, x, y, seed=(7, 3), **kwargs)
    sample = np.concatenate([np.ravel(g) for g in grads])
    n, sd = sample.size, 3.0
    assert n == 200 * 100 + 100
    # Mean within Z standard errors; the sample std's std is sd / sqrt(2n).
    assert abs(sample.mean()) < Z * sd / np.sqrt(n)
    assert abs(sample.std() - sd) < Z * sd / np.sqrt(2 * n)
    again = private_gradients(model, sparse_ce, x, y, seed=(7, 3), **kwargs)
    other = private_gradients(model, sparse_ce, x, y, seed=(7, 4), **kwargs)
    np.testing.assert_array_equal(again[0], grads[0])
    assert not np.allclose(other[0], grads[0])
    gen_a, gen_b = tf.random.Generator.from_seed(5), tf.random.Generator.from_seed(5)
    a = private_gradients(model, sparse_ce, x, y, seed=gen_a, **kwargs)
    b = private_gradients(model, sparse_ce, x, y, seed=gen_b, **kwargs)
    np.testing.assert_array_equal(a[0], b[0])
    # OS entropy: two draws differ.
    c = private_gradients(model, sparse_ce, x, y, seed=None, **kwargs)
    d = private_gradients(model, sparse_ce, x, y, seed=None, **kwargs)
    assert not np.allclose(c[0], d[0])


def test_noised_average_noises_every_embedding_row_at_the_divided_scale():
    """An IndexedSlices sum (a row repeated) gets the noise of its dense form; every row is noised with std sigma C / D.

    (test_noise_statistics_and_seeding divides by 1: it cannot see the noise left undivided.)
    """
    from per_example_grads.dp.privatizers import noised_average

    rows = tf.constant([[1.0, -2.0], [3.0, 4.0], [5.0, 6.0]])
    sliced = tf.IndexedSlices(rows, tf.constant([7, 2, 7], tf.int64), tf.constant([6000, 2], tf.int64))
    dense = tf.convert_to_tensor(sliced)
    got = noised_average([sliced], 3.0, 4.0, seed=(1, 2), step=0)[0].numpy()
    want = noised_average([dense], 3.0, 4.0, seed=(1, 2), step=0)[0].numpy()
    # Each side: a few roundings (the two repeated rows' sum, the division, the addition), relative to the terms.
    np.testing.assert_allclose(got, want, rtol=0, atol=rounding_rtol(4) * (np.abs(want).max() + 12 / 4))
    sample, sd = np.ravel(got - dense.numpy() / 4), 3.0 / 4
    assert abs(sample.mean()) < Z * sd / np.sqrt(sample.size)
    assert abs(sample.std() - sd) < Z * sd / np.sqrt(2 * sample.size)


def test_private_gradients_in_tf_function_apply():
    model = mlp()
    opt = keras.optimizers.SGD(0.1)
    gen = tf.random.Generator.from_seed(1)

    @tf.function(input_signature=[tf.TensorSpec([None, 6]), tf.TensorSpec([None], tf.int32)])
    def step(x, y):
        grads = private_gradients(
            model, sparse_ce, x, y, l2_norm_clip=1.0, noise_multiplier=1.0, seed=gen, expected_batch_size=8.0
        )
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return grads

    before = [v.numpy().copy() for v in model.trainable_variables]
    for n in (8, 5, 0):  # an empty batch still steps (noise only)
        step(rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n).astype("int32"))
    assert step.experimental_get_tracing_count() == 1
    assert any(not np.allclose(b, v.numpy()) for b, v in zip(before, model.trainable_variables))


def test_padded_rows_contribute_nothing():
    model = mlp()
    x, y = rng.normal(size=(4, 6)).astype("float32"), rng.integers(0, 3, 4)
    padded_x = np.concatenate([x, np.zeros((3, 6), "float32")])
    padded_y = np.concatenate([y, np.zeros(3, int)])
    mask = np.array([1, 1, 1, 1, 0, 0, 0], "float32")
    a = private_gradients(model, sparse_ce, x, y, l2_norm_clip=0.5, noise_multiplier=0.0, expected_batch_size=4.0)
    b = private_gradients(
        model,
        sparse_ce,
        padded_x,
        padded_y,
        sample_weight=mask,
        l2_norm_clip=0.5,
        noise_multiplier=0.0,
        expected_batch_size=4.0,
    )
    # The same four examples in a batch of 4 and of 7: per-example gradients from other kernels, clipped and summed.
    ref, factors = hand_dp_step(model, x, y, clip=0.5)
    assert_clipped_sums_close(a, ref, factors, divisor=4.0)
    assert_clipped_sums_close(b, ref, factors, divisor=4.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(l2_norm_clip=0.0, noise_multiplier=1.0), "l2_norm_clip"),
        (dict(l2_norm_clip=-1.0, noise_multiplier=1.0), "l2_norm_clip"),
        (dict(l2_norm_clip=1.0, noise_multiplier=-0.5), "noise_multiplier"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=0), "expected_batch_size"),
    ],
)
def test_bad_dp_arguments(kwargs, match):
    model = mlp()
    with pytest.raises(ValueError, match=match):
        private_gradients(model, sparse_ce, np.ones((2, 6), "float32"), np.zeros(2, int), **kwargs)
    if "expected_batch_size" not in kwargs:
        with pytest.raises(ValueError, match=match):
            peg.keras.DPModel(model, **kwargs)


def test_scalar_loss_is_rejected():
    model = mlp()
    with pytest.raises(peg.InvalidLossError):
        private_gradients(
            model,
            lambda y, p: tf.reduce_mean(sparse_ce(y, p)),
            np.ones((2, 6), "float32"),
            np.zeros(2, int),
            l2_norm_clip=1.0,
            noise_multiplier=1.0,
        )
