"""The DP validator: it names the layers that break per-example clipping, and the slow ones."""

import keras
import pytest

import per_example_grads as peg
from per_example_grads.dp import validation


def test_validator_names_offending_and_slow_layers():
    model = keras.Sequential(
        [
            keras.Input((5, 4)),
            keras.layers.LSTM(3, return_sequences=True, name="rnn"),
            keras.layers.BatchNormalization(name="bn1"),
            keras.layers.Flatten(),
            keras.layers.BatchNormalization(name="bn2"),
            keras.layers.Dense(2),
        ]
    )
    report = validation.validate(model)
    assert len(report.errors) == 2 and "'bn1'" in report.errors[0] and "'bn2'" in report.errors[1]
    assert "GroupNormalization" in str(report) and "peg.dp.fix_model(model)" in str(report)
    assert any("'rnn'" in s for s in report.slow)
    with pytest.raises(ValueError, match="(?s)bn1.*bn2"):
        peg.keras.DPModel(model, l2_norm_clip=1.0, noise_multiplier=1.0)
    assert validation.validate(model, training=False).errors == []


def test_validator_names_a_layer_called_twice_once():
    scale = keras.layers.PReLU(name="shared_prelu")  # layer-local fallback
    inp = keras.Input((4,))
    out = keras.layers.Dense(2)(scale(keras.layers.Dense(4)(scale(inp))))
    slow = validation.validate(keras.Model(inp, out)).slow
    assert sum("'shared_prelu'" in s for s in slow) == 1
