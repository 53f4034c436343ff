"""Layer-wise rules for Dense and EinsumDense (MultiHeadAttention is EinsumDense layers) against the one-example loop."""

import pytest

from helpers import clipped_against_loop, rule_against_loop
from model_zoo import RULE_FAMILIES, layer_case, layer_case_params


@pytest.mark.parametrize("name", layer_case_params(sorted(RULE_FAMILIES["dense"])))
def test_rule_matches_loop(name):
    rule_against_loop(*layer_case(name))


@pytest.mark.parametrize("clip", [1e-3, 0.3, 1e3])
@pytest.mark.parametrize("name", layer_case_params(["dense_sequence_gram", "multi_head_attention"]))
def test_clipped_gradients_match_clipping_materialized(name, clip):
    # MultiHeadAttention's projections are broadcasting batch matmuls under pfor: vectorized refuses them (pfor_limits).
    clipped_against_loop(
        *layer_case(name), clip, methods=["layerwise", "vectorized" if name != "multi_head_attention" else "loop"]
    )
