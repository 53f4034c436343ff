"""The scripts in examples/ run in their quick mode, and what they print holds against an independent reference."""

from __future__ import annotations

import importlib.util
import pathlib
import warnings

import pytest

import per_example_grads as peg

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _main(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_every_example_has_a_quick_mode_and_a_test():
    names = sorted(p.stem for p in EXAMPLES.glob("*.py"))
    tested = sorted(n.removeprefix("test_") for n in globals() if n.removeprefix("test_") in names)
    assert names == tested
    for name in names:
        assert "--quick" in (EXAMPLES / f"{name}.py").read_text(), name


@pytest.mark.slow
def test_private_digits(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the budget's stop, if it comes
        result = _main("private_digits")(["--quick", "--epsilon", "3"])
    # The steps taken, accounted independently of the model, are within the target.
    expected = peg.dp.compute_epsilon(1500, 64, None, result["noise_multiplier"], 1e-5, steps=result["steps"])
    assert result["epsilon"] == pytest.approx(expected, rel=1e-9) and expected <= 3.0
    assert result["test_accuracy"] > 0.3  # far above chance (0.1) after 2 private epochs


@pytest.mark.slow
def test_bandmf_vs_dpsgd(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    result = _main("bandmf_vs_dpsgd")(["--quick", "--epsilon", "2"])
    band = peg.dp.BandMF(bands=4, num_steps=16)
    for name, mechanism in (("DP-SGD", None), ("BandMF(4)", band)):
        run = result[name]
        expected = peg.dp.compute_epsilon(1500, 32, None, run["noise_multiplier"], 1e-5, steps=16, mechanism=mechanism)
        assert run["epsilon"] == pytest.approx(expected, rel=1e-9)
        assert expected == pytest.approx(2.0, rel=2e-3)  # calibrated to the target (rtol 1e-3 of the search)


@pytest.mark.slow
def test_diagnostics_during_training(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    result = _main("diagnostics_during_training")(["--quick"])
    assert all(r["noise_scale"] > 0 and len(r["hardest"]) == 3 for r in result.values())
    assert (tmp_path / "diagnostics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_parameter_server(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    result = _main("parameter_server")(["--quick"])
    # The server's accountant, checked against dp-accounting's composition of the same 5 steps.
    expected = peg.dp.compute_epsilon(1797, 0.02 * 1797, None, 1.1, 1e-5, steps=5)
    assert result["steps"] == 5 and result["epsilon"] == pytest.approx(expected, rel=1e-12)
