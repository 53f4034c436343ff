"""``pegrad diagnose`` with files it cannot use: one line on stderr, exit status 2, nothing written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from per_example_grads.apps import cli  # noqa: E402
from per_example_grads.apps.diagnose import DiagnoseInputError, run_diagnose  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A folder of good and bad models and data files (an 8-feature, 3-class MLP)."""
    d = tmp_path_factory.mktemp("diagnose_inputs")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    model.save(d / "no_loss.keras")
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.save(d / "model.keras")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((20, 8)).astype("float32"), rng.integers(0, 3, 20).astype("int32")
    np.savez(d / "data.npz", x=x, y=y)
    np.savez(d / "no_y.npz", x=x, labels=y)
    np.savez(d / "objects.npz", x=np.array([{"a": 1}, 2], dtype=object), y=y[:2])
    np.savez(d / "mismatch.npz", x=x, y=y[:5])
    np.savez(d / "wrong_width.npz", x=x[:, :5], y=y)
    np.savez(d / "empty.npz", x=x[:0], y=y[:0])
    np.save(d / "single.npy", x)
    (d / "notes.txt").write_text("not data\n")
    (d / "garbage.keras").write_bytes(b"not a zip")
    (d / "data_as_model.keras").write_bytes((d / "data.npz").read_bytes())  # a zip, not a model
    (d / "a_folder.keras").mkdir()
    (d / "a_file").write_text("")
    return d


CASES = [
    # (model, data, extra arguments, the message, as a regular expression)
    ("missing.keras", "data.npz", [], r"model file not found: .*missing\.keras"),
    ("a_folder.keras", "data.npz", [], r"model file .*a_folder\.keras is a folder"),
    ("notes.txt", "data.npz", [], r"model file .*notes\.txt is not a Keras model file: expected a \.keras file"),
    ("model.keras", "missing.npz", [], r"data file not found: .*missing\.npz"),
    ("model.keras", "notes.txt", [], r"data file .*notes\.txt is not an \.npz archive: write one with numpy\.savez"),
    ("model.keras", "single.npy", [], r"data file .*single\.npy is not an \.npz archive"),
    ("model.keras", "no_y.npz", [], r"data file .*no_y\.npz must hold arrays 'x' and 'y'; it has \['labels', 'x'\]"),
    ("model.keras", "objects.npz", [], r"array 'x' in data file .*objects\.npz holds Python objects \(dtype=object\)"),
    ("model.keras", "mismatch.npz", [], r"data file .*mismatch\.npz: x has 20 examples but y has 5"),
    ("model.keras", "empty.npz", [], r"data file .*empty\.npz holds no examples"),
    ("garbage.keras", "data.npz", [], r"model file .*garbage\.keras could not be loaded \(\w+: "),
    ("data_as_model.keras", "data.npz", [], r"model file .*data_as_model\.keras could not be loaded \(\w+: "),
    (
        "no_loss.keras",
        "data.npz",
        [],
        r"model file .*no_loss\.keras was saved without a compiled loss; pass --loss NAME",
    ),
    ("model.keras", "data.npz", ["--loss", "no_such_loss"], r"--loss 'no_such_loss' is not a Keras loss name"),
    (
        "model.keras",
        "wrong_width.npz",
        [],
        r"x in data file .*wrong_width\.npz has examples of shape \(5,\); the model takes \(8,\)",
    ),
    ("model.keras", "data.npz", ["--out", "{d}/a_file"], r"--out .*a_file exists and is not a folder"),
    (
        "model.keras",
        "data.npz",
        ["--out", "{d}/a_file/sub"],
        r"--out .*a_file/sub cannot be created: .*a_file is not a folder",
    ),
]


@pytest.mark.parametrize("model, data, extra, message", CASES, ids=[f"{m}-{d}-{'-'.join(e)}" for m, d, e, _ in CASES])
def test_each_file_error_is_one_line_with_status_2_and_writes_nothing(
    files, tmp_path, capsys, model, data, extra, message
):
    out = tmp_path / "report"
    argv = ["diagnose", str(files / model), str(files / data), "--out", str(out)]
    argv += [a.format(d=files) for a in extra]
    before = sorted(p.name for p in files.iterdir())
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("pegrad diagnose: error: "), lines[0]
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert not out.exists()
    assert sorted(p.name for p in files.iterdir()) == before


@pytest.mark.slow
def test_the_good_files_do_work(files, tmp_path):
    """The fixture's model and data are fine: the errors above come from the broken ones."""
    result = run_diagnose(tmp_path / "ok", files / "model.keras", files / "data.npz", verbose=False)
    assert result["report"]["num_examples"] == 20
    assert result["report"]["per_example_norm_mean"] > 0
    # --loss given by name on a model saved without one.
    result = run_diagnose(
        tmp_path / "ok2",
        files / "no_loss.keras",
        files / "data.npz",
        loss="sparse_categorical_crossentropy",
        verbose=False,
    )
    assert result["report"]["num_examples"] == 20


def test_run_diagnose_raises_a_value_error_subclass(files, tmp_path):
    with pytest.raises(DiagnoseInputError, match="model file not found") as info:
        run_diagnose(tmp_path / "o", files / "missing.keras", files / "data.npz", verbose=False)
    assert isinstance(info.value, ValueError)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["diagnose", "only_a_model.keras"], "give both MODEL.keras and DATA.npz, or neither"),
        (["diagnose", "--batch-size", "0"], "argument --batch-size: must be >= 1; got 0"),
        (["diagnose", "--top-k", "ten"], "argument --top-k: not a whole number: 'ten'"),
        (["demo", "--target-epsilon", "2"], "--target-epsilon needs --dp"),
        (["demo", "--dp", "--target-epsilon", "nan"], "argument --target-epsilon: must be finite; got nan"),
        (
            [
                "epsilon",
                "--num-examples",
                "10",
                "--batch-size",
                "20",
                "--steps",
                "5",
                "--noise-multiplier",
                "1",
                "--delta",
                "1e-5",
            ],
            r"--batch-size \(20\) must be <= --num-examples \(10\)",
        ),
    ],
    ids=[
        "diagnose-one-file",
        "diagnose-batch-size",
        "diagnose-top-k",
        "demo-epsilon-without-dp",
        "demo-epsilon-nan",
        "epsilon-batch-too-big",
    ],
)
def test_usage_errors_end_with_one_error_line_and_status_2(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("usage: pegrad ")
    command = argv[0]
    last = err.splitlines()[-1]
    assert last.startswith(f"pegrad {command}: error: "), last
    assert re.search(message, last), last


def test_a_missing_file_is_reported_before_tensorflow_loads(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "per_example_grads.apps.cli",
            "diagnose",
            str(tmp_path / "m.keras"),
            str(tmp_path / "d.npz"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == f"pegrad diagnose: error: model file not found: {tmp_path / 'm.keras'}\n"
    assert not out.exists()
