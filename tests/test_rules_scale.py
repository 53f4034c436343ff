"""The LayerScale rule (ConvNeXt's y = x * gamma) against the one-example loop."""

import pytest

from helpers import clipped_against_loop, rule_against_loop
from model_zoo import RULE_FAMILIES, layer_case, layer_case_params


@pytest.mark.parametrize("name", layer_case_params(sorted(RULE_FAMILIES["scale"])))
def test_rule_matches_loop(name):
    rule_against_loop(*layer_case(name))


@pytest.mark.parametrize("clip", [1e-3, 0.3])
@pytest.mark.parametrize("name", sorted(RULE_FAMILIES["scale"]))
def test_clipped_gradients_match_clipping_materialized(name, clip):
    clipped_against_loop(*layer_case(name), clip, methods=["layerwise", "vectorized"])


def test_layer_scale_uses_its_closed_form():
    from per_example_grads.engines.capture import plan_watches

    model, _, _ = layer_case("layer_scale_rank4")
    assert [type(u.rule).__name__ for u in plan_watches(model, model.trainable_variables)] == [
        "DenseRule",
        "LayerScaleRule",
        "DenseRule",
    ]
