"""``pegrad`` failures: one line on stderr, exit 2 (the arguments) or 1 (the system), nothing half-written.

Each case runs ``cli.main`` in-process and stops before training, except
the full-disk ones, which need a run to get to its writes. A read-only
folder is a folder chmod'ed 0o500, or, where that does not stop this
process (root), one whose file and folder creation is refused by patched
``os.open`` and ``os.mkdir``.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from per_example_grads.apps import cli, demo, diagnose, dp_demo, tables
from per_example_grads.diagnostics.report import GradientReport
from per_example_grads.dp import accounting

EPSILON = ["epsilon", "--num-examples", "1000", "--batch-size", "10", "--delta", "1e-5"]
DEMOS = {"demo": ["demo", "--fast"], "demo --dp": ["demo", "--dp", "--fast"], "diagnose": ["diagnose", "--fast"]}


def error_line(err: str, command: str, *, after_progress: bool = False) -> str:
    """The one line of ``err``, checked to be ``pegrad COMMAND: error: ...``.

    With ``after_progress``, the run's progress bars (tqdm, on stderr) may
    come before it.
    """
    assert "Traceback" not in err
    *before, line = err.removesuffix("\n").split("\n")
    assert line.startswith(f"pegrad {command}: error: "), err
    bars = [bar for text in before for bar in text.split("\r") if bar.strip()]
    assert all("%|" in bar for bar in bars) if after_progress else before == [], err
    return line


def listing(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (temporaries included) and its contents."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def no_tensorflow_start(monkeypatch):
    """Fails the test if the command gets as far as starting TensorFlow (and so training)."""

    def refuse(**kwargs):
        raise AssertionError("the command started TensorFlow before failing")

    monkeypatch.setattr(cli, "_start_tensorflow", refuse)


@pytest.fixture
def read_only(tmp_path, monkeypatch) -> Path:
    """A folder in which neither files nor folders can be created."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        (folder / "try").touch()
    except PermissionError:
        pass
    else:  # root: the mode does not apply; refuse the calls instead
        (folder / "try").unlink()
        real_open, real_mkdir = os.open, os.mkdir

        def inside(path) -> bool:
            return Path(os.path.abspath(path)).is_relative_to(folder)

        def refusing(real):
            def call(path, *args, **kwargs):
                if inside(path):
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
                return real(path, *args, **kwargs)

            return call

        monkeypatch.setattr(os, "open", refusing(real_open))
        monkeypatch.setattr(os, "mkdir", refusing(real_mkdir))
    yield folder
    folder.chmod(0o700)


# --- the arguments: exit 2 ---------------------------------------------------------


@pytest.mark.parametrize("command", ["demo", "diagnose"])
@pytest.mark.parametrize(
    "seed, message",
    [
        ("-1", r"must be in \[0, 4294967295\]; got -1"),
        ("4294967296", r"must be in \[0, 4294967295\]; got 4294967296"),
        ("1.5", r"not a whole number: '1.5'"),
    ],
)
def test_a_bad_seed_is_a_usage_error(capsys, no_tensorflow_start, command, seed, message):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--seed", seed])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: pegrad {command} ")
    assert "Traceback" not in err
    assert re.fullmatch(rf"pegrad {command}: error: argument --seed: {message}", err.splitlines()[-1])


def test_the_largest_seed_is_taken():
    assert cli.build_parser().parse_args(["demo", "--seed", "4294967295"]).seed == 2**32 - 1


@pytest.mark.parametrize("command", DEMOS)
@pytest.mark.parametrize("under", [False, True], ids=["file", "under-a-file"])
def test_out_that_cannot_be_a_folder_is_one_line_and_status_2(tmp_path, capsys, no_tensorflow_start, command, under):
    existing = tmp_path / "a_file"
    existing.write_bytes(b"mine")
    out = existing / "sub" if under else existing
    assert cli.main([*DEMOS[command], "--out", str(out)]) == 2
    line = error_line(capsys.readouterr().err, command.split()[0])
    expected = f"cannot be created: {existing} is not a folder" if under else "exists and is not a folder"
    assert line.endswith(f"--out {out} {expected}"), line
    assert listing(tmp_path) == {"a_file": b"mine"}


# --- the system: exit 1 ------------------------------------------------------------


@pytest.mark.parametrize("command", DEMOS)
@pytest.mark.parametrize("sub", [False, True], ids=["folder", "subfolder"])
def test_a_read_only_out_fails_before_training_with_status_1(read_only, capsys, no_tensorflow_start, command, sub):
    out = read_only / "sub" if sub else read_only
    assert cli.main([*DEMOS[command], "--out", str(out)]) == 1
    line = error_line(capsys.readouterr().err, command.split()[0])
    assert re.search(rf"--out {re.escape(str(out))} cannot be written \(\[Errno 13\] Permission denied", line), line
    assert list(read_only.iterdir()) == []


def test_the_folder_check_leaves_no_folder_or_probe_behind(tmp_path):
    tables.check_output_folder(tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    tables.check_output_folder(tmp_path / "kept")
    assert list((tmp_path / "kept").iterdir()) == []


def full_disk(*args, **kwargs):
    """A writer ``(obj, path, ...)`` that gets part of the file out, then finds the disk full."""
    Path(args[1]).write_bytes(b"part of a file")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory) -> list[str]:
    """A saved 8-feature, 3-class linear model and 20 examples for it."""
    d = tmp_path_factory.mktemp("model_and_data")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.save(d / "model.keras")
    rng = np.random.default_rng(0)
    np.savez(d / "data.npz", x=rng.standard_normal((20, 8)).astype("float32"), y=rng.integers(0, 3, 20))
    return [str(d / "model.keras"), str(d / "data.npz")]


@pytest.mark.parametrize("failing", ["report.json", "report.png", "norms_histogram.png"])
def test_diagnose_on_a_full_disk_leaves_none_of_its_files(tmp_path, capsys, monkeypatch, model_and_data, failing):
    writers = {
        "report.json": (diagnose, "_write_json"),
        "report.png": (GradientReport, "save_png"),
        "norms_histogram.png": (demo, "save_norms_histogram"),
    }
    monkeypatch.setattr(*writers[failing], full_disk)
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.json").write_bytes(b"the last run's")
    assert cli.main(["diagnose", *model_and_data, "--out", str(out)]) == 1
    line = error_line(capsys.readouterr().err, "diagnose", after_progress=True)
    assert line.endswith(f"could not write {out / failing} ([Errno 28] No space left on device)"), line
    assert listing(out) == {"report.json": b"the last run's"}


@pytest.mark.slow  # trains the demo for an epoch
def test_demo_on_a_full_disk_leaves_no_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(demo, "time_methods", lambda *a, **k: {demo.BASELINE: {"ms": 1.0, "ratio": 1.0}})
    monkeypatch.setattr(demo, "save_norms_histogram", full_disk)
    out = tmp_path / "out"
    assert cli.main(["demo", "--fast", "--out", str(out)]) == 1
    line = error_line(capsys.readouterr().err, "demo", after_progress=True)
    assert line.endswith(f"could not write {out / demo.HISTOGRAM_NAME} ([Errno 28] No space left on device)")
    assert listing(out) == {}


# --- writing all or nothing --------------------------------------------------------


def test_write_files_replaces_every_target_and_leaves_no_temporaries(tmp_path):
    (tmp_path / "a").write_text("old a")
    written = tables.write_files(
        {
            tmp_path / "a": lambda p: p.write_text("new a"),
            tmp_path / "sub" / "b": lambda p: p.write_text("new b"),
        }
    )
    assert written == [tmp_path / "a", tmp_path / "sub" / "b"]
    assert listing(tmp_path) == {"a": b"new a", "sub/b": b"new b"}
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("failure", [KeyboardInterrupt, ValueError])
def test_write_files_interrupted_or_failing_leaves_the_old_files(tmp_path, failure):
    (tmp_path / "a").write_text("old a")

    def fails(path):
        path.write_text("half")
        raise failure

    with pytest.raises(failure):  # not an OSError: propagated as it is
        tables.write_files({tmp_path / "a": lambda p: p.write_text("new a"), tmp_path / "b": fails})
    assert listing(tmp_path) == {"a": b"old a"}


# --- pegrad epsilon ----------------------------------------------------------------


@pytest.mark.parametrize(
    "where, error, goal",
    [
        (
            "noise_multiplier_for_epsilon",
            ValueError("no noise multiplier meets epsilon 1e+09\nmore detail"),
            ["--target-epsilon", "1e9"],
        ),
        ("compute_epsilon", OverflowError("math range error"), ["--noise-multiplier", "1"]),
        ("dp_sgd_schedule", ValueError("give epochs or steps, not both"), ["--noise-multiplier", "1"]),
    ],
    ids=["hopeless", "overflow", "conflicting"],
)
def test_what_the_accounting_refuses_is_one_line_and_status_2(capsys, monkeypatch, where, error, goal):
    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(accounting, where, refuse)
    assert cli.main([*EPSILON, "--epochs", "1", *goal]) == 2
    line = error_line(capsys.readouterr().err, "epsilon")
    assert line == f"pegrad epsilon: error: {str(error).splitlines()[0]}"


def test_a_dp_demo_target_nothing_meets_is_one_line_and_status_2(tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise ValueError("epsilon 1e+09 is beyond any noise multiplier")

    monkeypatch.setattr(dp_demo, "noise_multiplier_for_epsilon", refuse)
    out = tmp_path / "out"
    assert cli.main(["demo", "--dp", "--fast", "--target-epsilon", "1e9", "--out", str(out)]) == 2
    line = error_line(capsys.readouterr().err, "demo")
    assert line == (
        "pegrad demo: error: no noise multiplier for epsilon <= 1e+09 at delta = 1e-05: "
        "epsilon 1e+09 is beyond any noise multiplier"
    )
    assert not out.exists()


def test_epochs_beyond_the_pld_accountant_answer_with_rdp_and_say_so(capsys):
    # Before: the PLD accountant tried to allocate 221 TiB and raised MemoryError.
    assert cli.main([*EPSILON, "--epochs", "1e12", "--noise-multiplier", "1"]) == 0
    captured = capsys.readouterr()
    assert "epsilon comes from the RDP accountant" in captured.err
    expected = accounting.compute_epsilon(1000, 10, 1e12, 1.0, 1e-5, accountant="rdp")
    assert f"epsilon = {expected:.6g} at delta" in captured.out


@pytest.mark.slow  # two accountings, one past PLD's bounds
def test_epsilon_names_the_accountant_that_answered(capsys):
    # Past PLD's cost bounds the RDP accountant answers: the line says rdp, not the pld asked for.
    assert cli.main([*EPSILON, "--epochs", "1e12", "--noise-multiplier", "1"]) == 0
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("epsilon = ")]
    assert line and line[0].endswith("(rdp accountant)"), line
    # Within them, PLD answers and says so.
    assert cli.main([*EPSILON, "--epochs", "2", "--noise-multiplier", "1"]) == 0
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("epsilon = ")]
    assert line and line[0].endswith("(pld accountant)"), line
    expected = accounting.compute_epsilon(1000, 10, 2, 1.0, 1e-5, accountant="pld")
    assert line[0].startswith(f"epsilon = {expected:.6g} at delta")


@pytest.mark.slow  # a subprocess; needs the accounting to give up on a hopeless target at once
def test_an_unreachable_target_epsilon_is_one_line_and_status_2():
    proc = subprocess.run(
        [sys.executable, "-m", "per_example_grads.apps.cli", *EPSILON, "--epochs", "1", "--target-epsilon", "1e9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    error_line(proc.stderr, "epsilon")


def test_an_interrupt_is_one_line_and_status_130(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(accounting, "compute_epsilon", interrupted)
    assert cli.main([*EPSILON, "--steps", "10", "--noise-multiplier", "1"]) == 130
    assert capsys.readouterr().err == "pegrad epsilon: interrupted\n"


def test_a_bug_keeps_its_traceback(monkeypatch):
    def bug(*args, **kwargs):
        raise TypeError("a programming error")

    monkeypatch.setattr(accounting, "compute_epsilon", bug)
    with pytest.raises(TypeError, match="a programming error"):
        cli.main([*EPSILON, "--steps", "10", "--noise-multiplier", "1"])
