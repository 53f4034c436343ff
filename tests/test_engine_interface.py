"""One engine interface for the three capabilities: per-example gradients, norms, clipped sums."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import (
    assert_clipped_sums_close,
    assert_close,
    assert_grads_close,
    assert_norms_close,
    reference_gradients,
    reference_norms,
    rule_against_loop,
    sparse_ce,
)
from model_zoo import ZOO
from per_example_grads.engines import capture as capture_module
from per_example_grads.engines import layerwise as layerwise_engine
from per_example_grads.engines import selection
from per_example_grads.engines.capture import capturing
from per_example_grads._core.problem import make_problem
from tolerances import EPS64, GRADIENT_RTOL, rounding_rtol


class Doubling(keras.layers.Layer):
    """A layer the test teaches the layer-wise engine with a rule that breaks while building."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w * 2.0


class BrokenRule(peg.LayerRule):
    def variables(self, layer):
        return [layer.w]

    def forward(self, layer, call, args, kwargs):
        raise RuntimeError("this rule cannot build")

    def per_example(self, layer, a, grads):
        raise AssertionError("never reached")


def _broken_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), Doubling(), keras.layers.Dense(3)])


def test_norms_and_clipped_sums_fall_back_like_per_example_gradients(monkeypatch):
    from per_example_grads.rules import rule as rule_module

    monkeypatch.setitem(rule_module.RULES, Doubling, BrokenRule())
    model = _broken_model()
    x = np.random.RandomState(0).normal(size=(6, 4)).astype("float32")
    y = np.arange(6) % 3
    reference = reference_gradients(model, sparse_ce, x, y)
    with pytest.warns(peg.EngineFallbackWarning, match="'layerwise' because it raised RuntimeError"):
        norms = peg.per_example_norms(model, sparse_ce, x, y)
    assert_norms_close(norms, reference)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", peg.EngineFallbackWarning)
        sums = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.1)
    assert_clipped_sums_close(sums, reference, 0.1 / np.maximum(reference_norms(reference), 0.1))
    with pytest.raises(peg.EngineError, match="method='layerwise' could not handle this model"):
        peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.1, method="layerwise")


def test_engine_error_is_the_one_refusal_type_and_a_value_error():
    assert issubclass(peg.EngineError, ValueError)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(peg.EngineError, match="cannot run on this model"):
        peg.per_example_gradients(lambda x: model(x), "mse", np.ones((2, 4)), np.zeros((2, 2)),
                                  variables=model.trainable_variables, method="layerwise")


def test_the_unit_plan_is_worked_out_once_per_call(monkeypatch):
    calls = []
    original = capture_module.plan_units
    from per_example_grads.engines import layerwise as engine

    monkeypatch.setattr(engine, "plan_units", lambda *a: calls.append(1) or original(*a))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    x, y = np.ones((5, 4), "float32"), np.arange(5) % 3
    peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=1.0)
    assert len(calls) == 1


def test_a_float64_model_with_an_embedding_gives_float64_norms_and_clipped_sums():
    keras.utils.set_random_seed(0)
    f64 = dict(dtype="float64")
    model = keras.Sequential([
        keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4, **f64),
        keras.layers.GlobalAveragePooling1D(**f64), keras.layers.Dense(3, **f64),
    ])
    x = np.random.RandomState(1).randint(0, 20, (6, 5)).astype("int32")
    y = np.arange(6) % 3
    reference = reference_gradients(model, sparse_ce, x, y)
    flat = np.concatenate([r.reshape(6, -1) for r in reference], axis=1)
    norms = peg.per_example_norms(model, sparse_ce, x, y, method="layerwise")
    sums = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.05, method="layerwise")
    assert norms.dtype == tf.float64
    rtol = rounding_rtol(flat.shape[1] + 64, EPS64)  # float64 sums over the entries and the model's path
    assert_close(norms, np.linalg.norm(flat, axis=1), rtol=rtol)
    factors = 0.05 / np.maximum(np.linalg.norm(flat, axis=1), 0.05)
    for s, r in zip(sums, reference):
        assert_close(tf.convert_to_tensor(s), np.tensordot(factors, r, axes=1), rtol=rtol, atol=rtol * 0.05 * 6)


class Reversible(keras.layers.Embedding):
    """An Embedding that is also its model's output projection (as KerasHub's ReversibleEmbedding)."""

    def call(self, inputs, reverse=False):
        if reverse:
            return keras.ops.matmul(inputs, keras.ops.transpose(self.embeddings))
        return super().call(inputs)


class TiedLM(keras.Model):
    def __init__(self):
        super().__init__()
        self.table = Reversible(12, 4)
        self.mix = keras.layers.Dense(4, activation="tanh")

    def call(self, ids):
        h = self.mix(keras.ops.mean(self.table(ids), axis=1))
        return self.table(h, reverse=True)  # [B, vocab] logits


def test_a_subclass_that_overrides_call_is_never_run_by_its_base_class_rule():
    keras.utils.set_random_seed(0)
    model = TiedLM()
    ids = np.random.RandomState(0).randint(0, 12, (5, 3)).astype("int32")
    y = np.arange(5) % 12
    plain = model(ids)
    from per_example_grads.rules.local import LocalRule
    from per_example_grads.rules.rule import rule_for

    assert isinstance(rule_for(model.table), LocalRule) or rule_for(model.table) is None
    reference = reference_gradients(model, sparse_ce, ids, y)
    for method in ["layerwise", "auto"]:
        assert_grads_close(peg.per_example_gradients(model, sparse_ce, ids, y, method=method), reference)
    assert_norms_close(peg.per_example_norms(model, sparse_ce, ids, y, method="layerwise"), reference)
    assert_close(model(ids), plain, rtol=0)  # capturing left the model as it was


@pytest.mark.parametrize("name", sorted(ZOO))
def test_capturing_leaves_every_zoo_model_computing_what_it_computes(name):
    """Rules replace each layer's call while the engine watches: the model's outputs must not change."""
    case = ZOO[name]()
    problem = make_problem(case.model, case.loss_fn, case.variables, False, False)
    reason = layerwise_engine.why_not(problem)
    if reason is not None:
        pytest.skip(f"the layer-wise engine does not cover it: {reason}")
    plain = tf.nest.flatten(case.model(case.x))
    with capturing(layerwise_engine.units_of(problem)):
        watched = tf.nest.flatten(case.model(case.x))
    for a, b in zip(watched, plain):
        # The same layers' maths, reorganized by the rules (a Dense rule's matmul and add): a few roundings.
        assert_close(a, b, rtol=GRADIENT_RTOL, atol=GRADIENT_RTOL * float(np.max(np.abs(b))))


def test_embedding_clipped_sums_in_a_graph_of_unknown_batch_size_keep_their_static_shape():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(20, 4),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    x = np.random.RandomState(1).randint(0, 20, (6, 5)).astype("int32")
    y = np.arange(6) % 3
    graph = tf.function(
        lambda a, b: peg.clipped_gradients(model, sparse_ce, a, b, l2_norm_clip=0.05),
        input_signature=[tf.TensorSpec([None, 5], tf.int32), tf.TensorSpec([None], tf.int64)],
    )
    reference = reference_gradients(model, sparse_ce, x, y)
    assert_clipped_sums_close(graph(x, y), reference, 0.05 / np.maximum(reference_norms(reference), 0.05))


class _NamedScale(keras.layers.Layer):
    """A layer whose rule is registered by the class's full name (as for an optional package's class)."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w


class _NamedScaleRule(peg.LayerRule):
    def forward(self, layer, call, args, kwargs):
        out = args[0] * layer.w
        return out, args[0], [out]

    def per_example(self, layer, saved, grads):
        return [peg.rules.sum_to_shape(saved * grads[0], layer.w.shape)]


def test_a_rule_registered_by_full_class_name_applies_and_is_exact(monkeypatch):
    monkeypatch.setattr(peg.rules.rule, "RULES", dict(peg.rules.rule.RULES))
    name = f"{_NamedScale.__module__}.{_NamedScale.__qualname__}"
    peg.register_layer_rule(name, _NamedScaleRule())
    assert isinstance(peg.rules.rule_for(_NamedScale()), _NamedScaleRule)
    model = keras.Sequential([keras.Input((3,)), _NamedScale(), keras.layers.Dense(2)])
    x, y = np.random.default_rng(0).normal(size=(4, 3)).astype("float32"), np.array([0, 1, 1, 0], "int32")
    rule_against_loop(model, x, y)
    with pytest.raises(TypeError, match="full name"):
        peg.register_layer_rule("NamedScale", _NamedScaleRule())


def test_an_engine_registered_later_is_a_valid_method(monkeypatch):
    from per_example_grads import engines

    monkeypatch.setattr(engines.base, "ENGINES", dict(engines.base.ENGINES))
    monkeypatch.setattr(selection, "ENGINES", engines.base.ENGINES)
    loop = engines.ENGINES["loop"]
    engines.register_engine(name="my_loop", isolates_examples=True)(loop.compute)
    case = ZOO["mlp"]()
    got = peg.per_example_gradients(case.model, case.loss_fn, case.x, case.y, method="my_loop")
    assert_grads_close(got, reference_gradients(case.model, case.loss_fn, case.x, case.y))
    norms = peg.per_example_norms(case.model, case.loss_fn, case.x, case.y, method="my_loop")
    assert_norms_close(norms, reference_gradients(case.model, case.loss_fn, case.x, case.y), by_variable=False)
    with pytest.raises(ValueError, match="my_loop"):
        peg.per_example_gradients(case.model, case.loss_fn, case.x, case.y, method="nope")
