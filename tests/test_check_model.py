"""``peg.dp.check_model`` names every layer on the layer-local fallback, its class, and why it has no closed form."""

import warnings

import keras
import pytest

import per_example_grads as peg
from per_example_grads.dp import validation


class Untaught(keras.layers.Layer):
    """A layer with a weight and no rule registered for its class."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), name="w")

    def call(self, x):
        return x * self.w


class ShiftedDense(keras.layers.Dense):
    """Overrides Dense's call: the Dense rule (written for Dense.call) must not run it."""

    def call(self, x):
        return super().call(x) + 1.0


def _model():
    inp = keras.Input((4, 4, 3))
    h = keras.layers.Conv2D(2, 3, data_format="channels_first", name="cf_conv")(inp)
    h = keras.layers.Flatten()(h)
    h = Untaught(name="untaught")(h)
    h = ShiftedDense(3, name="shifted")(h)
    return keras.Model(inp, keras.layers.Dense(2, name="head")(h))


def test_every_fallback_layer_is_named_with_its_class_and_why():
    report = validation.validate(_model())
    by_name = {f.name: f for f in report.fallback}
    assert sorted(by_name) == ["cf_conv", "shifted", "untaught"]  # the plain Dense head has its closed form
    assert by_name["untaught"].class_name == "Untaught"
    assert "no rule is registered for test_check_model.Untaught" in by_name["untaught"].why
    assert "ShiftedDense overrides call of Dense" in by_name["shifted"].why
    assert by_name["cf_conv"].class_name == "Conv2D"
    assert "declines it" in by_name["cf_conv"].why and "channels_first" in by_name["cf_conv"].why
    assert report.slow == [str(f) for f in report.fallback] and report.errors == []
    for f in report.fallback:
        assert f"'{f.name}' ({f.class_name})" in str(f) and "layer-local fallback" in str(f)


def test_check_model_warns_once_with_every_fallback_layer():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = peg.dp.check_model(_model())
    assert len(caught) == 1
    text = str(caught[0].message)
    assert all(f"'{name}'" in text for name in ("cf_conv", "shifted", "untaught")) and "'head'" not in text
    assert report.fallback


def test_a_model_with_closed_forms_only_lists_nothing():
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(3), keras.layers.LayerNormalization(), keras.layers.Dense(2)]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = peg.dp.check_model(model)
    assert report.fallback == [] and report.slow == []
    assert str(report) == "All layers are supported by closed forms."


def test_kerashub_layers_with_closed_forms_are_not_listed():
    """A KerasHub layer with a closed form (registered by class name) is not listed (the zoo's models:
    tests/test_hub_zoo.py checks that check_model lists exactly their layer-local units)."""
    keras_hub = pytest.importorskip("keras_hub")
    norm = keras_hub.src.models.qwen3.qwen3_layernorm.Qwen3LayerNorm(name="qnorm")
    inp = keras.Input((3, 4))
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(norm(inp))))
    assert validation.validate(model).fallback == []
