"""The ReversibleEmbedding rule (lookup and tied output projection) and the KerasHub language models, against the
one-example loop: per-example gradients, norms (with the lookup/projection cross term) and clipped sums.

Gemma runs with ``method="layerwise"`` only (``tf.vectorized_map`` over a whole Gemma crashes on some CPUs).
"""

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_clipped_sums_close, assert_norms_close, reference_norms, rule_against_loop, sparse_ce
from model_zoo import RULE_FAMILIES, layer_case, layer_case_params, randomize_lora
from per_example_grads.apps import zoo
from per_example_grads.engines.capture import plan_units
from per_example_grads.rules.local import LocalRule
from per_example_grads.rules.lora import DenseLoraRule, EinsumDenseLoraRule
from per_example_grads.rules.reversible_embedding import REVERSIBLE_EMBEDDING_RULE
from per_example_grads.rules.rule import rule_for
from tolerances import norm_rtol

ZOO_B = 3


def _reversible(model):
    return next(l for l in model._flatten_layers() if isinstance(l, keras.layers.ReversibleEmbedding))


def _clipped_sums_against_loop(model, x, y, expected, clip):
    """Clipped sums and their norms against the loop's; a tied table's sum is dense, an untied lookup's rows sparse."""
    norms = reference_norms(expected)
    factors = clip / np.maximum(norms, clip)
    got, got_norms = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip, return_norms=True, method="layerwise")
    assert_norms_close(got_norms, expected)
    assert_clipped_sums_close(got, expected, factors)
    return got


@pytest.mark.parametrize("name", layer_case_params(sorted(RULE_FAMILIES["reversible_embedding"])))
def test_rule_matches_loop(name):
    model, x, y = layer_case(name)
    table = _reversible(model)
    assert rule_for(table) is REVERSIBLE_EMBEDDING_RULE
    assert any(u.rule is REVERSIBLE_EMBEDDING_RULE for u in plan_units(model, model.trainable_variables))
    expected = rule_against_loop(model, x, y)
    # One global norm: the table's cross term is inside it as well.
    assert_clipped_sums_close(
        peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.05, method="layerwise"),
        expected, 0.05 / np.maximum(reference_norms(expected), 0.05),
    )


@pytest.mark.parametrize("name", ["reversible_tied", "reversible_untied"])
def test_clipped_sums_rows_stay_sparse_only_without_the_projection(name):
    model, x, y = layer_case(name)
    table = _reversible(model)
    got = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.3, method="layerwise")
    by_var = {id(v): g for v, g in zip(model.trainable_variables, got)}
    # Tied: rows plus the dense projection part; untied: the lookup's rows alone, as tape.gradient gives.
    assert isinstance(by_var[id(table.embeddings)], tf.IndexedSlices) == (not table.tie_weights)


def test_the_cross_term_matters_in_the_test_case():
    """Without the cross term 2 <S, P> the tied case's norms would be off by far more than the tolerance."""
    from per_example_grads.engines import layerwise as engine
    from per_example_grads._core.batch import make_batch
    from per_example_grads._core.problem import make_problem

    model, x, y = layer_case("reversible_tied")
    table = _reversible(model)
    problem = make_problem(model, sparse_ce, None, False, False)
    captured = engine.capture(problem, make_batch(model, x, y, None))
    calls = [(r.saved, g) for r, g in zip(captured.records, captured.grads) if r.unit.layer is table]
    assert [s[0] for s, _ in calls] == ["lookup", "reverse"]
    rule = REVERSIBLE_EMBEDDING_RULE
    together = rule.shared_squared_norms(table, calls)[0].numpy()
    apart = sum(rule.squared_norms(table, s, g)[0].numpy() for s, g in calls)
    dense = sum(np.asarray(tf.convert_to_tensor(rule.per_example(table, s, g)[0]), np.float64) for s, g in calls)
    want = np.sum(dense.reshape(len(dense), -1) ** 2, axis=1)
    # Same captured a and g, closed form against the dense tables: a squared norm doubles a norm's rounding.
    np.testing.assert_allclose(together, want, rtol=2 * norm_rtol(dense[0].size))
    assert np.max(np.abs(apart - want) / want) > 100 * norm_rtol(dense[0].size)


def test_keras_hub_class_and_lora_or_quantized_tables():
    hub = keras_hub.layers.ReversibleEmbedding(10, 4)
    hub.build()
    assert rule_for(hub) is REVERSIBLE_EMBEDDING_RULE
    model, x, y = layer_case("reversible_tied")
    table = _reversible(model)
    table.enable_lora(2)
    randomize_lora(model, np.random.default_rng(0))
    assert isinstance({id(u.layer): u for u in plan_units(model, model.trainable_variables)}[id(table)].rule, LocalRule)
    rule_against_loop(model, x, y)
    quantized = keras.layers.ReversibleEmbedding(10, 4)
    quantized.build()
    quantized.quantize("int8")
    assert REVERSIBLE_EMBEDDING_RULE.unsupported(quantized)


def _zoo_case(name, lora_rank):
    model, x, y = zoo.build(name, ZOO_B, **({"lora_rank": lora_rank} if lora_rank else {}))
    if lora_rank:
        randomize_lora(model, np.random.default_rng(1))
    return model, x, y


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [None, 4])
@pytest.mark.parametrize("name", ["gpt2_lm", "gemma_lm", "llama_lm"])
def test_keras_hub_language_models(name, lora_rank):
    model, x, y = _zoo_case(name, lora_rank)
    plan = plan_units(model, model.trainable_variables)
    units = {id(u.layer): u for u in plan}
    # The CausalLM lists the backbone's token embedding among its own layers too: still one unit, called twice.
    assert len(units) == len(plan)
    table = model.backbone.token_embedding
    assert rule_for(table) is REVERSIBLE_EMBEDDING_RULE
    if lora_rank:  # enable_lora froze the table: nothing to watch there
        assert id(table) not in units and not table.trainable_variables
    else:
        assert units[id(table)].rule is REVERSIBLE_EMBEDDING_RULE
    lora_layers = [l for l in model._flatten_layers() if getattr(l, "lora_enabled", False)]
    assert bool(lora_layers) == bool(lora_rank)
    for layer in lora_layers:
        assert isinstance(units[id(layer)].rule, (DenseLoraRule, EinsumDenseLoraRule)), layer.name
    expected = rule_against_loop(model, x, y, norms="global")
    got = _clipped_sums_against_loop(model, x, y, expected, clip=0.5 * float(np.median(reference_norms(expected))))
    assert len(got) == len(model.trainable_variables)


def _traced_shapes(fn, *args) -> set:
    """Static shapes of every tensor in ``tf.function(fn)``'s graph."""
    graph = tf.function(fn).get_concrete_function(*args).graph
    return {tuple(t.shape.as_list()) for op in graph.get_operations() for t in op.outputs if t.shape.rank is not None}


def test_norms_and_clipped_sums_never_build_per_example_tables():
    model, x, y = layer_case("reversible_tied")
    table = _reversible(model)
    per_example_table = (len(x), table.input_dim, table.output_dim)
    args = (tf.constant(x), tf.constant(y))
    # The per-example gradients are that tensor (so the check sees it where it is built)...
    assert per_example_table in _traced_shapes(lambda x, y: peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"), *args)
    # ...and the norms and clipped sums never build it.
    assert per_example_table not in _traced_shapes(lambda x, y: peg.per_example_norms(model, sparse_ce, x, y, method="layerwise"), *args)
    assert per_example_table not in _traced_shapes(
        lambda x, y: peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=1.0, method="layerwise"), *args)


@pytest.mark.slow
def test_keras_hub_bert_classifier_with_lora():
    model, x, y = _zoo_case("bert_classifier", 4)
    units = {id(u.layer): u for u in plan_units(model, model.trainable_variables)}
    lora_layers = [l for l in model._flatten_layers() if getattr(l, "lora_enabled", False)]
    assert lora_layers and all(isinstance(units[id(l)].rule, EinsumDenseLoraRule) for l in lora_layers)
    expected = rule_against_loop(model, x, y)
    _clipped_sums_against_loop(model, x, y, expected, clip=0.5 * float(np.median(reference_norms(expected))))
