"""Batch sizes 0 and 1, NaN isolation, tracing, XLA, batch coupling, fallbacks."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_close, assert_grads_close, assert_norms_close, reference_gradients, sparse_ce
from model_zoo import ZOO
from tolerances import ELEMENTWISE_RTOL

ISOLATING = ["layerwise", "vectorized", "weight_copies", "loop", "auto"]


@pytest.mark.parametrize("method", ISOLATING + ["jacobian"])
def test_batch_of_zero_gives_empty_gradients(method):
    case = ZOO["cnn1d"]()
    grads = peg.per_example_gradients(case.model, sparse_ce, case.x[:0], case.y[:0], method=method)
    for g, v in zip(grads, case.model.trainable_variables):
        assert tuple(g.shape) == (0, *v.shape)


@pytest.mark.parametrize("method", ISOLATING + ["jacobian"])
def test_batch_of_zero_inside_tf_function(method):
    case = ZOO["mlp"]()
    f = tf.function(
        lambda x, y: peg.per_example_gradients(case.model, sparse_ce, x, y, method=method),
        input_signature=[tf.TensorSpec([None, 6]), tf.TensorSpec([None], tf.int32)],
    )
    for g, v in zip(f(case.x[:0], case.y[:0]), case.model.trainable_variables):
        assert tuple(g.shape) == (0, *v.shape)


class _RefusesEmptyBatches(keras.Model):
    """Counts the times it runs, and fails when it runs on zero rows.

    On some CPUs TensorFlow's oneDNN kernels reject empty batches (a causal
    Conv1D: "Must provide as many biases as the last dimension of the input
    tensor: [4] vs. [0,14,3]") while on others they pass, so the library must
    never run the model on B = 0. Tracing it is fine; running it is not.
    """

    def __init__(self):
        super().__init__(name="refuses_empty_batches")
        self.hidden = keras.layers.Dense(4, activation="tanh")
        self.head = keras.layers.Dense(3)
        self.runs = tf.Variable(0, trainable=False, name="runs")

    def call(self, x, training=False):
        counted = self.runs.assign_add(1)
        rows = tf.debugging.assert_positive(tf.shape(x)[0], message="the model ran on an empty batch")
        with tf.control_dependencies([counted, rows]):
            return self.head(self.hidden(tf.identity(x)))


def _entry_points(model, method):
    """``(name, fn(x, y), expected shapes for B rows)`` for every public entry point."""
    variables = model.trainable_variables
    per_example = [lambda b, v=v: (b, *v.shape) for v in variables]
    sums = [lambda b, v=v: tuple(v.shape) for v in variables]
    return [
        (
            "per_example_gradients",
            lambda x, y: peg.per_example_gradients(model, sparse_ce, x, y, method=method),
            per_example,
        ),
        (
            "per_example_norms",
            lambda x, y: [peg.per_example_norms(model, sparse_ce, x, y, method=method)],
            [lambda b: (b,)],
        ),
        (
            "per_example_norms(by_variable)",
            lambda x, y: peg.per_example_norms(model, sparse_ce, x, y, method=method, by_variable=True),
            [lambda b: (b,)] * len(variables),
        ),
        (
            "clipped_gradients",
            lambda x, y: (lambda s, n: [*s, n])(
                *peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=1.0, method=method, return_norms=True)
            ),
            sums + [lambda b: (b,)],
        ),
        (
            "clipped_gradients(mean, per layer)",
            lambda x, y: peg.clipped_gradients(
                model, sparse_ce, x, y, l2_norm_clip=[1.0] * len(variables), method=method, reduction="mean"
            ),
            sums,
        ),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["auto", "jacobian", "loop"])  # vectorized_map cannot vectorize the counter
def test_batch_of_zero_never_runs_the_model(method):
    model = _RefusesEmptyBatches()
    x, y = np.random.randn(3, 6).astype("float32"), np.array([0, 1, 2], "int32")
    model(x)
    unknown_b = [tf.TensorSpec([None, 6]), tf.TensorSpec([None], tf.int32)]
    for name, fn, shapes in _entry_points(model, method):
        eager, in_graph = fn, tf.function(fn, input_signature=unknown_b)
        for where, f in [("eagerly", eager), ("in tf.function with unknown B", in_graph)]:
            for n in (0, 3):  # 3 rows run the model, which proves it is watched
                before = int(model.runs.numpy())
                got = f(x[:n], y[:n])
                assert [tuple(t.shape) for t in got] == [s(n) for s in shapes], (name, where, n)
                if n == 0:
                    assert int(model.runs.numpy()) == before, f"{name} ran the model on B = 0 {where}"
                    assert all(np.all(np.asarray(t) == 0) for t in got), (name, where)
                else:
                    assert int(model.runs.numpy()) > before, (name, where)
    # The model does refuse empty batches, so the test above can see a violation.
    with pytest.raises(tf.errors.InvalidArgumentError, match="empty batch"):
        model(x[:0])


@pytest.mark.parametrize("method", ISOLATING + ["jacobian"])
def test_batch_of_one(method):
    case = ZOO["cnn2d"]()
    expected = reference_gradients(case.model, sparse_ce, case.x[:1], case.y[:1])
    assert_grads_close(
        peg.per_example_gradients(case.model, sparse_ce, case.x[:1], case.y[:1], method=method), expected
    )


@pytest.mark.parametrize("method", ISOLATING)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_example_does_not_leak(method, bad):
    case = ZOO["cnn2d"]()
    x = case.x.copy()
    x[2, 0, 0, 0] = bad
    grads = peg.per_example_gradients(case.model, sparse_ce, x, case.y, method=method)
    clean = [0, 1, 3, 4]
    expected = reference_gradients(case.model, sparse_ce, x[clean], case.y[clean])
    assert_grads_close([np.asarray(g)[clean] for g in grads], expected)
    assert not all(np.all(np.isfinite(np.asarray(g)[2])) for g in grads)


@pytest.mark.parametrize("method", ISOLATING + ["jacobian"])
def test_changing_batch_size_does_not_retrace(method):
    case = ZOO["mlp"]()
    f = tf.function(
        lambda x, y: peg.per_example_gradients(case.model, sparse_ce, x, y, method=method),
        reduce_retracing=True,
    )
    f(case.x[:2], case.y[:2])  # first trace, static shapes
    f(case.x[:3], case.y[:3])  # relaxed to an unknown batch dimension
    traces = f.experimental_get_tracing_count()
    for n in (4, 5, 1):
        got = f(case.x[:n], case.y[:n])
        assert_grads_close(got, reference_gradients(case.model, sparse_ce, case.x[:n], case.y[:n]))
    assert f.experimental_get_tracing_count() == traces


@pytest.mark.parametrize("method", ["layerwise", "vectorized", "jacobian", "weight_copies", "loop"])
def test_jit_compile(method):
    case = ZOO["mlp"]()
    f = tf.function(
        lambda x, y: peg.per_example_gradients(case.model, sparse_ce, x, y, method=method),
        jit_compile=True,
    )
    assert_grads_close(f(case.x, case.y), reference_gradients(case.model, sparse_ce, case.x, case.y))


def _bn_model():
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(5), keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(3)]
    )


def test_batchnorm_in_training_mode_is_refused():
    model = _bn_model()
    x, y = np.random.randn(4, 4).astype("float32"), np.array([0, 1, 2, 0])
    with pytest.raises(ValueError, match=r"'bn' \(BatchNormalization\).*GroupNormalization"):
        peg.per_example_gradients(model, sparse_ce, x, y, training=True)


def test_batchnorm_opt_in_and_inference_mode():
    model = _bn_model()
    x, y = np.random.randn(4, 4).astype("float32"), np.array([0, 1, 2, 0])
    assert_grads_close(
        peg.per_example_gradients(model, sparse_ce, x, y, training=False),
        reference_gradients(model, sparse_ce, x, y, training=False),
    )
    # Opted in, each example is normalized with its own statistics: the
    # reference loop (batches of one) does exactly that.
    assert_grads_close(
        peg.per_example_gradients(model, sparse_ce, x, y, training=True, allow_batch_coupling=True, method="loop"),
        reference_gradients(model, sparse_ce, x, y, training=True),
    )


def test_dropout_in_training_mode_runs_and_weight_copies_refuses():
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dropout(0.5, name="drop"), keras.layers.Dense(3)]
    )
    x, y = np.random.randn(5, 6).astype("float32"), np.arange(5) % 3
    for method in ["vectorized", "loop", "auto"]:
        grads = peg.per_example_gradients(model, sparse_ce, x, y, training=True, method=method)
        assert all(np.all(np.isfinite(g)) for g in grads)
    with pytest.raises(ValueError, match=r"weight_copies.*'drop' \(Dropout\)"):
        peg.per_example_gradients(model, sparse_ce, x, y, training=True, method="weight_copies")


class _MaskedRnnWithOwnWeight(keras.Model):
    """Layer-wise cannot cover it (own weight) and tf.vectorized_map cannot convert it."""

    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(15, 4, mask_zero=True)
        self.rnn = keras.layers.LSTM(5)
        self.head = keras.layers.Dense(3)
        self.temperature = self.add_weight(shape=(), initializer="ones", name="temperature")

    def call(self, x, training=False):
        return self.head(self.rnn(self.embed(x))) * self.temperature


@pytest.mark.slow
def test_auto_falls_back_and_warns_once_with_engine_and_reasons():
    model = _MaskedRnnWithOwnWeight()
    x = np.array([[1, 2, 0, 0], [3, 4, 5, 0], [2, 0, 0, 0]], "int32")
    y = np.array([0, 1, 2])
    model(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = peg.per_example_gradients(model, sparse_ce, x, y)
        peg.per_example_gradients(model, sparse_ce, x, y)
    fallback = [w for w in caught if issubclass(w.category, peg.EngineFallbackWarning)]
    assert len(fallback) == 1
    message = str(fallback[0].message)
    assert "used the 'weight_copies' engine" in message
    assert "not 'layerwise' because" in message and "owns variables itself" in message
    assert "not 'vectorized' because it raised TypeError" in message
    assert_grads_close(grads, reference_gradients(model, sparse_ce, x, y))


def test_plain_callable_with_variables():
    w = tf.Variable([[1.0, -2.0], [0.5, 3.0]])
    b = tf.Variable([0.1, -0.1])
    forward = lambda x: tf.matmul(x, w) + b
    x = np.array([[1.0, 2.0], [3.0, -1.0], [0.0, 1.0]], "float32")
    y = np.zeros((3, 2), "float32")
    mse = lambda yt, yp: tf.reduce_sum(tf.square(yp - yt), axis=-1)
    for method in ["vectorized", "jacobian", "loop"]:
        gw, gb = peg.per_example_gradients(forward, mse, x, y, variables=[w, b], method=method)
        # Closed form: d/dW ||xW + b||^2 = 2 x^T (xW + b), per example: a few roundings on each side,
        # relative to the terms of the residual (|x| |W| + |b|), which may cancel.
        resid = x @ w.numpy() + b.numpy()
        terms = np.abs(x) @ np.abs(w.numpy()) + np.abs(b.numpy())
        assert_close(
            gw,
            2 * x[:, :, None] * resid[:, None, :],
            atol=ELEMENTWISE_RTOL * 2 * np.abs(x)[:, :, None] * terms[:, None, :],
        )
        assert_close(gb, 2 * resid, atol=ELEMENTWISE_RTOL * 2 * terms)
    with pytest.raises(ValueError, match="not keras.Variable"):
        peg.per_example_gradients(forward, mse, x, y, variables=[w, b], method="weight_copies")


def test_per_example_norms_match_materialized():
    case = ZOO["cnn2d"]()
    ref = reference_gradients(case.model, sparse_ce, case.x, case.y)
    assert_norms_close(peg.per_example_norms(case.model, sparse_ce, case.x, case.y), ref)
    assert_norms_close(
        peg.per_example_norms(case.model, sparse_ce, case.x, case.y, by_variable=True), ref, by_variable=True
    )
