"""The LoRA rules (LoRA-enabled Dense and EinsumDense) against the one-example loop, and which layers fall back."""

import keras
import numpy as np
import pytest

from helpers import clipped_against_loop, rule_against_loop
from model_zoo import LAYER_B as B
from model_zoo import RULE_FAMILIES, layer_case, layer_case_params, randomize_lora
from per_example_grads.engines.capture import plan_watches
from per_example_grads.rules.dense import DenseLoraRule
from per_example_grads.rules.einsum_dense import EinsumDenseLoraRule
from per_example_grads.rules.local import LocalRule


def _lora_layers(model):
    return [l for l in model._flatten_layers() if getattr(l, "lora_enabled", False)]


def _rules_by_layer(model):
    return {id(u.layer): u for u in plan_watches(model, model.trainable_variables)}


@pytest.mark.parametrize("name", layer_case_params(sorted(RULE_FAMILIES["lora"])))
def test_rule_matches_loop(name):
    model, x, y = layer_case(name)
    watches = _rules_by_layer(model)
    for layer in _lora_layers(model):
        watch = watches[id(layer)]
        assert isinstance(watch.rule, (DenseLoraRule, EinsumDenseLoraRule)), (layer.name, type(watch.rule))
        # The rule's variables are the layer's trainable ones: the factors (and a trainable bias), never the frozen kernel.
        assert {id(v) for v in watch.variables} == {id(v) for v in layer.trainable_variables}
    rule_against_loop(model, x, y)


@pytest.mark.parametrize("clip", [1e-3, 0.3, 1e3])
@pytest.mark.parametrize(
    "name", ["dense_lora_sequence_alpha", "einsum_dense_lora_bias_axes", "multi_head_attention_lora"]
)
def test_clipped_gradients_match_loop(name, clip):
    clipped_against_loop(*layer_case(name), clip, methods=["layerwise"])


@pytest.mark.parametrize("name", ["embedding_lora_fallback", "einsum_dense_lora_contracted_last_axis_fallback"])
def test_lora_without_a_closed_form_falls_back_exactly(name):
    model, x, y = layer_case(name)
    watches = _rules_by_layer(model)
    assert all(isinstance(watches[id(l)].rule, LocalRule) for l in _lora_layers(model))
    rule_against_loop(model, x, y)


def test_quantized_lora_layer_falls_back():
    layer = keras.layers.Dense(4)
    model = keras.Sequential([keras.Input((6,)), layer, keras.layers.Dense(3)])
    layer.quantize("int8")
    layer.enable_lora(2)
    assert isinstance(_rules_by_layer(model)[id(layer)].rule, LocalRule)


def test_lora_base_kernel_made_trainable_again_falls_back():
    model, x, y = layer_case("dense_lora")
    layer = _lora_layers(model)[0]
    layer._kernel.trainable = True
    assert isinstance(_rules_by_layer(model)[id(layer)].rule, LocalRule)
    rule_against_loop(model, x, y)


def test_float64_model():
    r = np.random.default_rng(3)
    dense = keras.layers.Dense(5, activation="tanh", dtype="float64")
    einsum = keras.layers.EinsumDense("abc,cd->abd", (3, 4), bias_axes="d", dtype="float64")
    model = keras.Sequential(
        [
            keras.Input((3, 6), dtype="float64"),
            dense,
            einsum,
            keras.layers.Flatten(dtype="float64"),
            keras.layers.Dense(3, dtype="float64"),
        ]
    )
    dense.enable_lora(2)
    einsum.enable_lora(3, lora_alpha=1)
    randomize_lora(model, r)
    x, y = r.normal(size=(B, 3, 6)), r.integers(0, 3, B).astype("int32")
    watches = _rules_by_layer(model)
    assert isinstance(watches[id(dense)].rule, DenseLoraRule) and isinstance(
        watches[id(einsum)].rule, EinsumDenseLoraRule
    )
    rule_against_loop(model, x, y)


def test_nothing_of_the_frozen_kernels_size_per_example_is_built():
    """The base kernel is [6, 7]; the LoRA factors' per-example gradients are [B, 6, 3] and [B, 3, 7]."""
    import tensorflow as tf

    import per_example_grads as peg
    from helpers import sparse_ce

    model, x, y = layer_case("dense_lora_sequence_alpha")
    args = (tf.constant(x), tf.constant(y))
    calls = {
        "per_example": lambda x, y: peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"),
        "norms": lambda x, y: peg.per_example_norms(model, sparse_ce, x, y, method="layerwise"),
        "clipped": lambda x, y: peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=1.0, method="layerwise"),
    }
    for name, fn in calls.items():
        graph = tf.function(fn).get_concrete_function(*args).graph
        shapes = {
            tuple(t.shape.as_list()) for op in graph.get_operations() for t in op.outputs if t.shape.rank is not None
        }
        assert (B, 6, 3) in shapes or name != "per_example", name  # the check sees per-example tensors
        assert (B, 6, 7) not in shapes, name
