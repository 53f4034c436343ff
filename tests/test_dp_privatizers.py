"""Privatizers (``per_example_grads.dp.privatizers``): how they nest, what each adds, how each is accounted."""

import itertools

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import mlp, sparse_ce
from per_example_grads.dp import audit, privatizers
from per_example_grads.dp.accounting import sampled_gaussian_event
from per_example_grads.dp.aggregator import ClippedSum
from per_example_grads.dp.noise import noise_source
from per_example_grads.dp.sparse_embeddings import SparseEmbeddings
from tolerances import EPS32, rounding_rtol


def _mechanisms():
    return [
        peg.dp.GaussianNoise(),
        peg.dp.BandMF(bands=2, num_steps=8, cycle_length=2),
        peg.dp.BLT(buffers=2, num_steps=8, cycle_length=2),
        peg.dp.BISR(bands=3, num_steps=8, cycle_length=2),
    ]


def _adaptive(stddev=1.0):
    return peg.dp.AdaptiveClipping(
        target_quantile=0.5, learning_rate=0.3, clipped_count_stddev=stddev, initial_l2_norm_clip=0.7
    )


def _bag_selection():
    import keras

    model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(30, 4), keras.layers.Dense(2)])
    return SparseEmbeddings().bind(model, model.trainable_variables, noise_multiplier=1.0)


@pytest.mark.parametrize("canaries, adaptive", list(itertools.product([False, True], [False, True])))
def test_compose_nests_canaries_inside_adaptive_clipping_around_the_noise(canaries, adaptive):
    mechanism = peg.dp.GaussianNoise()
    got = privatizers.compose(
        mechanism=mechanism,
        noise_multiplier=1.0,
        noise=noise_source(0),
        canaries=audit.GradientCanaries(2) if canaries else None,
        adaptive=_adaptive() if adaptive else None,
        clip_norm=tf.Variable(0.7),
    )
    chain = []
    while True:
        chain.append(type(got))
        if not hasattr(got, "inner"):
            break
        got = got.inner
    expected = (
        ([privatizers.ClipUpdate] if adaptive else [])
        + ([privatizers.CanaryInsertion] if canaries else [])
        + [privatizers.DenseNoise]
    )
    assert chain == expected
    assert got.mechanism is mechanism


def test_compose_gives_sparse_noise_and_refuses_what_it_cannot_wrap_naming_both_parts():
    selection = _bag_selection()
    base = dict(mechanism=peg.dp.GaussianNoise(), noise_multiplier=1.0, noise=noise_source(0), sparse=selection)
    assert isinstance(privatizers.compose(**base), privatizers.SparseNoise)
    with pytest.raises(ValueError, match=r"DPAggregator: .*canaries.* cannot be combined with .*sparse"):
        privatizers.compose(**base, canaries=audit.GradientCanaries(2))
    with pytest.raises(ValueError, match=r"DPAggregator: .*sparse.* cannot be combined with .*adaptive"):
        privatizers.compose(**base, adaptive=_adaptive(), clip_norm=tf.Variable(0.7))


@pytest.mark.parametrize("mechanism", _mechanisms(), ids=lambda m: type(m).__name__)
def test_every_wrapper_is_accounted_as_the_noise_it_wraps(mechanism):
    """Canaries and adaptive clipping cost what the mechanism's release costs at the run's sigma (their modules say why)."""
    dense = privatizers.DenseNoise(mechanism, 0.9, noise_source(0))
    wrapped = privatizers.ClipUpdate(
        privatizers.CanaryInsertion(dense, audit.GradientCanaries(2)), _adaptive(), tf.Variable(0.7), noise_source(0)
    )
    for sigma, q, steps in ((1.3, 0.25, 7), (4.0, 1.0, 16), (2.0, 0.5, 0)):
        assert wrapped.dp_event(sigma, q, steps) == mechanism.dp_event(sigma, q, steps)
        assert mechanism.dp_event(sigma, q, steps) == sampled_gaussian_event(*mechanism.accounted_as(sigma, q, steps))


def test_sparse_noise_is_accounted_as_dp_sgd():
    sparse = privatizers.SparseNoise(_bag_selection(), peg.dp.GaussianNoise(), noise_source(0))
    assert sparse.dp_event(1.3, 0.25, 7) == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(1.3)), 7
    )


def _context(clipped=None, clip=1.0, divisor=4.0, step=0, q=None):
    return privatizers.ReleaseContext(clipped, clip, divisor, tf.constant(step, tf.int64), q)


def test_dense_noise_adds_the_mechanisms_noise_once_over_the_divisor():
    """With sigma C = 0.5: the release minus S / D is the noise over D, its std 0.5 / D (10^4 draws, 5 standard errors)."""
    sums = [tf.fill([100, 100], 3.0)]
    out = privatizers.DenseNoise(peg.dp.GaussianNoise(), 0.25, noise_source(4)).release(sums, _context(clip=2.0))
    noise = out[0].numpy() * 4.0 - 3.0
    assert abs(noise.std() - 0.5) < 5 * 0.5 / np.sqrt(2 * noise.size)
    assert abs(noise.mean()) < 5 * 0.5 / np.sqrt(noise.size)
    zero = privatizers.DenseNoise(peg.dp.GaussianNoise(), 0.0, noise_source(4)).release(sums, _context(clip=2.0))
    np.testing.assert_array_equal(zero[0].numpy(), np.full([100, 100], 0.75, np.float32))


def test_canary_insertion_adds_every_joining_canary_at_the_clip_norm_and_scores_it():
    """No noise, q = 1: the release is (S + C sum_{j included} u_j) / D; an included canary scores 1, a left-out one 0."""
    variables = [tf.Variable(tf.zeros([3, 4])), tf.Variable(tf.zeros([5]))]
    canaries = audit.GradientCanaries(6, seed=1)

    class Owner:  # what attach reads of an aggregator
        mechanism = peg.dp.GaussianNoise()
        canaries = None

    owner = Owner()
    canaries.attach(owner, variables)
    chain = privatizers.CanaryInsertion(privatizers.DenseNoise(owner.mechanism, 0.0, noise_source(0)), canaries)
    rng = np.random.default_rng(0)
    data = [rng.normal(size=v.shape).astype("float32") for v in variables]
    out = chain.release([tf.constant(d) for d in data], _context(clip=0.5, divisor=2.0))
    flat = np.concatenate([o.numpy().ravel() for o in out])
    expected = (np.concatenate([d.ravel() for d in data]) + 0.5 * canaries.vectors()[canaries.included].sum(0)) / 2.0
    np.testing.assert_allclose(flat, expected, rtol=rounding_rtol(2), atol=EPS32)
    in_scores, out_scores = canaries.scores()
    np.testing.assert_allclose(in_scores, 1.0, atol=1e-6)
    np.testing.assert_allclose(out_scores, 0.0, atol=1e-6)


def test_clip_update_releases_at_the_old_clip_norm_then_moves_it_geometrically():
    """C <- C exp(-eta (b - gamma)), b the fraction of real examples at most C (the count's noise std 1e-6)."""
    clip = tf.Variable(0.7)
    settings = _adaptive(stddev=1e-6)
    dense = privatizers.DenseNoise(peg.dp.GaussianNoise(), 0.0, noise_source(0))
    chain = privatizers.ClipUpdate(dense, settings, clip, noise_source(0))
    norms = tf.constant([0.1, 0.5, 0.9, 2.0, 0.3])
    real = tf.constant([1.0, 1.0, 1.0, 1.0, 0.0])  # the last row is padding: not counted
    sums = [tf.constant([1.0, 2.0])]
    out = chain.release(sums, _context(ClippedSum(sums, norms, real), clip=clip.value(), divisor=4.0))
    np.testing.assert_array_equal(out[0].numpy(), [0.25, 0.5])
    fraction = 2.0 / 4.0  # 0.1 and 0.5 are at most 0.7
    np.testing.assert_allclose(clip.numpy(), 0.7 * np.exp(-0.3 * (fraction - 0.5)), rtol=1e-5)


def test_clip_update_and_sparse_noise_refuse_bare_sums():
    sums = [tf.zeros([2])]
    chain = privatizers.ClipUpdate(
        privatizers.DenseNoise(peg.dp.GaussianNoise(), 1.0, noise_source(0)), _adaptive(), tf.Variable(0.7), None
    )
    with pytest.raises(ValueError, match="adaptive clipping moves its clip norm from the batch's norms"):
        chain.release(sums, _context())
    sparse = privatizers.SparseNoise(_bag_selection(), peg.dp.GaussianNoise(), noise_source(0))
    with pytest.raises(ValueError, match="sparse embedding noise needs the rows each example looked up"):
        sparse.release(sums, _context())


def test_aggregator_releases_through_its_privatizer_and_accounts_by_it():
    """DPAggregator.release is its privatizer's release (bit for bit) plus the ledger's step."""
    model = mlp()
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(8, 6)).astype("float32"), rng.integers(0, 3, 8)
    agg = peg.dp.DPAggregator(l2_norm_clip=0.5, noise_multiplier=1.1, seed=3)
    clipped = agg.clipped_sum(model, sparse_ce, x, y)
    by_hand = agg.privatizer.release(clipped.sums, _context(clipped, clip=0.5, divisor=8.0, step=0))
    released = agg.release(clipped, 8.0, sampling_probability=0.5)
    for a, b in zip(released, by_hand):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(agg.steps.numpy()) == 1
