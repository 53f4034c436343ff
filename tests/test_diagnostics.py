"""Tests of ``per_example_grads.diagnostics``: statistics, similarity, TracIn, callback, CLI."""

from __future__ import annotations

import json
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import per_example_grads as peg  # noqa: E402
from figure_checks import assert_report_ready, recording  # noqa: E402
from helpers import assert_close  # noqa: E402
from per_example_grads import plots  # noqa: E402
from per_example_grads.apps import cli, zoo  # noqa: E402
from per_example_grads.data import train_test_split_digits  # noqa: E402
from per_example_grads.diagnostics import (  # noqa: E402
    GradientStatistics,
    GradientStatisticsCallback,
    gradient_similarity,
    gradient_statistics,
    tracin_scores,
)
from per_example_grads.diagnostics.similarity import uses_closed_form  # noqa: E402
from tolerances import (  # noqa: E402
    EPS64,
    GRADIENT_RTOL,
    Z,
    cosine_atol,
    gsnr_atol,
    mean_atol,
    noise_scale_rtol,
    norm_rtol,
    rounding_rtol,
    variance_atol,
)

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def half_squared_error(y, p):
    """``[B]``: ``0.5 * ||y - p||^2``."""
    return 0.5 * tf.reduce_sum(tf.square(y - p), axis=-1)


def linear_model(w_hat: np.ndarray) -> keras.Model:
    model = keras.Sequential([keras.Input((len(w_hat),)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].kernel.assign(w_hat[:, None].astype("float32"))
    return model


def regression_data(w: np.ndarray, n: int, sigma: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, len(w)))
    y = x @ w + sigma * rng.standard_normal(n)
    return x.astype("float32"), y[:, None].astype("float32")


def materialized(model, loss, x, y) -> np.ndarray:
    """``[N, P]`` float64 per-example gradients, flattened."""
    grads = peg.per_example_gradients(model, loss, x, y, method="vectorized")
    return np.concatenate([np.asarray(g, np.float64).reshape(len(x), -1) for g in grads], axis=1)


def linear_gradient_err(x: np.ndarray, y: np.ndarray, w_hat: np.ndarray) -> np.ndarray:
    """``[N, D]``: how far two float32 computations of ``g_ip = (x_i . w_hat - y_i) x_ip`` can be apart.

    D + 2 rounded steps (a D-term dot product, the subtraction of ``y``, the
    product with ``x_p``), relative to the magnitude of the terms
    ``(sum_j |x_ij w_hat_j| + |y_i|) |x_ip|``: the residual cancels, so not to ``g`` itself.
    """
    x, y = x.astype(np.float64), y.astype(np.float64).ravel()
    terms = np.abs(x) @ np.abs(w_hat) + np.abs(y)
    return rounding_rtol(x.shape[1] + 2) * terms[:, None] * np.abs(x)


def numpy_noise_scale(flat: np.ndarray, batch_size: int) -> float:
    """McCandlish's two-batch-size estimator, batch by batch, in numpy."""
    tr, g2, w = [], [], []
    for s in range(0, len(flat), batch_size):
        g = flat[s : s + batch_size]
        b = len(g)
        if b < 2:
            continue
        small = np.mean(np.sum(g**2, axis=1))
        big = np.sum(g.mean(0) ** 2)
        tr.append((small - big) / (1 - 1 / b))
        g2.append((b * big - small) / (b - 1))
        w.append(b)
    w = np.array(w, float)
    return float(np.sum(w * tr) / np.sum(w * g2))


class TestLinearRegression:
    r"""Linear regression, where the per-example gradient covariance is analytic.

    Data: ``x ~ N(0, I_D)``, ``y = w^T x + eps``, ``eps ~ N(0, s^2)`` independent
    of ``x``. Model ``y_hat = w_hat^T x``, loss ``l = 0.5 (y - w_hat^T x)^2``.
    With ``d = w_hat - w`` the per-example gradient is

        g = -(y - w_hat^T x) x = (x^T d - eps) x = x x^T d - eps x.

    Mean: ``E[g] = E[x x^T] d - E[eps] E[x] = d``, so ``|G|^2 = ||d||^2``.

    Second moment: by Isserlis' theorem
    ``E[x_i x_j x_k x_l] = d_ij d_kl + d_ik d_jl + d_il d_jk`` (Kronecker d's),
    ``E[(x^T d)^2 x x^T] = ||d||^2 I + 2 d d^T``; the cross term
    ``E[eps (x^T d) x x^T] = 0``; ``E[eps^2 x x^T] = s^2 I``. Hence

        Sigma = Cov[g] = (||d||^2 + s^2) I + d d^T,
        Var[g_p] = ||d||^2 + s^2 + d_p^2,
        tr(Sigma) = D (||d||^2 + s^2) + ||d||^2,
        B_simple = tr(Sigma) / ||d||^2.

    Case ``w_hat = w`` (``d = 0``): ``g = -eps x``, mean 0, ``Sigma = s^2 I``.
    Then ``g_p^2 = eps^2 x_p^2`` has mean ``s^2`` and ``E[g_p^4] = 3 s^4 * 3``,
    so the sample variance of ``g_p`` from N examples has standard error
    ``sqrt(8 / N) s^2``; and ``||g||^2 = eps^2 ||x||^2`` has variance
    ``E[eps^4] E[||x||^4] - s^4 D^2 = 3 s^4 (D^2 + 2D) - s^4 D^2 = s^4 (2 D^2 + 6 D)``,
    so ``tr(Sigma)``'s estimate has standard error ``s^2 sqrt((2 D^2 + 6 D) / N)``.

    Case ``d != 0``: the batched ``|G|^2`` estimate is a U-statistic,
    ``mean_{i != j} <g_i, g_j>`` within each batch of size B; averaged over
    ``N / B`` batches its variance is ``4 d^T Sigma d / N + 2 tr(Sigma^2) / (N (B - 1))``
    (to first order), with ``d^T Sigma d = c ||d||^2 + ||d||^4`` and
    ``tr(Sigma^2) = D c^2 + 2 c ||d||^2 + ||d||^4``, ``c = ||d||^2 + s^2``.
    The ``tr(Sigma)`` estimate's standard error is taken by plug-in,
    ``std_i ||g_i - g_bar||^2 / sqrt(N)``. The ratio's relative error is at most
    the sum of the two relative errors. Every check allows ``Z`` standard errors.
    """

    D, SIGMA, N, BATCH = 4, 0.5, 8000, 100

    def test_zero_mean_case_matches_analytic_and_numpy(self):
        w = np.array([1.0, -2.0, 0.5, 0.0])
        x, y = regression_data(w, self.N, self.SIGMA, seed=1)
        model = linear_model(w)
        report = gradient_statistics(model, half_squared_error, (x, y), batch_size=self.BATCH, progress=False)
        s2 = self.SIGMA**2
        variance = report.variance[0].ravel()
        se_var = math.sqrt(8 / self.N) * s2
        np.testing.assert_allclose(variance, s2, atol=Z * se_var)
        se_trace = s2 * math.sqrt((2 * self.D**2 + 6 * self.D) / self.N)
        assert abs(report.trace_covariance - self.D * s2) < Z * se_trace
        # The mean gradient is 0 up to its standard error s / sqrt(N) per parameter.
        np.testing.assert_allclose(report.mean[0].ravel(), 0.0, atol=Z * self.SIGMA / math.sqrt(self.N))

        # Against numpy on gradients computed another way (the Dense closed form vs vectorized): up to rounding.
        flat = materialized(model, half_squared_error, x, y)
        err = linear_gradient_err(x, y, w)
        f64 = rounding_rtol(self.N, EPS64)  # the float64 accumulation over N examples
        assert_close(variance, flat.var(axis=0, ddof=1), rtol=f64, atol=variance_atol(flat, err))
        assert_close(
            report.trace_covariance, flat.var(axis=0, ddof=1).sum(), rtol=f64, atol=variance_atol(flat, err).sum()
        )
        assert_close(
            report.per_example_norms,
            np.linalg.norm(flat, axis=1),
            rtol=norm_rtol(self.D, 0.0),
            atol=np.linalg.norm(err, axis=1),
        )

    def test_nonzero_mean_case_matches_analytic_and_numpy(self):
        w = np.array([1.0, -2.0, 0.5, 0.0])
        d = np.array([0.3, -0.2, 0.1, 0.0])
        x, y = regression_data(w, self.N, self.SIGMA, seed=2)
        model = linear_model(w + d)
        report = gradient_statistics(model, half_squared_error, (x, y), batch_size=self.BATCH, progress=False)
        flat = materialized(model, half_squared_error, x, y)

        dd, s2 = float(d @ d), self.SIGMA**2
        c = dd + s2
        want_var = c + d**2
        want_trace = self.D * c + dd
        want_noise_scale = want_trace / dd

        # Against numpy on gradients computed another way (the Dense closed form vs vectorized): up to rounding.
        err = linear_gradient_err(x, y, w + d)
        f64 = rounding_rtol(self.N, EPS64)  # the float64 accumulation over N examples
        assert_close(report.variance[0].ravel(), flat.var(axis=0, ddof=1), rtol=f64, atol=variance_atol(flat, err))
        assert_close(report.mean[0].ravel(), flat.mean(axis=0), rtol=f64, atol=mean_atol(flat, err))
        np.testing.assert_allclose(
            report.noise_scale, numpy_noise_scale(flat, self.BATCH), rtol=noise_scale_rtol(flat, err, self.BATCH) + f64
        )
        centred = flat - flat.mean(0)
        cos = flat @ flat.mean(0) / (np.linalg.norm(flat, axis=1) * np.linalg.norm(flat.mean(0)))
        assert_close(report.cosines, cos, atol=cosine_atol(flat, err, flat.mean(0), mean_atol(flat, err)))

        # Against the analytic values, within Z standard errors.
        sq = np.sum(centred**2, axis=1)  # ||g_i - g_bar||^2
        se_trace = sq.std() / math.sqrt(self.N)
        assert abs(report.trace_covariance - want_trace) < Z * se_trace
        # Per parameter: Var(sample variance) ~ Var[(g_p - m_p)^2] / N (plug-in).
        se_var = (centred**2).std(axis=0) / math.sqrt(self.N)
        np.testing.assert_array_less(np.abs(report.variance[0].ravel() - want_var), Z * se_var)
        dsd = c * dd + dd**2
        tr_sigma2 = self.D * c**2 + 2 * c * dd + dd**2
        se_g2 = math.sqrt(4 * dsd / self.N + 2 * tr_sigma2 / (self.N * (self.BATCH - 1)))
        rel = se_trace / want_trace + se_g2 / dd
        assert abs(report.noise_scale / want_noise_scale - 1) < Z * rel
        assert abs(report.noise_scale_full_data / want_noise_scale - 1) < Z * rel


def mlp(seed: int = 0, extra_layer: keras.layers.Layer | None = None) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((8,)), keras.layers.Dense(6, activation="tanh")]
    if extra_layer is not None:
        layers.append(extra_layer)
    layers.append(keras.layers.Dense(3))
    return keras.Sequential(layers)


def small_classification(n: int = 60, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 8)).astype("float32"), rng.integers(0, 3, n).astype("int32")


@pytest.mark.parametrize(
    "extra, method",
    [
        (None, "auto"),
        (keras.layers.LayerNormalization, "auto"),
        pytest.param(keras.layers.LayerNormalization, "vectorized", marks=pytest.mark.slow),
    ],
    ids=["dense-closed-form", "layer-local", "materialized"],
)
def test_streaming_matches_one_big_batch(extra, method):
    model = mlp(extra_layer=None if extra is None else extra())
    x, y = small_classification()
    sizes = [7, 20, 1, 13, 19]  # uneven, including a batch of one
    assert sum(sizes) == len(x)

    big = gradient_statistics(model, SCCE, (x, y), batch_size=len(x), method=method, progress=False)
    stats = GradientStatistics(model, SCCE, method=method)
    start = 0
    for b in sizes:
        stats.update(x[start : start + b], y[start : start + b])
        start += b
    mean = stats.mean()
    cosines = np.concatenate(
        [stats.cosines(x[s : s + b], y[s : s + b], mean) for s, b in zip(np.cumsum([0] + sizes[:-1]), sizes)]
    )
    streamed = stats.result(cosines=cosines)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    from_dataset = gradient_statistics(model, SCCE, dataset, method=method, progress=False)

    # Batches of other sizes give other float32 per-example gradients (oneDNN picks kernels by shape): each
    # entry within GRADIENT_RTOL of the largest one, propagated through each statistic (tests/tolerances.py).
    flat = materialized(model, SCCE, x, y)
    err = GRADIENT_RTOL * np.abs(flat).max()
    sizes_p = [int(np.prod(v.shape)) for v in model.trainable_variables]
    by_variable = np.split(flat, np.cumsum(sizes_p)[:-1], axis=1)
    for other in (streamed, from_dataset):
        assert other.num_examples == big.num_examples == len(x)
        for a, b, f in zip(other.mean, big.mean, by_variable):
            assert_close(a.ravel(), b.ravel(), rtol=0, atol=mean_atol(f, err))
        for a, b, f in zip(other.variance, big.variance, by_variable):
            assert_close(a.ravel(), b.ravel(), rtol=0, atol=variance_atol(f, err))
        assert_close(other.trace_covariance, big.trace_covariance, rtol=0, atol=variance_atol(flat, err).sum())
        for a, b, p in zip(other.per_variable_norms, big.per_variable_norms, sizes_p):
            assert_close(a, b, rtol=norm_rtol(p), atol=err * np.sqrt(p))
        assert_close(other.cosines, big.cosines, rtol=0, atol=cosine_atol(flat, err, flat.mean(0), err))
        for (key, value), f in zip(big.gsnr().items(), by_variable):
            assert_close(other.gsnr()[key], value, rtol=0, atol=gsnr_atol(f, err))
        assert [e["index"] for e in other.top_examples()] == [e["index"] for e in big.top_examples()]
    # And against materialized per-example gradients.
    assert_close(big.trace_covariance, flat.var(axis=0, ddof=1).sum(), rtol=0, atol=variance_atol(flat, err).sum())
    assert_close(
        big.per_example_norms,
        np.linalg.norm(flat, axis=1),
        rtol=norm_rtol(flat.shape[1]),
        atol=err * np.sqrt(flat.shape[1]),
    )


def test_report_dict_is_json_and_png_is_an_image(tmp_path):
    model = mlp()
    x, y = small_classification()
    report = gradient_statistics(model, SCCE, (x, y), batch_size=16, top_k=5, progress=False)
    d = report.to_dict()
    text = json.dumps(d, allow_nan=False)
    for key in (
        "trace_covariance",
        "noise_scale",
        "mean_gradient_norm",
        "per_example_norm_quantiles",
        "gsnr",
        "layers",
        "per_example_norm_histogram",
        "top_examples",
    ):
        assert key in d
    assert set(d["gsnr"]) == {v.path for v in model.trainable_variables}
    assert sum(d["per_example_norm_histogram"]["counts"]) == len(x)
    assert len(d["top_examples"]) == 5
    assert json.loads(text)["num_examples"] == len(x)

    path = report.save_png(tmp_path / "report.png", title="mlp on small_classification")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = report.figure(title="mlp on small_classification")
    assert_report_ready(
        fig,
        panels=4,
        title_has=["Gradient diagnostics", "mlp on small_classification"],
        legend_has=[f"from all {len(x)} examples: "],
    )
    untitled = report.figure()
    assert f"{len(x)} examples" in untitled.get_suptitle()
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.parametrize("extra", [None, keras.layers.LayerNormalization], ids=["dense-only", "fallback"])
@pytest.mark.parametrize("cosine", [False, True])
def test_similarity_matches_materialized_dot_products(extra, cosine):
    model = mlp(extra_layer=None if extra is None else extra())
    x, y = small_classification(20)
    xa, ya, xb, yb = x[:12], y[:12], x[12:], y[12:]
    assert uses_closed_form(model, SCCE, xa, ya) == (extra is None)
    k = gradient_similarity(model, SCCE, xa, ya, xb, yb, cosine=cosine).numpy()
    ga, gb = materialized(model, SCCE, xa, ya), materialized(model, SCCE, xb, yb)
    want = ga @ gb.T
    if cosine:
        want = want / np.outer(np.linalg.norm(ga, axis=1), np.linalg.norm(gb, axis=1))
    assert k.shape == (12, 8)
    # Each gradient entry within err of the other computation's (tests/tolerances.py), so a dot product
    # within err (|g_a|_1 + |g_b|_1) and a cosine within 2 err sqrt(P) (1 / ||g_a|| + 1 / ||g_b||).
    err = GRADIENT_RTOL * max(np.abs(ga).max(), np.abs(gb).max())
    if cosine:
        na, nb = np.linalg.norm(ga, axis=1), np.linalg.norm(gb, axis=1)
        atol = 2 * err * np.sqrt(ga.shape[1]) * (1 / na[:, None] + 1 / nb[None, :])
    else:
        atol = err * (np.abs(ga).sum(axis=1)[:, None] + np.abs(gb).sum(axis=1)[None, :])
    assert_close(k, want, rtol=0, atol=atol)


def test_tracin_sums_learning_rate_weighted_dot_products(tmp_path):
    model = mlp()
    x, y = small_classification(30)
    x_train, y_train, x_test, y_test = x[:24], y[:24], x[24:], y[24:]
    checkpoints = [model.get_weights()]
    keras.utils.set_random_seed(1)
    checkpoints.append(
        [w + 0.1 * np.random.default_rng(1).standard_normal(w.shape).astype(w.dtype) for w in checkpoints[0]]
    )
    model.set_weights(checkpoints[1])
    path = str(tmp_path / "ckpt.weights.h5")
    model.save_weights(path)
    model.set_weights(checkpoints[0])
    lrs = [0.1, 0.05]

    result = tracin_scores(
        [checkpoints[0], path],
        model,
        SCCE,
        x_train,
        y_train,
        x_test,
        y_test,
        learning_rates=lrs,
        top_k=3,
        batch_size=10,
    )
    want, atol = np.zeros((24, 6)), np.zeros((24, 6))
    for weights, lr in zip(checkpoints, lrs):
        model.set_weights(weights)
        ga, gb = materialized(model, SCCE, x_train, y_train), materialized(model, SCCE, x_test, y_test)
        want += lr * ga @ gb.T
        # Each dot product within err (|g_a|_1 + |g_b|_1), as in test_similarity_matches_materialized_dot_products.
        err = GRADIENT_RTOL * max(np.abs(ga).max(), np.abs(gb).max())
        atol += lr * err * (np.abs(ga).sum(axis=1)[:, None] + np.abs(gb).sum(axis=1)[None, :])
    model.set_weights(checkpoints[0])
    assert_close(result.scores, want, rtol=0, atol=atol)
    assert result.helpful.shape == result.harmful.shape == (6, 3)
    for j in range(6):
        np.testing.assert_array_equal(result.helpful[j], np.argsort(-want[:, j])[:3])
        np.testing.assert_array_equal(result.harmful[j], np.argsort(want[:, j])[:3])
    # The model's weights are restored.
    for a, b in zip(model.get_weights(), checkpoints[0]):
        np.testing.assert_array_equal(a, b)


def test_callback_writes_tensorboard_scalars_only_every_n_steps(tmp_path, monkeypatch):
    model = mlp()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = small_classification(96)
    calls = []
    original = GradientStatistics.update
    monkeypatch.setattr(GradientStatistics, "update", lambda self, *a: calls.append(1) or original(self, *a))
    callback = GradientStatisticsCallback(
        (x[:40], y[:40]),
        every_n_steps=2,
        log_dir=str(tmp_path / "logs"),
        batch_size=20,
        statistics=("noise_scale", "trace_covariance", "mean_gradient_norm", "gsnr", "norm_histograms"),
    )
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[callback])  # 6 steps
    assert callback.steps_computed == [2, 4, 6]
    assert len(calls) == 3 * 2  # 2 batches of 20 per computation, nothing on other steps

    tags: dict[str, list[int]] = {}
    files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "logs") for f in fs if "tfevents" in f]
    assert files
    for f in files:
        for event in tf.compat.v1.train.summary_iterator(f):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(event.step)
    for tag in ("gradients/noise_scale", "gradients/trace_covariance", "gradients/mean_gradient_norm"):
        assert tags[tag] == [2, 4, 6], tags
    assert any(t.startswith("gradients/gsnr/") for t in tags)
    assert "gradients/norms/all" in tags
    assert any(t.startswith("gradients/norms/") and t != "gradients/norms/all" for t in tags)


def test_cli_diagnose_fast_end_to_end(tmp_path, capsys, monkeypatch):
    out = tmp_path / "diag"
    figures, overviews = [], []
    monkeypatch.setattr(plots, "norms_histogram_figure", recording(figures, plots.norms_histogram_figure))
    monkeypatch.setattr(
        peg.diagnostics.GradientReport, "figure", recording(overviews, peg.diagnostics.GradientReport.figure)
    )
    assert cli.main(["diagnose", "--fast", "--out", str(out), "--batch-size", "8"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["num_examples"] == 600
    assert report["current_batch_size"] == 8
    # The suggestion comes from the all-examples estimate, and the output says which to trust.
    assert report["suggestion_from"] == "noise_scale_full_data"
    assert report["suggested_batch_size"] == math.ceil(report["noise_scale_full_data"])
    assert report["accumulation_steps"] == math.ceil(report["suggested_batch_size"] / 8)
    full, batched = report["noise_scale_full_data"], report["noise_scale"]
    assert f"B_simple = tr(Σ)/|G|^2: {full:.4g} (from all 600 examples at once)" in printed
    assert f"is {batched:.4g};" in printed and "trust the first" in printed
    assert f"suggested batch size ~ B_simple = {report['suggested_batch_size']}" in printed
    assert "index = row of per_example_grads.data.load_digits()" in printed
    assert report["top_examples_index"] == "row of per_example_grads.data.load_digits()"
    for name in ("report.png", "norms_histogram.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"

    names = ["digits_mlp", "4,810 parameters", "sparse_categorical_crossentropy", "600 UCI digits"]
    (overview,) = overviews
    assert_report_ready(
        overview,
        panels=4,
        title_has=["Gradient diagnostics", *names],
        legend_has=[f"final {batched:.4g}", f"from all 600 examples: {full:.4g} (use this)", "median "],
    )
    var_ax, gsnr_ax, hist_ax, ns_ax = overview.axes
    assert var_ax.get_yscale() == gsnr_ax.get_yscale() == hist_ax.get_xscale() == ns_ax.get_yscale() == "log"
    assert var_ax.get_xlabel() == gsnr_ax.get_xlabel() == "layer"
    assert [t.get_text().split("_")[0] for t in var_ax.get_xticklabels()] == ["dense", "dense"]  # no model prefix
    assert ns_ax.get_ylabel() == "B_simple (examples, log scale)"
    overview.canvas.draw()
    for ax in (var_ax, gsnr_ax, ns_ax):  # plain numbers, not 4x10^1
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert labels and not any("times" in t or "^" in t for t in labels), labels
    (histogram,) = figures
    assert_report_ready(
        histogram,
        panels=1,
        title_has=["Per-example gradient norms", *names],
        legend_has=["N = 600 examples", "median ", "95th percentile ", "max "],
    )
    # The standalone histogram and the overview's panel show the same log-binned norms.
    assert histogram.axes[0].get_xscale() == "log"
    standalone = [t.get_text() for t in histogram.axes[0].get_legend().get_texts()]
    assert standalone == [t.get_text() for t in hist_ax.get_legend().get_texts()]
    assert [p.get_width() > 0 for p in histogram.axes[0].patches] == [p.get_width() > 0 for p in hist_ax.patches]


def test_cli_diagnose_saved_model_and_npz(tmp_path):
    model = mlp()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.save(tmp_path / "m.keras")
    x, y = small_classification(50)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    out = tmp_path / "out"
    assert cli.main(["diagnose", str(tmp_path / "m.keras"), str(tmp_path / "d.npz"), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["num_examples"] == 50 and report["trace_covariance"] > 0


def test_planted_mislabeled_digit_is_in_the_top_k():
    split = train_test_split_digits(seed=0)
    x, y = split.x_train, split.y_train.copy()
    planted = 700
    y[planted] = (y[planted] + 5) % 10
    model = zoo.build_model("digits_mlp", seed=0)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(x, y, epochs=5, batch_size=32, verbose=0)
    report = gradient_statistics(model, SCCE, (x, y), batch_size=256, top_k=10, cosine=None, progress=False)
    assert planted in [e["index"] for e in report.top_examples()]


def test_sample_weights_in_data_are_refused_not_dropped():
    import keras
    import numpy as np
    import tensorflow as tf

    import per_example_grads as peg

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    ds = tf.data.Dataset.from_tensor_slices(
        (np.ones((4, 3), "float32"), np.zeros(4, "int32"), np.ones(4, "float32"))
    ).batch(2)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    with pytest.raises(ValueError, match="3 entries"):
        peg.diagnostics.gradient_statistics(model, loss, ds, progress=False)
