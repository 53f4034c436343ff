"""End-to-end tests of ``pegrad demo`` and the bundled digits data."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import per_example_grads as peg
from figure_checks import assert_report_ready, recording
from per_example_grads import plots
from per_example_grads.apps import cli, demo
from per_example_grads.data import load_digits, train_test_split_digits

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> SimpleNamespace:
    """One in-process ``pegrad demo --fast`` run, shared by the tests below.

    ``run_demo`` is wrapped so the dict it returns can be checked as well as
    what the command printed.
    """
    out_dir = tmp_path_factory.mktemp("demo_out")
    returned = []

    def recording_run_demo(*args, **kwargs):
        returned.append(real_run_demo(*args, **kwargs))
        return returned[-1]

    real_run_demo = demo.run_demo
    stdout = io.StringIO()
    figures = []
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setattr(demo, "run_demo", recording_run_demo)
        mp.setattr(plots, "norms_histogram_figure", recording(figures, plots.norms_histogram_figure))
        status = cli.main(["demo", "--fast", "--out", str(out_dir), "--seed", "0"])
    assert len(returned) == 1
    return SimpleNamespace(
        status=status, out_dir=out_dir, stdout=stdout.getvalue(), result=returned[0], figures=figures
    )


def _class_counts(text: str) -> dict[int, int]:
    """``{class: count}`` from the per-class table printed by the demo."""
    lines = text.splitlines()
    header = re.compile(r"class\s+count\s+mean\s+median\s+max")
    start = next(i for i, line in enumerate(lines) if header.match(line))
    counts = {}
    for line in lines[start + 2 :]:
        match = re.match(r"(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)$", line.strip())
        if not match:
            break
        assert all(np.isfinite(float(match.group(k))) for k in (3, 4, 5)), line
        counts[int(match.group(1))] = int(match.group(2))
    return counts


def _check_png(path: Path) -> None:
    import matplotlib.image

    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert image.shape[0] >= 200 and image.shape[1] >= 300
    assert image.std() > 0  # not a blank canvas


# --- pegrad demo, in-process -------------------------------------------------


@pytest.mark.slow
def test_demo_exits_zero_and_writes_png(demo_run):
    assert demo_run.status == 0
    png = demo_run.out_dir / "norms_histogram.png"
    assert demo_run.result["png_path"] == str(png)
    _check_png(png)


@pytest.mark.slow
def test_demo_histogram_names_model_and_data_and_labels_its_axes(demo_run):
    (fig,) = demo_run.figures
    norms = demo_run.result["norms"]
    assert_report_ready(
        fig,
        panels=1,
        title_has=[
            "Per-example gradient norms",
            "digits_mlp",
            "4,810 parameters",
            "1 training epoch)",
            f"on {len(norms)} UCI handwritten digits",
        ],
        legend_has=[
            f"N = {len(norms)} examples",
            f"median {np.median(norms):.3g}",
            f"95th percentile {np.percentile(norms, 95):.3g}",
            f"max {norms.max():.3g}",
        ],
    )
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and "log scale" in ax.get_xlabel()
    assert ax.get_ylabel() == "examples per bin"
    # Plain numbers on the log axis (0.5, 1, 2, 5), not 10^0-style labels.
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert labels and all("10^" not in t and "mathdefault" not in t for t in labels), labels


@pytest.mark.slow
def test_demo_explains_its_columns_and_marks(demo_run):
    out = demo_run.stdout
    assert "norm: the L2 norm of one example's own loss gradient over all 4,810 parameters" in out
    assert "index: row of per_example_grads.data.load_digits()" in out
    assert "marked * when it differs from the label (misclassified)" in out
    assert "ms/batch: milliseconds per call" in out and "vs batch grad: that time over the first row's" in out
    assert 'auto: what method="auto" runs' in out
    assert out.startswith("TensorFlow ")  # the device line, instead of TensorFlow's cuInit message


@pytest.mark.slow
def test_demo_prints_stats_for_every_class(demo_run):
    counts = _class_counts(demo_run.stdout)
    assert sorted(counts) == list(range(10))
    assert counts == {c: s["count"] for c, s in demo_run.result["norm_stats"].items()}
    assert sum(counts.values()) == demo_run.result["train_size"] == demo.FAST_TRAIN_SIZE


@pytest.mark.slow
def test_demo_norms_are_finite_and_positive(demo_run):
    norms = demo_run.result["norms"]
    assert norms.shape == (demo_run.result["train_size"],)
    assert np.all(np.isfinite(norms))
    assert np.all(norms > 0)
    for stats in demo_run.result["norm_stats"].values():
        assert stats["count"] > 0
        assert 0 < stats["median"] <= stats["max"]
        assert 0 < stats["mean"] <= stats["max"]


@pytest.mark.slow
def test_demo_fast_accuracy_well_above_chance(demo_run):
    assert demo_run.result["epochs"] == 1
    assert demo_run.result["test_accuracy"] > 0.5  # chance is 0.1


@pytest.mark.slow
def test_demo_top_examples_are_the_largest_norms(demo_run):
    result = demo_run.result
    top = result["top_examples"]
    assert len(top) == demo.TOP_K
    top_norms = [e["norm"] for e in top]
    assert top_norms == sorted(top_norms, reverse=True)
    assert top_norms[0] == result["norms"].max()  # the same number, not recomputed
    _, y = load_digits()
    for e in top:
        assert y[e["index"]] == e["label"]
        assert 0 <= e["predicted"] < 10
        assert str(e["index"]) in demo_run.stdout


@pytest.mark.slow
def test_demo_times_every_method(demo_run):
    timings = demo_run.result["timings"]
    assert list(timings) == [demo.BASELINE] + [m for m in peg.METHODS if m != "auto"] + ["auto"]
    for name, t in timings.items():
        assert np.isfinite(t["ms"]) and t["ms"] > 0, name
        assert t["ratio"] == t["ms"] / timings[demo.BASELINE]["ms"]  # the same float64 division
        assert re.search(rf"^{re.escape(name)}\s+\d+\.\d+\s+\d+\.\dx$", demo_run.stdout, re.M)


# --- pegrad as a program -------------------------------------------------------


@pytest.mark.slow
def test_demo_as_subprocess(tmp_path):
    out_dir = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "per_example_grads.apps.cli", "demo", "--fast", "--out", str(out_dir)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_png(out_dir / "norms_histogram.png")
    assert sorted(_class_counts(proc.stdout)) == list(range(10))
    assert "Test accuracy" in proc.stdout


def test_pegrad_console_script_points_at_main():
    (entry,) = [ep for ep in importlib.metadata.entry_points(group="console_scripts") if ep.name == "pegrad"]
    assert entry.value == "per_example_grads.apps.cli:main"
    assert entry.load() is cli.main


def test_cli_without_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_cli_demo_defaults_and_validation(capsys):
    args = cli.build_parser().parse_args(["demo"])
    assert (args.out, args.fast, args.epochs, args.seed) == ("pegrad_out", False, None, 0)
    with pytest.raises(SystemExit):
        cli.main(["demo", "--epochs", "0"])
    assert "--epochs" in capsys.readouterr().err


# --- the digits data -------------------------------------------------------------


def test_load_digits_shapes_dtypes_ranges():
    x, y = load_digits()
    assert x.shape == (1797, 64) and x.dtype == np.float32
    assert y.shape == (1797,) and y.dtype == np.int32
    assert x.min() == 0.0 and x.max() == 1.0
    np.testing.assert_array_equal(x * 16, np.round(x * 16))  # 17 grey levels
    assert y.min() == 0 and y.max() == 9
    assert np.all(np.bincount(y, minlength=10) >= 170)


def test_train_test_split_digits():
    x, y = load_digits()
    split = train_test_split_digits(seed=0, test_fraction=0.2)
    assert len(split.x_train) == len(split.y_train) == len(split.train_index) == 1438
    assert len(split.x_test) == len(split.y_test) == len(split.test_index) == 359
    both = np.concatenate([split.train_index, split.test_index])
    assert sorted(both.tolist()) == list(range(1797))
    np.testing.assert_array_equal(split.x_train, x[split.train_index])
    np.testing.assert_array_equal(split.y_test, y[split.test_index])
    again = train_test_split_digits(seed=0, test_fraction=0.2)
    np.testing.assert_array_equal(again.test_index, split.test_index)
    other = train_test_split_digits(seed=1, test_fraction=0.2)
    assert not np.array_equal(other.test_index, split.test_index)
    with pytest.raises(ValueError, match="test_fraction"):
        train_test_split_digits(test_fraction=1.0)
