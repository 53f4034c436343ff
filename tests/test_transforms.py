"""Transforms on materialized gradients, against hand-computed values."""

import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_close
from tolerances import ELEMENTWISE_RTOL, EPS32, norm_rtol, rounding_rtol

P = 17  # entries per example in _grads(): 6 + 6 + 5


def _grads():
    rng = np.random.default_rng(3)
    return [tf.constant(rng.normal(size=(4, 3, 2)) * s, tf.float32) for s in (1.0, 10.0)] + [
        tf.constant(rng.normal(size=(4, 5)), tf.float32)
    ]


def test_norms_by_hand():
    g = _grads()
    flat = np.concatenate([np.reshape(t.numpy(), (4, -1)) for t in g], axis=1)
    # The same entries on both sides; global_norms divides them by the largest and multiplies back (two roundings).
    np.testing.assert_allclose(peg.global_norms(g), np.linalg.norm(flat, axis=1), rtol=norm_rtol(P, rounding_rtol(2)))
    for n, t in zip(peg.per_variable_norms(g), g):
        p = int(np.prod(t.shape[1:]))
        np.testing.assert_allclose(n, np.linalg.norm(np.reshape(t.numpy(), (4, -1)), axis=1), rtol=norm_rtol(p, 0.0))


@pytest.mark.parametrize("clip", [0.5, 5.0, 1e6])
def test_clip_by_global_norm(clip):
    g = _grads()
    clipped, norms = peg.clip_by_global_norm(g, clip)
    after = peg.global_norms(clipped).numpy()
    # Entries scaled by a factor (a few roundings), then their norm taken again in float32.
    assert np.all(after <= clip * (1 + norm_rtol(P, ELEMENTWISE_RTOL)))
    for i, n in enumerate(norms.numpy()):
        factor = min(1.0, clip / n)
        for c, t in zip(clipped, g):
            np.testing.assert_allclose(c[i], t[i].numpy() * factor, rtol=ELEMENTWISE_RTOL)


def test_clip_huge_and_zero_gradients():
    g = [tf.constant([[1e30, 0.0], [0.0, 0.0]], tf.float32)]
    clipped, norms = peg.clip_by_global_norm(g, 1.0)
    np.testing.assert_allclose(clipped[0], [[1.0, 0.0], [0.0, 0.0]], rtol=ELEMENTWISE_RTOL)
    np.testing.assert_array_equal(norms.numpy()[1], 0.0)


def test_norms_of_half_precision_are_float32():
    g = [tf.constant(np.full((2, 300), 300.0), tf.float16)]  # squares overflow float16
    norms = peg.global_norms(g)
    assert norms.dtype == tf.float32
    # 300 is exact in float16 and in float32: only the float32 sum of 300 squares and the root round.
    np.testing.assert_allclose(norms, [300.0 * np.sqrt(300)] * 2, rtol=norm_rtol(300, 0.0))


def test_sum_and_mean():
    g = _grads()
    for s, m, t in zip(peg.sum_examples(g), peg.mean_examples(g), g):
        # Sums of 4 examples in two orders, relative to the sum of their magnitudes; the mean divides once more.
        magnitude = np.abs(t.numpy()).sum(0)
        assert_close(s, t.numpy().sum(0), atol=rounding_rtol(4) * magnitude)
        assert_close(m, t.numpy().mean(0), atol=(rounding_rtol(4) + EPS32) * magnitude / 4)
    empty = [tf.zeros([0, 3])]
    np.testing.assert_array_equal(peg.mean_examples(empty)[0], np.zeros(3))
    np.testing.assert_array_equal(peg.sum_examples(empty)[0], np.zeros(3))


def test_transforms_in_xla():
    g = _grads()
    f = tf.function(lambda *g: peg.clip_by_global_norm(list(g), 1.0), jit_compile=True)
    clipped, _ = f(*g)
    eager, _ = peg.clip_by_global_norm(g, 1.0)
    # XLA may sum the squares in another order: the norm of the same entries (each divided by the largest),
    # then three roundings (times the largest, C / norm, times the factor).
    for a, b in zip(clipped, eager):
        np.testing.assert_allclose(a, b, rtol=norm_rtol(P, rounding_rtol(1)) + rounding_rtol(3))
