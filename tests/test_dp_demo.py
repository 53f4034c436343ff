"""End-to-end test of ``pegrad demo --dp``: DP-SGD on the digits against plain training."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from figure_checks import assert_report_ready, recording
from per_example_grads.apps import cli, dp_demo
from tolerances import ACCOUNTING_COMPOSED_RTOL

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory) -> SimpleNamespace:
    """One in-process ``pegrad demo --dp --fast`` run, shared by the tests below.

    ``run_dp_demo`` is wrapped so the dict it returns can be checked as well
    as what the command printed.
    """
    out_dir = tmp_path_factory.mktemp("dp_demo_out")
    returned = []
    real_run_dp_demo = dp_demo.run_dp_demo

    def recording_run_dp_demo(*args, **kwargs):
        returned.append(real_run_dp_demo(*args, **kwargs))
        return returned[-1]

    stdout = io.StringIO()
    figures = []
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setattr(dp_demo, "run_dp_demo", recording_run_dp_demo)
        mp.setattr(dp_demo, "dp_training_figure", recording(figures, dp_demo.dp_training_figure))
        status = cli.main(["demo", "--dp", "--fast", "--out", str(out_dir), "--seed", "0"])
    assert len(returned) == 1
    return SimpleNamespace(
        status=status, out_dir=out_dir, stdout=stdout.getvalue(), result=returned[0], figures=figures
    )


@pytest.mark.slow
def test_dp_demo_exits_zero_and_writes_png(dp_run):
    import matplotlib.image

    assert dp_run.status == 0
    png = dp_run.out_dir / dp_demo.PLOT_NAME
    assert dp_run.result["png_path"] == str(png)
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert image.shape[0] >= 300 and image.shape[1] >= 600  # two panels side by side
    assert image.std() > 0  # not a blank canvas


@pytest.mark.slow
def test_dp_plot_names_model_data_and_privacy_parameters(dp_run):
    (fig,) = dp_run.figures
    r = dp_run.result
    assert_report_ready(
        fig,
        panels=2,
        title_has=[
            "DP-SGD against non-private training",
            "digits_dp_mlp",
            "4,810 parameters",
            "UCI handwritten digits",
            "1,438 training, 359 test examples",
            "Test accuracy after each epoch",
            f"C = {r['l2_norm_clip']:g}",
        ],
        legend_has=[
            f"ε = {r['epsilon']:.2f}",
            f"δ = {r['delta']:g}",
            f"σ = {r['noise_multiplier']:.3f}",
            f"q = {r['sampling_probability']:.4f}",
            f"{r['steps']} steps",
            f"final test accuracy {r['private_accuracy']:.3f}",
            f"final test accuracy {r['nonprivate_accuracy']:.3f}",
            "Not covered by the (ε, δ) guarantee",
        ],
    )
    acc_ax, clip_ax = fig.axes
    assert acc_ax.get_ylabel() == "test accuracy (fraction of 359 examples)"
    assert clip_ax.get_xlabel() == "DP-SGD step"


@pytest.mark.slow
def test_dp_demo_spends_at_most_the_target_epsilon(dp_run):
    r = dp_run.result
    assert r["target_epsilon"] == dp_demo.DEFAULT_TARGET_EPSILON
    assert r["delta"] == dp_demo.DEFAULT_DELTA
    # Accounted by the PLD accountant for the steps DPModel counted.
    assert 0 < r["epsilon"] <= r["target_epsilon"]
    # The calibrated sigma is the smallest that meets the target (to rtol 1e-3),
    # so the budget is nearly all spent rather than wasted on extra noise.
    assert r["epsilon"] > 0.9 * r["target_epsilon"]
    assert r["epsilon_check"] == pytest.approx(r["epsilon"], rel=ACCOUNTING_COMPOSED_RTOL)
    assert r["epsilon_rdp"] > 0
    assert r["noise_multiplier"] > 0


@pytest.mark.slow
def test_dp_demo_step_schedule(dp_run):
    r = dp_run.result
    assert r["epochs"] == dp_demo.FAST_EPOCHS
    assert r["train_size"] == 1438 and r["test_size"] == 359
    assert r["sampling_probability"] == dp_demo.EXPECTED_BATCH_SIZE / r["train_size"]  # the same division
    assert r["steps"] == r["planned_steps"] == round(r["epochs"] / r["sampling_probability"])
    assert len(r["private_curve"]) == len(r["nonprivate_curve"]) == r["epochs"]


@pytest.mark.slow
def test_dp_demo_accuracies(dp_run):
    r = dp_run.result
    assert r["private_accuracy"] == r["private_curve"][-1]
    assert r["nonprivate_accuracy"] == r["nonprivate_curve"][-1]
    assert r["private_accuracy"] > 0.5  # chance is 0.1
    assert r["nonprivate_accuracy"] >= r["private_accuracy"] - 0.05
    for accuracy in r["private_curve"] + r["nonprivate_curve"]:
        assert 0.0 <= accuracy <= 1.0


@pytest.mark.slow
def test_dp_demo_clipped_fraction_per_step(dp_run):
    fractions = np.asarray(dp_run.result["clipped_fraction"])
    assert fractions.shape == (dp_run.result["steps"],)
    assert np.all((fractions >= 0) & (fractions <= 1))
    assert np.all(np.isfinite(fractions))


@pytest.mark.slow
def test_dp_demo_prints_the_comparison(dp_run):
    r = dp_run.result
    out = dp_run.stdout
    assert re.search(rf"^private \(DP-SGD\)\s+{r['private_accuracy']:.3f}\s+{r['epsilon']:.2f}\s", out, re.M)
    assert re.search(rf"^non-private\s+{r['nonprivate_accuracy']:.3f}\s+inf\s", out, re.M)
    for label, value in [
        ("noise multiplier sigma", f"{r['noise_multiplier']:.4f}"),
        ("sampling probability q", f"{r['sampling_probability']:.4f}"),
        ("steps", str(r["steps"])),
        ("clip norm", f"{r['l2_norm_clip']:g}"),
        (r"epsilon \(PLD\), compute_epsilon", f"{r['epsilon_check']:.4f}"),
    ]:
        assert re.search(rf"^{label}\s+{re.escape(value)}$", out, re.M), label
    assert "Wall time of the demo" in out
    # Every column and row is explained under its table.
    assert "test accuracy: share of the 359 held-out digits" in out
    assert "epsilon (PLD): the privacy spent at delta = 1e-05" in out and "train s: wall-clock seconds" in out
    assert "sigma: noise standard deviation / clip norm; q: the chance" in out


# --- argument handling, without training ------------------------------------------


def test_cli_dp_passes_its_arguments(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(dp_demo, "run_dp_demo", lambda *a, **k: calls.append((a, k)))
    out = str(tmp_path / "o")
    argv = ["demo", "--dp", "--out", out, "--seed", "3", "--target-epsilon", "2.5", "--epochs", "7"]
    assert cli.main(argv) == 0
    assert calls == [((out,), {"target_epsilon": 2.5, "epochs": 7, "fast": False, "seed": 3})]
    calls.clear()
    assert cli.main(["demo", "--dp", "--fast"]) == 0
    ((_, kwargs),) = calls
    assert kwargs["target_epsilon"] == dp_demo.DEFAULT_TARGET_EPSILON
    assert kwargs["fast"] is True and kwargs["epochs"] is None


def test_cli_dp_validation(capsys):
    args = cli.build_parser().parse_args(["demo"])
    assert (args.dp, args.target_epsilon) == (False, None)
    with pytest.raises(SystemExit):
        cli.main(["demo", "--target-epsilon", "2"])
    assert "--target-epsilon needs --dp" in capsys.readouterr().err
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            cli.main(["demo", "--dp", "--target-epsilon", bad])
        assert "--target-epsilon" in capsys.readouterr().err


def test_run_dp_demo_rejects_bad_arguments(tmp_path: Path):
    with pytest.raises(ValueError, match="epochs"):
        dp_demo.run_dp_demo(tmp_path, epochs=0, verbose=False)
    with pytest.raises(ValueError, match="target_epsilon"):
        dp_demo.run_dp_demo(tmp_path, target_epsilon=0.0, verbose=False)
