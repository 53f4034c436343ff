"""Diagnostics on data with non-finite examples: left out, counted, warned about once, never a crash.

The reference is the same statistics streamed over the same batches without
those examples (``GradientStatistics`` fed by hand): per-example gradients
do not mix examples, so the two differ only by float32 rounding, bounded as
in tests/test_diagnostics.py (each entry within ``GRADIENT_RTOL`` of the
largest, propagated through each statistic: tests/tolerances.py).
"""

from __future__ import annotations

import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from figure_checks import legend_text, title_text
from helpers import assert_close
from per_example_grads import plots
from per_example_grads.apps import cli
from per_example_grads.diagnostics import (
    GradientReport,
    GradientStatistics,
    GradientStatisticsCallback,
    gradient_statistics,
)
from per_example_grads.diagnostics.streams import num_batches
from tolerances import GRADIENT_RTOL, cosine_atol, gsnr_atol, mean_atol, norm_rtol, variance_atol

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
N, BATCH = 40, 16
LEFT_OUT = "non-finite \\(NaN or Inf\\) gradient; they were left out of the gradient statistics"


def mlp(extra_layer=None) -> keras.Model:
    keras.utils.set_random_seed(0)
    layers = [keras.Input((8,)), keras.layers.Dense(6, activation="tanh")]
    layers += [extra_layer] if extra_layer is not None else []
    return keras.Sequential(layers + [keras.layers.Dense(3)])


def data(bad=(13,)) -> tuple[np.ndarray, np.ndarray]:
    """``N`` examples; those in ``bad`` have a NaN input, so a NaN loss and gradient."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((N, 8)).astype("float32"), rng.integers(0, 3, N).astype("int32")
    x[list(bad), 2] = np.nan
    return x, y


def streamed_without(model, x, y, bad, method="auto") -> GradientReport:
    """The statistics of ``BATCH``-sized batches of ``(x, y)`` with the examples ``bad`` removed from each."""
    stats = GradientStatistics(model, SCCE, method=method)
    batches = []
    for start in range(0, N, BATCH):
        keep = [i for i in range(start, min(start + BATCH, N)) if i not in bad]
        batches.append((x[keep], y[keep]))
        stats.update(*batches[-1])
    mean = stats.mean()
    return stats.result(cosines=np.concatenate([stats.cosines(bx, by, mean) for bx, by in batches]))


def flat_gradients(model, x, y) -> np.ndarray:
    grads = peg.per_example_gradients(model, SCCE, x, y, method="loop")
    return np.concatenate([np.asarray(g, np.float64).reshape(len(x), -1) for g in grads], axis=1)


def assert_same_statistics(got: GradientReport, want: GradientReport, flat: np.ndarray) -> None:
    """Every statistic of ``got`` against ``want``, both over the examples whose gradients are ``flat``."""
    err = GRADIENT_RTOL * np.abs(flat).max()
    sizes = [m.size for m in want.mean]
    by_variable = np.split(flat, np.cumsum(sizes)[:-1], axis=1)
    assert got.num_examples == want.num_examples == len(flat)
    assert got.batch_sizes == want.batch_sizes
    for a, b, f in zip(got.mean, want.mean, by_variable):
        assert_close(a.ravel(), b.ravel(), atol=mean_atol(f, err))
    for a, b, f in zip(got.variance, want.variance, by_variable):
        assert_close(a.ravel(), b.ravel(), atol=variance_atol(f, err))
    assert_close(got.trace_covariance, want.trace_covariance, atol=variance_atol(flat, err).sum())
    for a, b, p in zip(got.per_variable_norms, want.per_variable_norms, sizes):
        assert_close(a, b, rtol=norm_rtol(p), atol=err * np.sqrt(p))
    assert_close(got.cosines, want.cosines, atol=cosine_atol(flat, err, flat.mean(0), err))
    for (key, value), f in zip(want.gsnr().items(), by_variable):
        assert_close(got.gsnr()[key], value, atol=gsnr_atol(f, err))
    assert np.isfinite(got.trace_covariance) and np.isfinite(got.noise_scale_full_data)


@pytest.mark.parametrize(
    "extra, method",
    [(None, "auto"), (keras.layers.LayerNormalization, "auto"), (None, "loop")],
    ids=["dense-closed-form", "layer-local", "materialized"],
)
def test_a_nan_example_is_left_out_and_the_rest_are_the_data_without_it(extra, method):
    model = mlp(None if extra is None else extra())
    x, y = data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = gradient_statistics(model, SCCE, (x, y), batch_size=BATCH, method=method, progress=False)
    ours = [w for w in caught if issubclass(w.category, RuntimeWarning) and "gradient statistics" in str(w.message)]
    assert len(ours) == 1 and str(ours[0].message).startswith("1 example(s) have a non-finite"), [
        str(w.message) for w in caught
    ]
    assert report.num_nonfinite == 1

    kept = np.delete(np.arange(N), 13)
    want = streamed_without(model, x, y, {13}, method)
    assert_same_statistics(report, want, flat_gradients(model, x[kept], y[kept]))
    # The dataset index of an example is its row of x, the left-out one skipped.
    assert [e["index"] for e in report.top_examples()] == [int(kept[e["index"]]) for e in want.top_examples()]
    assert 13 not in report.example_indices


def test_the_report_says_how_many_were_left_out_and_never_writes_nan(tmp_path):
    model = mlp()
    x, y = data(bad=(3, 20, 39))
    with pytest.warns(RuntimeWarning, match="^3 example\\(s\\) have a " + LEFT_OUT):
        report = gradient_statistics(model, SCCE, (x, y), batch_size=BATCH, progress=False)
    d = report.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["num_examples"] == N - 3 and d["num_nonfinite_examples"] == 3
    assert (
        sum(d["per_example_norm_histogram"]["counts"]) == N - 3 and d["per_example_norm_histogram"]["non_finite"] == 0
    )
    assert d["trace_covariance"] is not None and d["noise_scale_full_data"] is not None
    assert "3 non-finite examples left out" in report.summary()
    fig = report.figure(title="mlp")
    assert "3 non-finite examples left out" in title_text(fig)
    assert "undefined" not in legend_text(fig)
    report.save_png(tmp_path / "report.png")


def test_an_infinite_target_is_left_out_too():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((N, 4)).astype("float32"), rng.standard_normal((N, 1)).astype("float32")
    y[[5, 30]] = np.inf
    mse = lambda t, p: tf.reduce_sum(tf.square(t - p), axis=-1)  # noqa: E731
    with pytest.warns(RuntimeWarning, match="^2 example\\(s\\)"):
        report = gradient_statistics(model, mse, (x, y), batch_size=BATCH, progress=False)
    assert (report.num_examples, report.num_nonfinite) == (N - 2, 2)
    assert np.isfinite(report.per_example_norms).all() and np.isfinite(report.trace_covariance)


def test_streaming_counts_only_finite_examples_and_datasets_agree():
    model = mlp()
    x, y = data(bad=(0, 17))
    stats = GradientStatistics(model, SCCE)
    kept = [stats.update(x[s : s + BATCH], y[s : s + BATCH]) for s in range(0, N, BATCH)]
    assert kept == [15, 15, 8] and stats.count == N - 2 and stats.num_nonfinite == 2
    with pytest.warns(RuntimeWarning, match="^2 example"):
        streamed = stats.result()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    with pytest.warns(RuntimeWarning, match="^2 example"):
        from_dataset = gradient_statistics(model, SCCE, dataset, cosine=None, progress=False)
    for a, b in zip(streamed.mean, from_dataset.mean):
        np.testing.assert_array_equal(a, b)  # the same batches, computed the same way
    assert streamed.batch_sizes == from_dataset.batch_sizes == [15, 15, 8]


def test_only_non_finite_examples_give_an_empty_report_not_a_crash(tmp_path):
    model = mlp()
    x, y = data(bad=range(N))
    with pytest.warns(RuntimeWarning, match=f"^{N} example"):
        report = gradient_statistics(model, SCCE, (x, y), batch_size=BATCH, progress=False)
    assert (report.num_examples, report.num_nonfinite) == (0, N)
    json.dumps(report.to_dict(), allow_nan=False)
    assert f"{N} non-finite examples left out" in report.summary()
    report.save_png(tmp_path / "report.png")


def test_histograms_leave_non_finite_norms_out_and_count_them():
    norms = np.array([1.0, np.nan, 2.0, np.inf, 0.0, 3.0])
    report = GradientReport(
        num_examples=6,
        variable_paths=["w"],
        mean=[np.zeros(1)],
        variance=[np.ones(1)],
        per_variable_norms=norms[None],
        cosines=None,
        batch_sizes=[6],
        batch_trace=[1.0],
        batch_g2=[1.0],
    )
    histogram = report.norm_histogram(bins=3)
    assert sum(histogram["counts"]) == 4 and histogram["non_finite"] == 2
    assert report.norm_quantiles()["1.0"] == 3.0
    assert [e["norm"] for e in report.top_examples(3)] == [np.inf, 3.0, 2.0]  # NaN sorts last, not first
    fig = plots.norms_histogram_figure(norms, title="hand-made")
    legend = legend_text(fig)
    assert "2 non-finite norm(s) (NaN or Inf), not shown" in legend and "1 zero norm(s), not shown" in legend
    assert "max 3" in legend


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1; got 0"),
        ({"batch_size": -4}, ValueError, "batch_size must be >= 1"),
        ({"batch_size": 2.5}, TypeError, "batch_size must be an integer >= 1; got 2.5"),
        ({"batch_size": True}, TypeError, "batch_size must be an integer >= 1; got True"),
        ({"top_k": -1}, ValueError, "top_k must be >= 0"),
        ({"top_k": 2.0}, TypeError, "top_k must be an integer"),
        ({"cosine": "last"}, ValueError, "cosine must be one of"),
        ({"method": "fastest"}, ValueError, "method must be one of"),
        ({"training": "yes"}, TypeError, "training must be True or False"),
        ({"progress": None}, TypeError, "progress must be True or False"),
    ],
)
def test_gradient_statistics_checks_its_arguments(kwargs, error, match):
    x, y = data(bad=())
    with pytest.raises(error, match=match):
        gradient_statistics(mlp(), SCCE, (x, y), **({"progress": False} | kwargs))


def test_batch_size_is_checked_by_the_stream_and_the_callback():
    x, y = data(bad=())
    with pytest.raises(ValueError, match="batch_size must be >= 1; got 0"):
        num_batches((x, y), 0)
    with pytest.raises(ValueError, match="batch_size must be >= 1; got 0"):
        GradientStatisticsCallback((x, y), batch_size=0)


def test_cli_diagnose_leaves_nan_examples_out(tmp_path):
    model = mlp()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.save(tmp_path / "m.keras")
    x, y = data(bad=(7,))
    np.savez(tmp_path / "d.npz", x=x, y=y)
    out = tmp_path / "out"
    with pytest.warns(RuntimeWarning, match="^1 example"):
        assert cli.main(["diagnose", str(tmp_path / "m.keras"), str(tmp_path / "d.npz"), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["num_examples"] == N - 1 and report["num_nonfinite_examples"] == 1
    assert report["trace_covariance"] > 0 and 7 not in [e["index"] for e in report["top_examples"]]
