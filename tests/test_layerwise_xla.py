"""The layer-wise engine under XLA (``jit_compile=True``): the rules' switch, and the same norms and clipped sums."""

import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_clipped_sums_close, assert_norms_close, reference_gradients, reference_norms, sparse_ce
from model_zoo import layer_case, layer_case_params


def test_rules_know_when_xla_compiles_them():
    """The rules' XLA switches read a private TensorFlow check: fail loudly if it stops working."""
    from per_example_grads._core.xla_context import in_xla_context

    seen = []
    probe = lambda x: (seen.append(in_xla_context()), x)[1]  # noqa: E731
    tf.function(probe, jit_compile=True)(tf.constant(1.0))
    tf.function(probe)(tf.constant(1.0))
    assert seen == [True, False] and not in_xla_context()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    layer_case_params(
        [
            "embedding_repeated_ids",
            "embedding_mask_zero_pooled",
            "dense_sequence_gram",
            "conv2d_strided_valid",
            "layer_norm_sequence",
            "multi_head_attention",
            "lstm_fallback",
            "custom_layer_fallback",
            "reversible_tied",
            "reversible_two_lookups",
            "multi_head_attention_lora",
        ]
    ),
)
def test_norms_and_clipped_sums_under_xla_match_the_materialized_reference(name):
    """``tf.function(jit_compile=True)`` (what Keras' jit_compile does, the default on GPUs) changes nothing."""
    model, x, y = layer_case(name)
    expected = reference_gradients(model, sparse_ce, x, y)
    factors = 0.3 / np.maximum(reference_norms(expected), 0.3)
    norms_xla = tf.function(
        lambda x, y: peg.per_example_norms(model, sparse_ce, x, y, method="layerwise"), jit_compile=True
    )
    clipped_xla = tf.function(
        lambda x, y: peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.3, method="layerwise"),
        jit_compile=True,
    )
    assert_norms_close(norms_xla(x, y), expected)
    assert_clipped_sums_close(clipped_xla(x, y), expected, factors)
