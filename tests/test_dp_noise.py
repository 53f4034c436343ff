"""The standard normal draws behind every DP step's noise: their distribution, from both kinds of source."""

import math

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from per_example_grads.dp import noise

N = 200_001  # odd: the last Box-Muller pair is cut


def _draws(source, jit=False):
    fn = tf.function(lambda: noise.standard_normal(tf.constant(N), source), jit_compile=jit)
    return fn().numpy()


@pytest.mark.parametrize("kind", ["stateless", "generator", "stateless_xla", "generator_xla"])
def test_standard_normal_draws_are_standard_normal(kind):
    if kind.startswith("generator"):
        z = _draws(tf.random.Generator.from_seed(7), jit=kind.endswith("xla"))
    else:
        z = _draws(noise.stateless_key(7), jit=kind.endswith("xla"))
    assert z.shape == (N,) and z.dtype == np.float32
    # Kolmogorov-Smirnov against N(0, 1): at n = 200,001 a sample from N(0, 1) exceeds
    # D = 1.95 / sqrt(n) with probability 0.001.
    assert stats.kstest(z, "norm").statistic < 1.95 / math.sqrt(N)
    # Mean, variance and the 3-sigma tail within 5 standard errors of their exact values.
    assert abs(z.mean()) < 5 / math.sqrt(N)
    assert abs(z.var() - 1) < 5 * math.sqrt(2 / N)
    p = 2 * stats.norm.sf(3)
    assert abs(np.mean(np.abs(z) > 3) - p) < 5 * math.sqrt(p * (1 - p) / N)


@pytest.mark.parametrize("jit", [False, True])
def test_a_generator_gives_fresh_draws_at_every_call(jit):
    generator = tf.random.Generator.from_seed(3)
    fn = tf.function(lambda: noise.standard_normal(tf.constant(1000), generator), jit_compile=jit)
    first, second = fn().numpy(), fn().numpy()
    assert abs(np.corrcoef(first, second)[0, 1]) < 5 / math.sqrt(1000)


def test_the_cosine_and_sine_halves_are_uncorrelated():
    z = _draws(noise.stateless_key(11))
    half = (N + 1) // 2
    cos_part, sin_part = z[: N - half], z[half:]
    assert abs(np.corrcoef(cos_part, sin_part)[0, 1]) < 5 / math.sqrt(N - half)
    # and each with its square (independence, not only no correlation: r^2 is shared)
    assert abs(np.corrcoef(cos_part**2, sin_part**2)[0, 1]) < 5 / math.sqrt(N - half)


def test_gaussian_like_shapes_dtypes_and_scale():
    tensors = [tf.zeros([300, 200]), tf.zeros([7], tf.float64), tf.zeros([0])]
    out = noise.gaussian_like(tensors, 2.5, seed=3, step=4)
    assert [o.shape for o in out] == [t.shape for t in tensors]
    assert [o.dtype for o in out] == [t.dtype for t in tensors]
    assert abs(np.std(out[0].numpy()) - 2.5) < 5 * 2.5 / math.sqrt(2 * 60_000)
    assert noise.gaussian_like([], 1.0, seed=3) == []


@pytest.mark.parametrize("graph", [False, True])
def test_a_generator_gives_every_tensor_and_every_call_its_own_noise(graph):
    """From a generator, every tensor's noise is independent of the others' and of the next call's (fresh keys)."""
    generator = tf.random.Generator.from_seed(5)
    tensors = [tf.zeros([4000]), tf.zeros([40, 100]), tf.zeros([3999])]
    draw = lambda: noise.gaussian_like(tensors, 2.0, generator)  # noqa: E731
    draw = tf.function(draw) if graph else draw
    first, second = [[z.numpy().ravel() for z in draw()] for _ in range(2)]
    bound = 5 / math.sqrt(3999)
    pairs = [(first[0], first[1]), (first[0], first[2][:4000]), (first[0], second[0]), (first[2], second[2])]
    assert all(abs(np.corrcoef(a[:3999], b[:3999])[0, 1]) < bound for a, b in pairs)
    z = np.concatenate(first)
    assert abs(z.std() - 2.0) < 5 * 2.0 / math.sqrt(2 * z.size)


def test_noise_never_shares_a_key_with_the_batch_sampling_of_the_same_seed_and_step():
    """poisson_batches draws batch t from the uniforms of fold_in(hashed seed, t); the noise of step t uses another key."""
    from per_example_grads.dp import sampling

    n, seed, step = 4000, 0, 3
    sampling_key = tf.random.experimental.stateless_fold_in(sampling._sampling_key(seed), step)
    z = noise.gaussian_like([tf.zeros([n])], 1.0, seed=seed, step=step)[0].numpy()
    # What the noise would be if it were drawn from the sampling key (as a single draw from
    # fold_in(key, t) would): Box-Muller on that key's uniforms.
    u = tf.random.stateless_uniform([2, n // 2], seed=sampling_key).numpy()
    from_sampling_key = np.sqrt(-2 * np.log1p(-u[0])) * np.cos(2 * np.pi * u[1])
    assert not np.allclose(z[: n // 2], from_sampling_key)
    # and unrelated to the uniforms that decide which examples are sampled
    sampling_uniforms = tf.random.stateless_uniform([n], seed=sampling_key, dtype=tf.float64).numpy()
    assert abs(np.corrcoef(z, sampling_uniforms)[0, 1]) < 5 / math.sqrt(n)


def test_tensors_share_draws_in_groups_and_every_coordinate_is_its_own_normal(monkeypatch):
    """Consecutive tensors of one dtype share a flat draw up to MAX_DRAW coordinates; each gets its own part."""
    monkeypatch.setattr(noise, "MAX_DRAW", 4000)
    shapes = [
        ([10, 100], tf.float32),
        ([2000], tf.float32),
        ([10], tf.float64),
        ([1000], tf.float32),
        ([6000], tf.float32),
    ]
    tensors = [tf.zeros(s, d) for s, d in shapes]
    assert noise.draw_groups(tensors) == [[0, 1], [2], [3], [4]]

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def with_unknown(t):  # a tensor of unknown shape is drawn alone
        assert noise.draw_groups([tensors[0], t, tensors[1]]) == [[0], [1], [2]]
        return noise.gaussian_like([tensors[0], t, tensors[1]], 1.0, seed=2, step=0)

    assert [z.shape for z in with_unknown(tf.zeros([300]))] == [(10, 100), (300,), (2000,)]
    first, second = (noise.gaussian_like(tensors, 3.0, seed=2, step=step) for step in (0, 1))
    assert [z.shape for z in first] == [t.shape for t in tensors] and [z.dtype for z in first] == [
        t.dtype for t in tensors
    ]
    a, b = first[0].numpy().ravel(), first[1].numpy()[:1000]  # two parts of one draw
    bound = 5 / math.sqrt(1000)
    assert abs(np.corrcoef(a, b)[0, 1]) < bound
    assert abs(np.corrcoef(a, second[0].numpy().ravel())[0, 1]) < bound  # the next step's noise is fresh
    z = np.concatenate([t.numpy().ravel() for t in first]) / 3.0
    assert stats.kstest(z, "norm").statistic < 1.95 / math.sqrt(z.size)
    assert abs(z.var() - 1) < 5 * math.sqrt(2 / z.size)


@pytest.mark.parametrize("source", ["stateless", "generator"])
@pytest.mark.parametrize("graph", [False, True])
def test_combined_noise_is_the_same_draw_each_group_ordered_after_the_last(monkeypatch, source, graph):
    """``combine`` returns ``combine(t, noise)`` for the very same draws, one group after the other in a graph."""
    monkeypatch.setattr(noise, "MAX_DRAW", 4000)
    tensors = [
        tf.fill([10, 100], 1.0),
        tf.fill([2000], 2.0),
        tf.fill([10], tf.constant(3.0, tf.float64)),
        tf.ones([3000]),
    ]
    seeds = [tf.random.Generator.from_seed(5) if source == "generator" else 5 for _ in range(3)]  # equal sources

    def both():
        plain = noise.gaussian_like(tensors, 2.0, seeds[0], step=3)
        combined = noise.gaussian_like(tensors, 2.0, seeds[1], step=3, combine=lambda t, n: (t + n) / 4)
        return plain, combined

    plain, combined = tf.function(both)() if graph else both()
    for t, n, c in zip(tensors, plain, combined):
        assert c.dtype == t.dtype and c.shape == t.shape
        np.testing.assert_array_equal(c.numpy(), ((t + n) / 4).numpy())
    assert np.std(plain[3].numpy()) > 1.5  # noise, not zeros

    if graph:  # groups [0, 1], [2], [3]: each draw waits for its own tensors and the previous group's results
        fn = tf.function(lambda *ts: noise.gaussian_like(ts, 2.0, seeds[2], step=3, combine=lambda t, n: t + n))
        g = fn.get_concrete_function(*(tf.TensorSpec(t.shape, t.dtype) for t in tensors)).graph
        uniforms = [op for op in g.get_operations() if op.type == "StatelessRandomUniformV2"]
        outputs = [t.op.inputs[0].op for t in g.outputs]  # the results, under the function's Identity
        inputs = [t.op for t in g.inputs[: len(tensors)]]
        assert len(uniforms) == 3
        assert {inputs[0], inputs[1]} <= _ancestors(uniforms[0]) and outputs[2] not in _ancestors(uniforms[0])
        assert {inputs[2], outputs[0], outputs[1]} <= _ancestors(uniforms[1])
        assert {inputs[3], outputs[2]} <= _ancestors(uniforms[2])


def _ancestors(op) -> set:
    """Every op ``op`` waits for, through its inputs and control inputs."""
    seen, stack = set(), [op]
    while stack:
        o = stack.pop()
        for parent in [t.op for t in o.inputs] + list(o.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen
