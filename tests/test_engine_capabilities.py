"""The engine capabilities the diagnostics use (``Engine.moments``, ``Engine.features``), ``sparse_compute`` and
``slow_layers``: every registered engine against the materialized one-example-at-a-time computation."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from helpers import assert_close, assert_norms_close, gradient_scale, reference_gradients, sparse_ce  # noqa: E402
from per_example_grads._core.batch import make_batch  # noqa: E402
from per_example_grads._core.problem import make_problem  # noqa: E402
from per_example_grads.engines import ENGINES  # noqa: E402
from tolerances import EPS32, GRADIENT_RTOL, rounding_rtol  # noqa: E402

B = 4
SLOWER = {"jacobian", "vectorized"}  # over a second each here (tracing)


def _engines():
    return [pytest.param(n, marks=[pytest.mark.slow] if n in SLOWER else []) for n in sorted(ENGINES)]


def _conv_and_dense(seed=0):
    """A Conv1D (no outer factors: the layer-wise engine materializes it) and Dense layers on rank-2 inputs (factors)."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((6, 3)),
            keras.layers.Conv1D(4, 3),
            keras.layers.Flatten(),
            keras.layers.Dense(5, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )
    r = np.random.default_rng(seed)
    return model, r.normal(size=(B, 6, 3)).astype("float32"), r.integers(0, 3, B).astype("int32")


def _dense_only(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    r = np.random.default_rng(seed)
    return model, r.normal(size=(B, 4)).astype("float32"), r.integers(0, 3, B).astype("int32")


def _flat(grads):
    return np.concatenate([np.reshape(g, (len(g), -1)).astype(np.float64) for g in grads], axis=1)


@pytest.mark.parametrize("method", _engines())
def test_moments_of_every_engine_match_the_materialized_ones(method):
    model, x, y = _conv_and_dense()
    problem = make_problem(model, sparse_ce, None, False, False)
    r = np.random.default_rng(1)
    reference = [r.normal(size=v.shape) for v in problem.variables]
    got = ENGINES[method].moments(problem, make_batch(model, x, y), [tf.constant(t, tf.float64) for t in reference])
    expected = reference_gradients(model, sparse_ce, x, y)
    scale = gradient_scale(expected)
    sum_rtol = GRADIENT_RTOL + rounding_rtol(B)  # a sum of B entries, each within GRADIENT_RTOL (float64 sums)
    for k, e in enumerate(expected):
        e = e.astype(np.float64)
        assert got["sum"][k].dtype == tf.float64 and got["sumsq"][k].dtype == tf.float64
        terms = np.sum(np.abs(e), axis=0) + GRADIENT_RTOL * scale * B
        assert_close(got["sum"][k], e.sum(0), atol=sum_rtol * terms, err_msg=f"sum {k}")
        # (g (1 + d))^2 = g^2 (1 + 2d): squares double the entries' relative error; an exact zero's is (GRADIENT_RTOL scale)^2.
        assert_close(
            got["sumsq"][k],
            np.square(e).sum(0),
            rtol=2 * sum_rtol,
            atol=B * (GRADIENT_RTOL * scale) ** 2 * 3,
            err_msg=f"sumsq {k}",
        )
    assert got["sqnorms"].shape == (len(expected), B)
    assert_norms_close(list(np.sqrt(got["sqnorms"].numpy())), expected, by_variable=True)
    flat, ref = _flat(expected), np.concatenate([t.ravel() for t in reference])
    dots_atol = (GRADIENT_RTOL + rounding_rtol(flat.shape[1])) * (
        np.abs(flat) @ np.abs(ref) + GRADIENT_RTOL * scale * np.abs(ref).sum()
    )
    assert_close(got["dots"], flat @ ref, atol=dots_atol, err_msg="dots")


@pytest.mark.parametrize("build", [_conv_and_dense, _dense_only])
@pytest.mark.parametrize("method", _engines())
def test_features_of_every_engine_give_the_materialized_dot_products(method, build):
    model, xa, ya = build(0)
    _, xb, yb = build(1)
    problem = make_problem(model, sparse_ce, None, False, False)
    engine = ENGINES[method]
    fa = engine.features(problem, make_batch(model, xa, ya))
    fb = engine.features(problem, make_batch(model, xb, yb))
    if method == "layerwise":
        assert fa.factored == (build is _dense_only)  # factors only where every layer gives them
    else:
        assert not fa.factored
    ga, gb = reference_gradients(model, sparse_ce, xa, ya), reference_gradients(model, sparse_ce, xb, yb)
    a, b = _flat(ga), _flat(gb)
    scale = max(gradient_scale(ga), gradient_scale(gb))
    err = GRADIENT_RTOL * scale
    # Each product of two entries within GRADIENT_RTOL (or GRADIENT_RTOL scale for exact zeros), summed over P.
    atol = (2 * GRADIENT_RTOL + rounding_rtol(a.shape[1]) + EPS32) * (np.abs(a) @ np.abs(b).T) + err * (
        np.abs(a).sum(1)[:, None] + np.abs(b).sum(1)[None, :] + err * a.shape[1]
    )
    assert_close(fa.dots(fb), a @ b.T, atol=atol, err_msg="dots")
    assert_norms_close(np.sqrt(fa.squared_norms().numpy()), ga)


def test_only_the_layerwise_engine_has_sparse_gradients_and_they_are_the_dense_ones():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(7, 2),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )
    r = np.random.default_rng(0)
    x, y = r.integers(0, 7, (B, 3)).astype("int32"), r.integers(0, 3, B).astype("int32")
    problem = make_problem(model, sparse_ce, None, False, False)
    assert [n for n, e in ENGINES.items() if e.supports_sparse] == ["layerwise"]
    got = ENGINES["layerwise"].sparse_compute(problem, make_batch(model, x, y))
    assert type(got[0]).__name__ == "PerExampleSlices"
    expected = reference_gradients(model, sparse_ce, x, y)
    for k, (g, e) in enumerate(zip(got, expected)):
        assert_close(
            tf.convert_to_tensor(g),
            e,
            rtol=GRADIENT_RTOL,
            atol=GRADIENT_RTOL * gradient_scale(expected),
            err_msg=f"variable {k}",
        )
    with pytest.raises(NotImplementedError, match="'loop' engine has no sparse"):
        ENGINES["loop"].sparse_compute(problem, make_batch(model, x, y))


def test_slow_layers_are_the_layerwise_engines_layer_local_ones():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.PReLU(name="prelu"), keras.layers.Dense(2)]
    )
    problem = make_problem(model, sparse_ce, None, False, False)
    assert [layer.name for layer in ENGINES["layerwise"].slow_layers(problem)] == ["prelu"]
    assert all(not ENGINES[n].slow_layers(problem) for n in ENGINES if n != "layerwise")
