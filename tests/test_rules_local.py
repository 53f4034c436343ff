"""The layer-local fallback (custom layers, RNNs, LoRA, PReLU) against the one-example loop, and when a rule
keeps its materialized per-example gradients for the clipped sum."""

import gc

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import (
    assert_grads_close,
    clipped_against_loop,
    gradient_scale,
    reference_gradients,
    reference_norms,
    rule_against_loop,
    sparse_ce,
)
from model_zoo import LAYER_B as B
from model_zoo import RULE_FAMILIES, Scale, layer_case, layer_case_params
from tolerances import GRADIENT_RTOL, norm_rtol, weighted_sum_rtol


@pytest.mark.parametrize("name", layer_case_params(sorted(RULE_FAMILIES["local"])))
def test_rule_matches_loop(name):
    rule_against_loop(*layer_case(name))


@pytest.mark.parametrize("name", layer_case_params(["lstm_fallback"]))
def test_clipped_gradients_match_clipping_materialized(name):
    # At the loop's median norm: examples clipped and examples left whole in one batch. The clip only scales
    # the fallback's per-example gradients after the rule has run, so one clip takes every code path there is.
    model, x, y = layer_case(name)
    norms = reference_norms(reference_gradients(model, sparse_ce, x, y))
    clip = float(np.median(norms))
    assert np.any(norms > clip) and np.any(norms <= clip)
    clipped_against_loop(model, x, y, clip, methods=["layerwise", "vectorized"])


@pytest.mark.parametrize(
    "name,layer_class,keeps",
    [
        ("layer_norm_sequence", keras.layers.LayerNormalization, True),  # [B, 6] x 2 vs [B, 4, 6] x 2
        ("custom_layer_fallback", Scale, True),  # [B, 5] vs [B, 5] + [B, 5]
        pytest.param(
            "lstm_fallback", keras.layers.LSTM, False, marks=pytest.mark.slow
        ),  # [B, 3, 16] kernel alone vs [B, 5, 3] + [B, 5, 4]
    ],
)
def test_materialized_norms_are_kept_for_the_clipped_sum_only_when_no_larger(name, layer_class, keeps):
    from per_example_grads._core.batch import make_batch
    from per_example_grads._core.problem import make_problem
    from per_example_grads.engines import layerwise as engine

    model, x, y = layer_case(name)
    problem = make_problem(model, sparse_ce, None, False, False)
    captured = engine.capture(problem, make_batch(model, x, y, None))
    record, g = next((r, g) for r, g in zip(captured.records, captured.grads) if isinstance(r.watch.layer, layer_class))
    rule, layer = record.watch.rule, record.watch.layer
    cache = {}
    norms = rule.squared_norms(layer, record.saved, g, cache)
    assert ("per_example" in cache) == keeps
    # Two computations of one layer's per-example gradients from the same captured a and g: a layer's path is
    # part of a model's, so its entries agree to GRADIENT_RTOL at most; a squared norm doubles a norm's error.
    per_example = [np.asarray(t, np.float64) for t in rule.per_example(layer, record.saved, g)]
    scale = gradient_scale(per_example)
    for got, want, t in zip(norms, rule.squared_norms(layer, record.saved, g), per_example):
        p = int(np.prod(t.shape[1:]))
        np.testing.assert_allclose(got, want, rtol=2 * norm_rtol(p), atol=2 * GRADIENT_RTOL * scale**2 * p)
    if keeps:
        w = np.linspace(0.1, 1.0, B)
        sums = zip(
            rule.weighted_sum(layer, record.saved, g, tf.constant(w, tf.float32), cache),
            rule.weighted_sum(layer, record.saved, g, tf.constant(w, tf.float32)),
            per_example,
        )
        for got, want, t in sums:
            rtol = weighted_sum_rtol(B, GRADIENT_RTOL)
            np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.max(np.tensordot(w, np.abs(t), axes=1)))


@pytest.mark.slow
def test_prelu_needs_no_rule_of_its_own_the_fallback_is_the_same_rule_and_result(monkeypatch):
    from per_example_grads.engines.capture import plan_watches
    from per_example_grads.rules import rule as rule_module
    from per_example_grads.rules.local import LOCAL_RULE

    model, x, y = layer_case("prelu")
    prelu = next(l for l in model.layers if isinstance(l, keras.layers.PReLU))
    assert rule_module.rule_for(prelu) is None  # nothing registered: the plan's fallback takes it
    assert next(u.rule for u in plan_watches(model, model.trainable_variables) if u.layer is prelu) is LOCAL_RULE
    import per_example_grads as peg

    def results():
        return [
            np.asarray(t)
            for t in [
                *peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"),
                *peg.per_example_norms(model, sparse_ce, x, y, method="layerwise", by_variable=True),
                *peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.1, method="layerwise"),
            ]
        ]

    unregistered = results()
    monkeypatch.setitem(rule_module.RULES, keras.layers.PReLU, LOCAL_RULE)  # what rules/prelu.py registered
    registered = results()
    assert all(np.array_equal(a, b) for a, b in zip(unregistered, registered))


def test_an_eager_call_reuses_the_recomputation_traced_for_its_layer_and_signature(monkeypatch):
    """Eagerly, ``tf.vectorized_map`` would trace and convert the recomputation at every call (seconds for an
    LSTM): the rule keeps one ``tf.function`` per layer and signature. Another batch of the same shapes reuses
    it and gets its own gradients (the function holds no batch's values); another batch size traces anew."""
    from per_example_grads.rules import local

    traced = []
    vectorized_map = tf.vectorized_map

    def counting(fn, elems, *args, **kwargs):
        traced.append(tf.nest.flatten(elems)[0].shape[0])
        return vectorized_map(fn, elems, *args, **kwargs)

    monkeypatch.setattr(tf, "vectorized_map", counting)
    model, x, y = layer_case("custom_layer_fallback")
    local._eager_functions.clear()
    r = np.random.default_rng(0)
    batches = [(x, y), (r.normal(size=x.shape).astype("float32"), y), (x[:3], y[:3])]
    for x_b, y_b in batches:
        got = peg.per_example_gradients(model, sparse_ce, x_b, y_b, method="layerwise")
        assert_grads_close(got, reference_gradients(model, sparse_ce, x_b, y_b))
    assert traced == [B, 3]  # the second batch reused the first's function; 3 rows is another signature
    assert [len(kept) for kept in local._eager_functions.values()] == [2]


class _Powered(keras.layers.Layer):
    """A custom layer whose call reads a plain Python attribute, ``power``."""

    power = 1

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones", name="w")

    def call(self, x):
        return (x * self.w) ** self.power


def test_an_eager_call_sees_a_layer_attribute_set_since_the_last_call():
    """The kept recomputation is keyed by the layer's plain attributes too: one set between eager calls is read anew
    (a function keyed by shapes alone would replay the first call's ``power``)."""
    from per_example_grads.rules import local

    local._eager_functions.clear()
    layer = _Powered()
    layer.build((None, 4))
    layer.w.assign([0.5, 1.0, 1.5, 2.0])
    x = tf.constant(np.random.default_rng(0).normal(size=(B, 4)), tf.float32)
    layer(x)  # as a model's forward pass would have (a first call sets Keras's own attributes)
    for power in (2, 3, 2):
        layer.power = power
        got = local.LOCAL_RULE.per_example(layer, ((x,), {}), [tf.ones([B, 4])])
        expected = power * x**power * layer.w ** (power - 1)  # d/dw of sum((x w)^p), example by example
        np.testing.assert_allclose(got[0], expected, rtol=GRADIENT_RTOL)
    assert [len(kept) for kept in local._eager_functions.values()] == [2]  # power 2's function reused


def test_an_eager_calls_kept_recomputation_keeps_neither_its_layer_nor_a_batch_alive():
    import weakref

    from per_example_grads.rules import local

    local._eager_functions.clear()
    layer = Scale()
    layer.build((None, 5))
    x = tf.constant(np.random.default_rng(0).normal(size=(B, 5)), tf.float32)
    got = local.LOCAL_RULE.per_example(layer, ((x,), {}), [tf.ones([B, 5])])
    with tf.GradientTape() as tape:  # example 0's gradient of <layer(x_0), 1>
        total = tf.reduce_sum(layer(x[:1]))
    np.testing.assert_allclose(got[0][0], tape.gradient(total, layer.w), rtol=GRADIENT_RTOL)
    assert len(local._eager_functions) == 1
    batch, owner = weakref.ref(x), weakref.ref(layer)
    del x, got, tape, total
    gc.collect()
    assert batch() is None  # the layer and its kept function alive, the batch not
    del layer
    gc.collect()
    assert owner() is None and not local._eager_functions
