"""Layer-wise norms and clipped sums stay finite where float32 squares overflow.

With activations of 1e20 the per-example gradients have entries around 1e20:
finite in float32 (up to 3.4e38), but their squared norms (1e40) are not.
The layer-wise engine carries squared norms in float64 where float32's
overflow (``example_ops.widened``), so its norms and clipped sums match the
one-example reference (``tests/helpers.py``: float32 gradients, float64
norms) at the usual float32 rounding tolerances, which are relative and so
hold at any scale (``tests/tolerances.py``). Each case first checks that
float32 squares would overflow, so it cannot pass by not reaching that path.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import (
    assert_norms_close,
    layerwise_clipped_against_loop,
    reference_gradients,
    reference_norms,
    rule_against_loop,
    sparse_ce,
)
from tolerances import EPS64, rounding_rtol

B = 5
HUGE = 1e20  # float32 squares overflow beyond about 1.8e19
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _dense(r):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)])
    return model, r.normal(size=(B, 6)) * HUGE


def _conv_materialized(r):
    # t (f + k) >= f k: the per-example kernels are built (products per offset, patches under XLA).
    model = keras.Sequential(
        [keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3), keras.layers.Flatten(), keras.layers.Dense(3)]
    )
    return model, r.normal(size=(B, 6, 6, 2)) * HUGE


def _conv_gram(r):
    # t (f + k) < f k (4 positions, f = 72, k = 16): the Gram form over positions.
    model = keras.Sequential(
        [keras.Input((4, 4, 8)), keras.layers.Conv2D(16, 3), keras.layers.Flatten(), keras.layers.Dense(3)]
    )
    return model, r.normal(size=(B, 4, 4, 8)) * HUGE


def _embedding_sequence(r):
    # The Dense over the 4 positions takes the Gram form (t (i + j) = 128 < i j = 256).
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(20, 16),
            keras.layers.Dense(16),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )
    table = model.layers[0].embeddings
    table.assign(table.numpy() * HUGE)
    return model, r.integers(0, 20, (B, 4)).astype("int32")


def _layer_norm(r):
    # LayerNormalization's output, scaled by gamma, feeds the last Dense activations of 1e20.
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8),
            keras.layers.LayerNormalization(gamma_initializer=keras.initializers.Constant(HUGE)),
            keras.layers.Dense(3),
        ]
    )
    return model, r.normal(size=(B, 6))


def _einsum_dense(r):
    model = keras.Sequential(
        [
            keras.Input((3, 6)),
            keras.layers.EinsumDense("btd,dk->btk", (3, 5), bias_axes="k"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    return model, r.normal(size=(B, 3, 6)) * HUGE


def _reversible(tie_weights):
    def build(r):
        # The reversed call's input h = e + 1e20 (a Dense's bias): huge activations for the output
        # projection, while the looked-up rows' gradients stay about 1 (the shift passes them through).
        emb = keras.layers.ReversibleEmbedding(11, 4, tie_weights=tie_weights)
        shift = keras.layers.Dense(4, kernel_initializer="identity", bias_initializer=keras.initializers.Constant(HUGE))
        inp = keras.Input((6,), dtype="int32")
        model = keras.Model(inp, emb(shift(emb(inp)), reverse=True))
        x = r.integers(0, 11, (B, 6)).astype("int32")
        x[0, :3] = x[0, 3]  # a repeated id
        return model, x

    return build


CASES = {
    "dense": _dense,
    "conv2d_materialized": _conv_materialized,
    "conv2d_gram": _conv_gram,
    "embedding_sequence": _embedding_sequence,
    "layer_norm": _layer_norm,
    "einsum_dense": _einsum_dense,
    "reversible_tied": _reversible(True),
    "reversible_untied": _reversible(False),
}


def huge_case(name):
    """``(model, x, y)``: labels are each example's least likely class, so the loss gradient is about 1, not 0."""
    r = np.random.default_rng(len(name))
    model, x = CASES[name](r)
    x = x.astype("float32") if x.dtype.kind == "f" else x
    y = np.argmin(model(x).numpy(), axis=-1).astype("int32")
    expected = reference_gradients(model, sparse_ce, x, y)
    assert all(np.isfinite(e).all() for e in expected), "the reference gradients must be finite"
    assert np.max(reference_norms(expected)) ** 2 > FLOAT32_MAX, "float32 squared norms would not overflow"
    return model, x, y


@pytest.mark.parametrize("name", list(CASES))
def test_norms_of_huge_activations_match_the_reference(name):
    model, x, y = huge_case(name)
    rule_against_loop(model, x, y, norms="by_variable")
    expected = rule_against_loop(model, x, y, norms="global")
    # The loop engine's global norms scale by the largest entry: finite too, and the same.
    assert_norms_close(peg.per_example_norms(model, sparse_ce, x, y, method="loop"), expected)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("tf_function", [None, {}], ids=["eager", "graph"])
def test_clipped_sums_of_huge_activations_match_the_reference(name, tf_function):
    model, x, y = huge_case(name)
    with warnings.catch_warnings():  # no example may be left out as non-finite
        warnings.filterwarnings("error", "example\\(s\\) of the batch have a non-finite", RuntimeWarning)
        layerwise_clipped_against_loop(model, x, y, tf_function=tf_function, clip=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense", "conv2d_materialized", "conv2d_gram", "embedding_sequence"])
def test_clipped_sums_of_huge_activations_under_xla(name):
    layerwise_clipped_against_loop(*huge_case(name), tf_function={"jit_compile": True}, clip=1.0)


@pytest.mark.parametrize("tf_function", [None, {}], ids=["eager", "graph"])
def test_only_the_examples_that_overflow_change_and_norms_stay_float32(tf_function):
    """One huge example recomputed in float64 leaves the others' float32 norms as they are, bit for bit."""
    model, x, y = huge_case("dense")
    normal = x / HUGE
    mixed = normal.copy()
    mixed[2] = x[2]
    norms = lambda x: peg.per_example_norms(model, sparse_ce, x, y, method="layerwise")  # noqa: E731
    norms = norms if tf_function is None else tf.function(norms, **tf_function)
    got, want = norms(mixed), norms(normal)
    assert got.dtype == tf.float32
    # The same shapes (so the same kernels) and per-example closed forms: each example's norm is from its own rows.
    others = np.delete(np.arange(B), 2)
    np.testing.assert_array_equal(got.numpy()[others], want.numpy()[others])
    assert np.isfinite(got.numpy()[2]) and float(got.numpy()[2]) ** 2 > FLOAT32_MAX


def test_float64_models_keep_float64_norms():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype="float64")])
    x, y = np.random.default_rng(0).normal(size=(B, 4)), np.arange(B) % 3
    norms = peg.per_example_norms(model, sparse_ce, x, y, method="layerwise", by_variable=True)
    assert all(n.dtype == tf.float64 for n in norms)
    expected = reference_gradients(model, sparse_ce, x, y)
    # A 4-input Dense's gradients and their norms: a few dozen float64 roundings on each side.
    np.testing.assert_allclose(
        [n.numpy() for n in norms], reference_norms(expected, by_variable=True), rtol=rounding_rtol(64, EPS64)
    )
