"""Layer-wise rules for normalization layers (LayerNormalization's closed form; GroupNormalization and
BatchNormalization in inference) against the one-example loop."""

import keras
import pytest

from helpers import clipped_against_loop, rule_against_loop
from model_zoo import RULE_FAMILIES, layer_case, layer_case_params


@pytest.mark.parametrize("name", layer_case_params(sorted(RULE_FAMILIES["normalization"])))
def test_rule_matches_loop(name):
    rule_against_loop(*layer_case(name))


@pytest.mark.parametrize("clip", [1e-3, 0.3, 1e3])
@pytest.mark.parametrize("name", layer_case_params([
    "layer_norm_sequence", "layer_norm_two_axes_rank4", "layer_norm_middle_axis_no_center", "layer_norm_rms_scaling",
]))
def test_clipped_gradients_match_clipping_materialized(name, clip):
    clipped_against_loop(*layer_case(name), clip, methods=["layerwise", "vectorized"])


def test_layer_norm_uses_its_closed_form_unless_over_the_batch_axis():
    from per_example_grads.rules.normalization import LayerNormRule
    from per_example_grads.engines.capture import plan_units

    model, _, _ = layer_case("layer_norm_two_axes_rank4")
    assert [type(u.rule) for u in plan_units(model, model.trainable_variables)][0] is LayerNormRule
    over_batch = keras.layers.LayerNormalization(axis=[0, 1])
    assert LayerNormRule().unsupported(over_batch) is not None
