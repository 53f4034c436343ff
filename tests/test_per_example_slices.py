"""Sparse per-example embedding gradients (``sparse_embeddings=True``, ``PerExampleSlices``).

References: the one-example-at-a-time loop (``helpers.reference_gradients``)
for what the engine returns, and dense numpy tables built with ``np.add.at``
for the type's own arithmetic.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import per_example_grads as peg
from helpers import assert_close, assert_grads_close, assert_norms_close, reference_gradients, sparse_ce
from per_example_grads.per_example_slices import PerExampleSlices
from tolerances import ELEMENTWISE_RTOL, GRADIENT_RTOL, norm_rtol, rounding_rtol, weighted_sum_rtol

B = 6


def _bag(mask_zero=False, id_shape=(7,)):
    """Embedding (vocabulary 12, dim 3) -> pooling -> Dense; ids with repeats and zeros."""
    rng = np.random.default_rng(3)
    inp = keras.Input(id_shape, dtype="int32")
    h = keras.layers.Embedding(12, 3, mask_zero=mask_zero)(inp)
    if len(id_shape) > 1:
        h = keras.layers.Reshape((-1, 3))(h)
    model = keras.Model(inp, keras.layers.Dense(4)(keras.layers.GlobalAveragePooling1D()(h)))
    x = rng.integers(0, 12, (B, *id_shape)).astype("int32")
    x.reshape(B, -1)[:, :3] = 5  # a group of three in every example
    x.reshape(B, -1)[0, -2:] = 0  # padding, when mask_zero
    return model, x, rng.integers(0, 4, B).astype("int32")


def _shared_table():
    """One table looked up twice (tied embeddings): each example's two sets of rows add up."""
    rng = np.random.default_rng(4)
    inp = keras.Input((5,), dtype="int32")
    emb = keras.layers.Embedding(9, 4)
    h = keras.layers.GlobalAveragePooling1D()(emb(inp) * emb(inp[:, ::-1]))
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    return model, rng.integers(0, 9, (B, 5)).astype("int32"), rng.integers(0, 3, B).astype("int32")


CASES = {
    "bag": _bag,
    "bag_mask_zero": lambda: _bag(mask_zero=True),
    "ids_of_rank_3": lambda: _bag(id_shape=(2, 4)),
    "shared_table": _shared_table,
}


def _is_table(v) -> bool:
    return "embedding" in v.path


@pytest.mark.parametrize("in_function", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_sparse_embeddings_equal_the_loop_and_hold_no_vocabulary_sized_tensor(name, in_function):
    model, x, y = CASES[name]()
    fn = lambda x, y: peg.per_example_gradients(model, sparse_ce, x, y, sparse_embeddings=True)  # noqa: E731
    got = (tf.function(fn) if in_function else fn)(x, y)
    expected = reference_gradients(model, sparse_ce, x, y)
    t = x[0].size * (2 if name == "shared_table" else 1)  # rows per example
    for g, v in zip(got, model.trainable_variables):
        if _is_table(v):
            assert isinstance(g, PerExampleSlices)
            assert g.shape == (B, *v.shape)
            assert g.values.shape == (B, t, v.shape[1]) and g.indices.shape == (B, t)
        else:
            assert isinstance(g, tf.Tensor)
    assert_grads_close([tf.convert_to_tensor(g) for g in got], expected)
    assert_grads_close([np.asarray(g) for g in got], expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_transforms_use_the_rows_and_agree_with_dense_gradients(name):
    model, x, y = CASES[name]()
    sparse = peg.per_example_gradients(model, sparse_ce, x, y, sparse_embeddings=True)
    dense = reference_gradients(model, sparse_ce, x, y)
    p = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    assert_norms_close(peg.global_norms(sparse), dense)
    assert_norms_close(peg.per_variable_norms(sparse), dense, by_variable=True)
    clipped, norms = peg.clip_by_global_norm(sparse, 0.01)
    want, _ = peg.clip_by_global_norm(dense, 0.01)
    assert any(isinstance(c, PerExampleSlices) for c in clipped)
    # The factors come from norms that agree to norm_rtol(p), one division and one product more.
    assert_grads_close(
        [tf.convert_to_tensor(c) for c in clipped],
        [w.numpy() for w in want],
        rtol=GRADIENT_RTOL + norm_rtol(p) + rounding_rtol(2),
    )
    # Entries scaled by a factor (a few roundings), then their norm taken again in float32.
    assert np.all(peg.global_norms(clipped).numpy() <= 0.01 * (1 + norm_rtol(p, ELEMENTWISE_RTOL)))
    rtol = weighted_sum_rtol(B, GRADIENT_RTOL)  # a sum (or mean: one division more) over B examples
    scale = max(float(np.max(np.sum(np.abs(e), axis=0))) for e in dense)
    for reduce in (peg.sum_examples, peg.mean_examples):
        divisor = B if reduce is peg.mean_examples else 1
        for got, v, w in zip(reduce(sparse), model.trainable_variables, reduce(dense)):
            assert isinstance(got, tf.IndexedSlices) == _is_table(v)
            np.testing.assert_allclose(tf.convert_to_tensor(got), w, rtol=rtol, atol=rtol * scale / divisor)


@pytest.mark.slow
def test_transforms_on_rows_compile_under_xla():
    model, x, y = _bag(mask_zero=True)
    dense = reference_gradients(model, sparse_ce, x, y)

    @tf.function(jit_compile=True)
    def clip(x, y):
        grads = peg.per_example_gradients(model, sparse_ce, x, y, sparse_embeddings=True)
        clipped, norms = peg.clip_by_global_norm(grads, 0.01)
        return [tf.convert_to_tensor(g) for g in peg.sum_examples(clipped)], norms

    sums, norms = clip(x, y)
    assert_norms_close(norms, dense)
    want, _ = peg.clip_by_global_norm(dense, 0.01)
    # Clipped as in test_transforms_use_the_rows_and_agree_with_dense_gradients, then summed over B examples.
    p = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    rtol = weighted_sum_rtol(B, GRADIENT_RTOL + norm_rtol(p) + rounding_rtol(2))
    scale = max(float(np.max(np.sum(np.abs(w.numpy()), axis=0))) for w in want)
    for s, w in zip(sums, peg.sum_examples(want)):
        np.testing.assert_allclose(s, w, rtol=rtol, atol=rtol * scale)


def test_empty_batch_and_models_without_tables():
    model, x, y = _bag()
    empty = peg.per_example_gradients(model, sparse_ce, x[:0], y[:0], sparse_embeddings=True)
    for g, v in zip(empty, model.trainable_variables):
        assert tuple(g.shape) == (0, *v.shape)
        assert np.asarray(g).shape == (0, *v.shape)
    dense_model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    xs, ys = np.ones((4, 3), "float32"), np.array([0, 1, 1, 0])
    got = peg.per_example_gradients(dense_model, sparse_ce, xs, ys, sparse_embeddings=True)
    assert_grads_close(got, reference_gradients(dense_model, sparse_ce, xs, ys))


def test_sparse_embeddings_need_the_layerwise_engine():
    model, x, y = _bag()
    with pytest.raises(ValueError, match="sparse_embeddings=True needs method='layerwise'.*'vectorized'"):
        peg.per_example_gradients(model, sparse_ce, x, y, sparse_embeddings=True, method="vectorized")

    class Free(keras.layers.Layer):  # a weight outside any layer the engine can watch
        def build(self, shape):
            self.w = self.add_weight(shape=(), initializer="ones")

        def call(self, h):
            return h * self.w

    free = Free()
    free.build(())
    f = lambda h: model(h) * free.w  # noqa: E731  (a plain callable: variables= and no layer structure)
    with pytest.raises(ValueError, match="sparse_embeddings=True needs method='layerwise'"):
        peg.per_example_gradients(f, sparse_ce, x, y, variables=[free.w], sparse_embeddings=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.integers(0, 4), t=st.integers(1, 9), vocabulary=st.integers(1, 6), row=st.integers(1, 3), data=st.data())
def test_rows_against_dense_numpy_tables(b, t, vocabulary, row, data):
    """to_dense, squared norms, scale, concat and sum_examples against tables built with np.add.at."""
    ids = np.array(
        data.draw(st.lists(st.integers(0, vocabulary - 1), min_size=b * t, max_size=b * t)), "int32"
    ).reshape(b, t)
    rng = np.random.default_rng(b * 100 + t)
    values = rng.normal(size=(b, t, row)).astype("float32")
    factors = rng.uniform(0.1, 2.0, b).astype("float32")
    s = PerExampleSlices(tf.constant(ids), tf.constant(values), tf.TensorShape([vocabulary, row]))
    tables = np.zeros((b, vocabulary, row), "float32")
    magnitudes = np.zeros((b, vocabulary, row))  # sum of |rows| per id: the terms of each table entry
    for n in range(b):
        np.add.at(tables[n], ids[n], values[n])
        np.add.at(magnitudes[n], ids[n], np.abs(values[n]))
    # A table entry is a sum of at most t rows (2 t for concat, b t over examples), in two orders,
    # relative to its terms' magnitudes; scaling adds a product. A square doubles the error: 2 |S| M.
    assert_close(s.to_dense(), tables, atol=rounding_rtol(t) * magnitudes)
    assert_close(
        s.squared_norms(),
        np.sum(tables**2, axis=(1, 2)),
        rtol=rounding_rtol(row * t),
        atol=2 * rounding_rtol(t) * np.sum(np.abs(tables) * magnitudes, axis=(1, 2)),
    )
    scaled = factors[:, None, None].astype(np.float64)
    assert_close(s.scale(factors).to_dense(), tables * scaled, atol=rounding_rtol(t + 1) * magnitudes * scaled)
    assert_close(s.concat(s).to_dense(), 2 * tables, atol=rounding_rtol(2 * t) * 2 * magnitudes)
    assert_close(
        tf.convert_to_tensor(s.sum_examples()), tables.sum(axis=0), atol=rounding_rtol(b * t) * magnitudes.sum(axis=0)
    )
