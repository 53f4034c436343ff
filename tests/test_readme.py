"""The README's runnable examples run as written."""

import pathlib
import re

import pytest

import per_example_grads as peg

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _first_python_block_under(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(f"\n## {heading}\n"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_private_fine_tuning_of_a_keras_hub_model_runs(capsys):
    code = _first_python_block_under("Private fine-tuning of a KerasHub model")
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    dp = namespace["dp"]
    assert int(dp.dp_steps.numpy()) == 2 * 8  # two epochs of round(1/q) = 8 Poisson steps
    assert namespace["lm"].backbone.token_embedding.trainable_variables == []  # LoRA: only adapters train
    printed = float(capsys.readouterr().out.split("epsilon = ")[1])
    # The same 16 Poisson steps accounted independently of the model (ceil(2 / q) = 16).
    expected = peg.dp.compute_epsilon(256, 32, 2, noise_multiplier=0.8, delta=1e-3)
    assert printed == pytest.approx(expected, abs=0.005)  # printed to 2 decimals
