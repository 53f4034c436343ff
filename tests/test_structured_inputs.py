"""Multi-input models given their inputs as dicts, lists and nested structures of arrays, at every (x, y) entry point.

One small functional model takes two inputs ``a`` ``[N, 3]`` and ``b``
``[N, 4, 2]`` (and, nested, a third ``c`` ``[N, 2]`` beside ``b`` in a
tuple); its ``x`` is a dict (the input of every KerasHub model), a list or
a dict holding a tuple. Every entry point that takes ``(x, y)`` arrays
(slicing them into batches or not) must give what the one-example
``GradientTape`` loop gives, or what the same data gives as a batched
``tf.data.Dataset``; leaves that disagree on the number of rows are refused
up front, naming the leaf.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import (
    assert_clipped_sums_close,
    assert_close,
    assert_grads_close,
    assert_norms_close,
    gradient_scale,
    reference_gradients,
    reference_norms,
    sparse_ce,
)
from tolerances import (
    EPS32,
    EPS64,
    GRADIENT_RTOL,
    clipped_sum_rtol,
    cosine_atol,
    mean_atol,
    rounding_rtol,
    sgd_steps_atol,
    variance_atol,
)

N = 6  # examples; batches of BATCH leave a shorter last batch
BATCH = 4
STRUCTURES = ["dict", "list", "nested"]


def _model_and_data(structure: str, seed: int = 0):
    """``(model, x, y)``: the two- (or three-) input model and ``N`` examples in ``structure``."""
    keras.utils.set_random_seed(seed)
    a, b, c = keras.Input((3,), name="a"), keras.Input((4, 2), name="b"), keras.Input((2,), name="c")
    parts = [keras.layers.Dense(4, activation="tanh", name="dense_a")(a), keras.layers.Flatten()(b)]
    if structure == "nested":
        parts.append(c)
    logits = keras.layers.Dense(3, name="head")(keras.layers.Concatenate()(parts))
    rng = np.random.default_rng(seed + 1)
    xa = rng.normal(size=(N, 3)).astype("float32")
    xb = rng.normal(size=(N, 4, 2)).astype("float32")
    xc = rng.normal(size=(N, 2)).astype("float32")
    y = rng.integers(0, 3, N).astype("int32")
    if structure == "dict":
        return keras.Model({"a": a, "b": b}, logits), {"a": xa, "b": xb}, y
    if structure == "list":
        return keras.Model([a, b], logits), [xa, xb], y
    return keras.Model({"a": a, "pair": (b, c)}, logits), {"a": xa, "pair": (xb, xc)}, y


def _rows(x, start, stop):
    return tf.nest.map_structure(lambda t: t[start:stop], x)


def _dataset(x, y, batch_size=BATCH):
    """The same examples as a batched ``tf.data.Dataset`` (tf.data reads a list as one tensor: a tuple keeps it apart)."""
    return tf.data.Dataset.from_tensor_slices((tuple(x) if isinstance(x, list) else x, y)).batch(batch_size)


# The models here are smaller than tests/tolerances.py's GRADIENT_PATH model: per-example gradients and
# everything derived from them agree with the loop to GRADIENT_RTOL of the terms' scale.


@pytest.mark.parametrize("structure", STRUCTURES)
def test_per_example_gradients_norms_and_clipped_sums_match_the_loop(structure):
    model, x, y = _model_and_data(structure)
    expected = reference_gradients(model, sparse_ce, x, y)
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y), expected)
    assert_norms_close(peg.per_example_norms(model, sparse_ce, x, y), expected)
    norms = reference_norms(expected)
    clip = float(np.median(norms))  # some examples clipped, some not
    factors = clip / np.maximum(norms, clip)
    assert_clipped_sums_close(peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip), expected, factors)
    mean = peg.compute_gradients(model, sparse_ce, x, y)
    assert_clipped_sums_close([g for g, _ in mean], expected, np.ones(N), divisor=N)


@pytest.mark.slow  # traces the DP aggregator's step
@pytest.mark.parametrize("structure", ["dict", "list"])
def test_gradient_accumulator_over_micro_batches_matches_the_loop(structure):
    model, x, y = _model_and_data(structure)
    expected = reference_gradients(model, sparse_ce, x, y)
    norms = reference_norms(expected)
    clip = float(np.median(norms))
    acc = peg.GradientAccumulator(model, sparse_ce, l2_norm_clip=clip, noise_multiplier=0.0, expected_batch_size=N)
    for start in range(0, N, BATCH):
        acc.accumulate(_rows(x, start, start + BATCH), y[start : start + BATCH])
    assert_clipped_sums_close(acc.result(), expected, clip / np.maximum(norms, clip), divisor=N)


def _assert_report_matches(report, expected):
    """A GradientReport of the ``N`` examples against the loop's per-example gradients ``expected``.

    Each entry of the library's float32 gradients is within ``err = GRADIENT_RTOL * scale``
    of the loop's; the statistics are float64 functions of them, bounded by tests/tolerances.py.
    """
    flat = np.concatenate([e.reshape(N, -1) for e in expected], axis=1).astype(np.float64)
    err = GRADIENT_RTOL * gradient_scale(expected)
    f64 = rounding_rtol(N, EPS64)
    assert report.num_examples == N
    assert_close(np.concatenate([m.ravel() for m in report.mean]), flat.mean(0), rtol=f64, atol=mean_atol(flat, err))
    assert_close(
        np.concatenate([v.ravel() for v in report.variance]),
        flat.var(0, ddof=1),
        rtol=f64,
        atol=variance_atol(flat, err),
    )
    assert_norms_close(report.per_example_norms, expected)
    if report.cosines is not None:
        cos = flat @ flat.mean(0) / (np.linalg.norm(flat, axis=1) * np.linalg.norm(flat.mean(0)))
        assert_close(report.cosines, cos, atol=cosine_atol(flat, err, flat.mean(0), mean_atol(flat, err)))


@pytest.mark.parametrize(
    "structure", ["dict", pytest.param("list", marks=pytest.mark.slow), pytest.param("nested", marks=pytest.mark.slow)]
)  # two streams, two passes each
def test_gradient_statistics_on_arrays_equal_the_dataset_and_the_loop(structure):
    model, x, y = _model_and_data(structure)
    expected = reference_gradients(model, sparse_ce, x, y)
    arrays = peg.diagnostics.gradient_statistics(model, sparse_ce, (x, y), batch_size=BATCH, progress=False)
    dataset = peg.diagnostics.gradient_statistics(model, sparse_ce, _dataset(x, y), progress=False)
    for report in (arrays, dataset):
        assert report.batch_sizes == [4, 2]
        _assert_report_matches(report, expected)


@pytest.mark.slow  # two streams
def test_statistics_callback_on_dict_arrays_equals_the_dataset(tmp_path):
    model, x, y = _model_and_data("dict")
    expected = reference_gradients(model, sparse_ce, x, y)
    for i, data in enumerate([(x, y), _dataset(x, y)]):
        callback = peg.diagnostics.GradientStatisticsCallback(
            data, log_dir=str(tmp_path / str(i)), loss_fn=sparse_ce, batch_size=BATCH
        )
        callback.set_model(model)
        report = callback.compute_and_log(1)
        assert report.batch_sizes == [4, 2]
        _assert_report_matches(report, expected)


@pytest.mark.parametrize("structure", ["dict", "nested"])
def test_similarity_and_tracin_on_structures_match_the_loop(structure):
    model, x, y = _model_and_data(structure)
    expected = reference_gradients(model, sparse_ce, x, y)
    flat = np.concatenate([e.reshape(N, -1) for e in expected], axis=1).astype(np.float64)
    dots = flat[:2] @ flat[2:].T
    p = flat.shape[1]
    atol = (
        (GRADIENT_RTOL * 2 + rounding_rtol(p)) * np.abs(flat[:2]) @ np.abs(flat[2:]).T
    )  # two inexact factors, one sum
    got = peg.diagnostics.gradient_similarity(model, sparse_ce, _rows(x, 0, 2), y[:2], _rows(x, 2, N), y[2:])
    np.testing.assert_array_less(np.abs(got.numpy() - dots), atol + 1e-300)
    # TracIn over blocks of BATCH rows (sliced leaf by leaf) at one checkpoint: lr times all the dot products.
    tracin = peg.diagnostics.tracin_scores(
        [model.get_weights()], model, sparse_ce, x, y, x, y, learning_rates=0.5, batch_size=BATCH
    )
    all_atol = (GRADIENT_RTOL * 2 + rounding_rtol(p)) * np.abs(flat) @ np.abs(flat).T * 0.5
    np.testing.assert_array_less(np.abs(tracin.scores - 0.5 * flat @ flat.T), all_atol + 1e-300)


@pytest.mark.slow  # two DPModel.fit runs: Keras traces its train step
@pytest.mark.filterwarnings("ignore:DPModel.fit was given fixed-size batches")  # epsilon is not what is tested
def test_dp_model_fit_on_dict_arrays_equals_fit_on_the_dataset():
    _, x, y = _model_and_data("dict")
    start = None
    weights = []
    for data in [dict(x=x, y=y, batch_size=3, shuffle=False), dict(x=_dataset(x, y, 3))]:
        model = _model_and_data("dict")[0]  # a network of its own for each DPModel, from the same weights
        if start is None:
            start = [w.copy() for w in model.get_weights()]
        model.set_weights(start)
        dp = peg.keras.DPModel(model, l2_norm_clip=0.5, noise_multiplier=0.0, expected_batch_size=3, num_examples=N)
        dp.compile(
            optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        dp.fit(epochs=1, verbose=0, **data)
        weights.append(model.get_weights())
    assert any(not np.array_equal(a, b) for a, b in zip(start, weights[0]))
    # Two SGD steps on the same batches of 3: clipped means that agree to their rounding (of at most 3 C / 3).
    p = sum(w.size for w in start)
    for a, b in zip(*weights):
        atol = sgd_steps_atol(2, 0.1, clipped_sum_rtol(p, 3) + EPS32, 0.5, max(np.abs(a).max(), np.abs(b).max()))
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)


# ------------------------------------------------------------------ refusals


def test_leaves_with_different_rows_are_refused_naming_the_leaf(tmp_path):
    model, x, y = _model_and_data("dict")
    short = {"a": x["a"], "b": x["b"][:4]}
    with pytest.raises(ValueError, match=r"data: x\['b'\] has 4 rows but x\['a'\] has 6"):
        peg.diagnostics.gradient_statistics(model, sparse_ce, (short, y), batch_size=BATCH, progress=False)
    with pytest.raises(ValueError, match=r"data: y has 5 rows but x\['a'\] has 6"):
        peg.diagnostics.gradient_statistics(model, sparse_ce, (x, y[:5]), batch_size=BATCH, progress=False)
    with pytest.raises(ValueError, match=r"x\['a'\] has B=6 but x\['b'\] has B=4"):
        peg.per_example_gradients(model, sparse_ce, short, y)
    with pytest.raises(ValueError, match=r"x_train\['b'\] has 4 rows"):
        peg.diagnostics.tracin_scores([model.get_weights()], model, sparse_ce, short, y, x, y, learning_rates=0.1)
    with pytest.raises(ValueError, match=r"x\['b'\] has 4 rows"):
        peg.diagnostics.GradientStatisticsCallback((short, y), log_dir=str(tmp_path), loss_fn=sparse_ce)


def test_a_python_list_of_numbers_is_refused_with_how_to_pass_it():
    model, x, y = _model_and_data("dict")
    with pytest.raises(TypeError, match=r"y is a Python list of numbers.*np.asarray\(y\)"):
        peg.per_example_gradients(model, sparse_ce, x, list(y))
    with pytest.raises(TypeError, match=r"x\['a'\] is a Python list of numbers"):
        peg.per_example_norms(model, sparse_ce, {"a": x["a"].tolist(), "b": x["b"]}, y)
    with pytest.raises(TypeError, match=r"y is a Python list of numbers"):
        peg.diagnostics.gradient_statistics(model, sparse_ce, (x, list(y)), progress=False)
