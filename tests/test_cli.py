"""``pegrad`` as a program: start-up without TensorFlow, quiet output, one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

# Lines TensorFlow's C++ runtime prints at import (absl's preamble, I/W/E-prefixed
# records such as the cuInit failure) and its Python-side warnings.
TF_LINE_MARKERS = ("absl::InitializeLog", "I0000", "W0000", "E0000", "cuInit", "oneDNN", "tensorflow")


def run_pegrad(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """``python -m per_example_grads.apps.cli ARGS`` in a subprocess: the process and its wall time."""
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "per_example_grads.apps.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.perf_counter() - started


def assert_no_tensorflow_lines(proc: subprocess.CompletedProcess) -> None:
    for line in (proc.stdout + proc.stderr).splitlines():
        assert not any(m in line for m in TF_LINE_MARKERS), line


@pytest.mark.parametrize(
    "args, status",
    [
        (["--help"], 0),
        (["diagnose", "--help"], 0),
        (["epsilon", "--num-examples", "5"], 2),  # required arguments missing
        (["demo", "--epochs", "0"], 2),
        (["demo", "--seed", "-1"], 2),
        (["no-such-command"], 2),
    ],
    ids=["help", "diagnose-help", "epsilon-missing-args", "demo-bad-epochs", "demo-bad-seed", "unknown-command"],
)
def test_help_and_usage_errors_answer_fast_without_tensorflow(args, status):
    proc, seconds = run_pegrad(*args)
    assert proc.returncode == status, proc.stderr
    assert_no_tensorflow_lines(proc)
    if status == 0:
        assert "usage: pegrad" in proc.stdout and proc.stderr == ""
    else:
        assert "usage: pegrad" in proc.stderr and "error:" in proc.stderr
    # Importing TensorFlow alone takes several seconds; Python and argparse
    # take well under one. Loose, since test machines vary.
    assert seconds < 3.0, seconds


def test_parsing_imports_no_tensorflow():
    code = (
        "import sys\n"
        "import per_example_grads as peg\n"
        "from per_example_grads.apps import cli\n"
        "cli.build_parser().parse_args(['diagnose', 'm.keras', 'd.npz', '--fast'])\n"
        "heavy = sorted(m for m in ('tensorflow', 'keras', 'matplotlib') if m in sys.modules)\n"
        "print(heavy, peg.__version__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "[]", proc.stdout


@pytest.mark.slow  # a subprocess that imports dp_accounting
def test_epsilon_imports_no_tensorflow():
    # pegrad epsilon (the accountant and its argument checks, and Monte Carlo for DP-SGD) runs without TensorFlow.
    code = (
        "import sys\n"
        "from per_example_grads.apps import cli\n"
        "status = cli.main(['epsilon', '--num-examples', '1000', '--batch-size', '10', '--epochs', '1',\n"
        "                   '--noise-multiplier', '1', '--delta', '1e-5'])\n"
        "status += cli.main(['epsilon', '--num-examples', '50', '--batch-size', '5', '--steps', '20',\n"
        "                    '--noise-multiplier', '1', '--delta', '1e-2', '--monte-carlo'])\n"
        "heavy = sorted(m for m in ('tensorflow', 'keras') if m in sys.modules)\n"
        "print(status, heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "0 []", proc.stdout


def test_public_names_resolve_lazily():
    import per_example_grads as peg

    listed = dir(peg)
    for name in peg.__all__:
        assert name in listed, name
        assert getattr(peg, name) is not None, name
    assert {"diagnostics", "rules", "dp", "keras"} <= set(peg.__all__)
    assert callable(peg.dp.private_gradients)
    assert callable(peg.clipping.dense_sums)  # submodules as attributes, as the README uses them
    assert callable(peg.diagnostics.gradient_statistics)
    assert peg.keras.DPModel.__name__ == "DPModel"
    assert "layerwise" in peg.METHODS
    from per_example_grads.gradients import per_example_gradients

    assert peg.per_example_gradients is per_example_gradients
    with pytest.raises(AttributeError, match="no_such_name"):
        peg.no_such_name  # noqa: B018


@pytest.mark.slow
def test_a_user_rule_for_a_builtin_layer_is_not_overwritten():
    """``peg.register_layer_rule`` loads the built-in rules first, so the user's wins."""
    code = (
        "import keras\n"
        "import per_example_grads as peg\n"
        "class Mine(peg.LayerRule):\n"
        "    pass\n"
        "peg.register_layer_rule(keras.layers.Dense, Mine())\n"
        "peg.per_example_gradients  # imports the engines and everything they need\n"
        "from per_example_grads.rules.rule import rule_for\n"
        "print(type(rule_for(keras.layers.Dense(2))).__name__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "Mine"


def test_a_command_that_loads_tensorflow_prints_none_of_its_startup_notices():
    proc, _ = run_pegrad(
        "epsilon",
        "--num-examples",
        "1000",
        "--batch-size",
        "10",
        "--steps",
        "100",
        "--noise-multiplier",
        "1",
        "--delta",
        "1e-5",
        "--accountant",
        "rdp",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""
    assert "epsilon = " in proc.stdout


def test_main_restores_the_tensorflow_logger_level(capsys):
    """``pegrad`` quiets the ``tensorflow`` logger only while its command runs."""
    import logging

    from per_example_grads.apps import cli

    logger = logging.getLogger("tensorflow")
    saved = logger.level
    try:
        logger.setLevel(logging.INFO)
        argv = [
            "epsilon",
            "--num-examples",
            "1000",
            "--batch-size",
            "10",
            "--steps",
            "10",
            "--noise-multiplier",
            "1",
            "--delta",
            "1e-5",
            "--accountant",
            "rdp",
        ]
        assert cli.main(argv) == 0
        assert logger.level == logging.INFO
        with pytest.raises(SystemExit):
            cli.main(argv[:-2] + ["--accountant", "nope"])
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(saved)
    assert "epsilon = " in capsys.readouterr().out


def test_every_package_folder_is_a_regular_package():
    """setup.cfg's ``packages = find:`` installs only folders with an ``__init__.py``; one without is left out of the wheel."""
    import pathlib

    import per_example_grads

    root = pathlib.Path(per_example_grads.__file__).parent
    folders = [d for d in [root, *root.rglob("*")] if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))]
    assert [str(d.relative_to(root)) for d in folders if not (d / "__init__.py").exists()] == []


def test_mechanisms_prints_rank_mechanisms_ranking_and_how_to_train_the_first(capsys):
    from per_example_grads.apps import cli
    from per_example_grads.dp.planning import rank_mechanisms

    argv = ["mechanisms", "--num-examples", "1000", "--batch-size", "10", "--steps", "100", "--target-epsilon", "2"]
    argv += ["--delta", "1e-5", "--bands", "2,4", "--blt-buffers", "", "--bisr-bands", "3", "--accountant", "rdp"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = rank_mechanisms(
        2.0, 1e-5, 1000, 10, 100, bands=[2, 4], blt_buffers=(), bisr_bands=(3,), accountant="rdp", progress=False
    )
    rows = [line.split() for line in lines[2:-1]]
    assert [r[1] for r in rows] == [c.name for c in expected]
    assert sorted(r[1] for r in rows) == ["BISR(3)", "BandMF(2)", "BandMF(4)", "DP-SGD"]
    for row, c in zip(rows, expected):
        assert (int(row[2]), float(row[3])) == (c.cycle_length, pytest.approx(c.sampling_probability, rel=1e-3))
        assert c.noise_multiplier <= float(row[4]) <= c.noise_multiplier * (1 + 1e-5)  # rounded up: still meets it
    assert "cycle_length=4" in lines[-1] and "BandMF(bands=4, num_steps=100" in lines[-1]


def test_mechanisms_refuses_what_the_ranking_refuses_in_one_line(capsys):
    from per_example_grads.apps import cli

    argv = ["mechanisms", "--num-examples", "1000", "--batch-size", "10", "--steps", "40", "--target-epsilon", "2"]
    assert cli.main(argv + ["--delta", "1e-5", "--blt-buffers", "2", "--accountant", "rdp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pegrad mechanisms: error: blt_buffers")
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv + ["--delta", "1e-5", "--bands", "two"])
    assert exit_.value.code == 2 and "not a whole number" in capsys.readouterr().err
