"""Data errors are raised as themselves, once; ``auto`` falls back only on the failures engines are built around.

Every model here starts with ``Count``, which counts the model's calls (each
eager call, or each trace inside ``tf.function``), so the tests also bound how
often a data error runs the model: the engine that failed, plus the one plain
batch gradient that tells a data error from an engine's failure.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_grads_close, reference_gradients, sparse_ce
from per_example_grads.engines import selection
from per_example_grads.rules import rule as rule_module

MODES = ["eager", "tf.function"]
B = 4


class Count(keras.layers.Layer):
    """The identity, counting its calls (eager calls and traces alike)."""

    calls = 0

    def call(self, x):
        Count.calls += 1
        return x


class Timeout(Exception):
    """An exception of the user's own, raised from inside the model."""


class RaisesTimeout(keras.layers.Layer):
    def call(self, x):
        raise Timeout("the step ran past its deadline")

    def compute_output_shape(self, shape):
        return shape


class FailingDense(keras.layers.Dense):
    """A Dense that runs; the tests teach the layer-wise engine a rule for it that fails."""


class FailingRule(peg.LayerRule):
    """A rule whose forward raises ``error``: the layer-wise engine fails, the plain model call does not."""

    def __init__(self, error):
        self.error = error

    def variables(self, layer):
        return [layer.kernel, layer.bias]

    def forward(self, layer, call, args, kwargs):
        raise self.error

    def per_example(self, layer, a, grads):
        raise AssertionError("never reached")


@pytest.fixture(autouse=True)
def _every_fallback_warns(monkeypatch):
    """A fresh record of the fallback warnings given, which fire once per engine and reason in a process."""
    monkeypatch.setattr(selection, "_warned", set())


def mlp(*middle):
    return keras.Sequential([keras.Input((6,)), Count(), *middle, keras.layers.Dense(3)])


def data(n_classes=3):
    r = np.random.default_rng(0)
    return r.normal(size=(B, 6)).astype("float32"), (np.arange(B) % n_classes).astype("int32")


def gradients(mode, model, x, y, **kwargs):
    """``per_example_gradients`` eagerly, or traced and run in a ``tf.function``; counts the model's calls from 0."""
    Count.calls = 0
    if mode == "eager":
        return peg.per_example_gradients(model, sparse_ce, x, y, **kwargs)
    return tf.function(lambda x, y: peg.per_example_gradients(model, sparse_ce, x, y, **kwargs))(x, y)


def assert_raised_as_itself(err):
    """Nothing of the engines chained onto a data error: no cause, and no EngineError in its context."""
    assert err.__cause__ is None
    context = err.__context__
    while context is not None:
        assert not isinstance(context, peg.EngineError), context
        context = context.__context__


# The engine that failed and the plain call: one call each (a trace each inside tf.function).
@pytest.mark.parametrize("method", ["auto", "layerwise", "vectorized", "loop"])
@pytest.mark.parametrize("mode", MODES)
def test_wrong_feature_size_is_raised_as_itself(mode, method):
    x, y = data()
    with pytest.raises(
        ValueError, match=r"expected axis -1 of input shape to have value 6, but received input with shape \(.*, 5\)"
    ) as info:
        gradients(mode, mlp(), x[:, :5], y, method=method)
    assert not isinstance(info.value, peg.EngineError)
    if mode == "eager":
        assert_raised_as_itself(info.value)
    assert Count.calls == 2, Count.calls  # the engine (or its refusal's trace) and the plain call; was 4 under auto


@pytest.mark.parametrize("mode", MODES)
def test_missing_input_key_is_raised_as_itself(mode):
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    model = keras.Model({"a": a, "b": b}, keras.layers.Dense(3)(keras.layers.Concatenate()([Count()(a), b])))
    x, y = data()
    with pytest.raises(
        ValueError, match=r'Missing data for input "b"\. You passed a data dictionary with keys \[\'a\'\]'
    ) as info:
        gradients(mode, model, {"a": x[:, :3]}, y)
    assert not isinstance(info.value, peg.EngineError)
    assert Count.calls == 0  # Keras checks the keys before it calls a layer


@pytest.mark.parametrize("mode", MODES)
def test_label_out_of_range_is_raised_as_itself(mode):
    x, y = data()
    y[2] = 7
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"Received a label value of 7 which is outside the valid range of \[0, 3\)",
    ) as info:
        gradients(mode, mlp(), x, y)
    if mode == "eager":
        assert_raised_as_itself(info.value)
    # Eagerly: the layer-wise pass and the plain call. In a graph the error comes when it runs, after one trace.
    assert Count.calls == (2 if mode == "eager" else 1), Count.calls


@pytest.mark.parametrize("method", ["auto", "loop"])
@pytest.mark.parametrize("mode", MODES)
def test_users_own_exception_propagates_unchanged_at_once(mode, method):
    x, y = data()
    with pytest.raises(Timeout, match="the step ran past its deadline") as info:
        gradients(mode, mlp(RaisesTimeout()), x, y, method=method)
    if mode == "eager":
        assert info.value.__cause__ is None and not isinstance(info.value.__context__, peg.EngineError)
    assert Count.calls == 1, Count.calls  # was 4 under auto, one per engine, then an EngineError


def test_users_own_exception_from_a_rule_is_not_a_fallback(monkeypatch):
    """The type filter alone: the plain call runs, but an exception of a type engines are not built around propagates."""
    monkeypatch.setitem(rule_module.RULES, FailingDense, FailingRule(Timeout("the rule's timer ran out")))
    x, y = data()
    with pytest.raises(Timeout, match="the rule's timer ran out"):
        gradients("eager", mlp(FailingDense(4)), x, y)
    assert Count.calls == 1, Count.calls


@pytest.mark.parametrize("mode", MODES)
def test_engine_failure_still_falls_back_after_one_plain_gradient(mode, monkeypatch):
    monkeypatch.setitem(rule_module.RULES, FailingDense, FailingRule(RuntimeError("this rule cannot build")))
    model = mlp(FailingDense(4))
    x, y = data()
    with pytest.warns(
        peg.EngineFallbackWarning,
        match=r"used the 'vectorized' engine \(not 'layerwise' because it raised RuntimeError: this rule cannot build\)",
    ):
        grads = gradients(mode, model, x, y)
    # Layer-wise, the plain call, then vectorized: its pfor check's trace and tf.vectorized_map's.
    assert Count.calls == 4, Count.calls
    assert_grads_close(grads, reference_gradients(model, sparse_ce, x, y))
    with pytest.raises(
        peg.EngineError, match=r"method='layerwise' could not handle this model: RuntimeError: this rule cannot build\."
    ):
        gradients(mode, model, x, y, method="layerwise")


def test_plain_gradient_adds_nothing_to_the_callers_graph(monkeypatch):
    monkeypatch.setitem(rule_module.RULES, FailingDense, FailingRule(RuntimeError("this rule cannot build")))
    model = mlp(FailingDense(4))
    x, y = data()
    traced = tf.function(lambda x, y: peg.per_example_gradients(model, sparse_ce, x, y))
    with pytest.warns(peg.EngineFallbackWarning, match="used the 'vectorized' engine"):
        graph = traced.get_concrete_function(x, y).graph.as_graph_def()
    names = [node.name for node in graph.node] + [f.signature.name for f in graph.library.function]
    assert names and not [n for n in names if "batch_gradient" in n]


@pytest.mark.parametrize("mode", MODES)
def test_happy_path_calls_the_model_as_often_as_before(mode):
    model = mlp()
    x, y = data()
    gradients(mode, model, x, y)
    assert Count.calls == 1
    Count.calls = 0
    peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=1.0)
    assert Count.calls == 1


@pytest.fixture(scope="module")
def gpt2():
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=50, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=16, max_sequence_length=8
    )


def _hidden_loss(y, hidden):
    return tf.reduce_mean(tf.square(hidden), axis=[1, 2])


def _hub_gradients(mode, backbone, x):
    if mode == "eager":
        return peg.per_example_gradients(backbone, _hidden_loss, x)
    return tf.function(lambda x: peg.per_example_gradients(backbone, _hidden_loss, x))(x)


def _token_ids(length):
    return np.random.default_rng(0).integers(1, 50, (3, length)).astype("int32")


@pytest.mark.parametrize("mode", MODES)
def test_hub_backbone_without_padding_mask(gpt2, mode):
    with pytest.raises(ValueError, match=r'Missing data for input "padding_mask"') as info:
        _hub_gradients(mode, gpt2, {"token_ids": _token_ids(8)})
    assert not isinstance(info.value, peg.EngineError)


@pytest.mark.parametrize("mode", MODES)
def test_hub_backbone_sequence_longer_than_its_positions(gpt2, mode):
    """KerasHub's position embedding slices its ``[8, dim]`` table to the sequence length.

    Eagerly the slice fails. Traced, KerasHub accepts the forward pass (the
    slice would fail only when run), but the gradient of that slice cannot be
    traced: the plain batch gradient's error is raised, as the user's own
    ``tape.gradient`` would raise it.
    """
    x = {"token_ids": _token_ids(12), "padding_mask": np.ones((3, 12), "int32")}
    if mode == "eager":
        expected = tf.errors.InvalidArgumentError, r"Expected size\[0\] in \[0, 8\], but got 12"
    else:
        expected = ValueError, r"Paddings must be non-negative for .*position_embedding.*/Pad"
    with pytest.raises(expected[0], match=expected[1]) as info:
        _hub_gradients(mode, gpt2, x)
    assert not isinstance(info.value, peg.EngineError)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "arg, value, expected",
    [
        (
            "x",
            tf.ragged.constant([[1.0] * 6, [2.0] * 6, [3.0] * 6, [4.0] * 5]),
            r"x is a tf\.RaggedTensor; per-example gradients need dense tensors of shape \[B, \.\.\.\], so pad it with \.to_tensor\(\)",
        ),
        (
            "x",
            tf.sparse.from_dense(np.ones((B, 6), "float32")),
            r"x is a tf\.SparseTensor; per-example gradients need dense tensors of shape \[B, \.\.\.\], so make it dense with tf\.sparse\.to_dense",
        ),
        (
            "x",
            {"a": np.ones((B, 3), "float32"), "b": tf.sparse.from_dense(np.ones((B, 3), "float32"))},
            r"x\['b'\] is a tf\.SparseTensor",
        ),
        ("y", tf.ragged.constant([[0], [1], [2], [0, 1]]), r"y is a tf\.RaggedTensor"),
    ],
    ids=["ragged-x", "sparse-x", "sparse-in-dict", "ragged-y"],
)
def test_ragged_and_sparse_inputs_are_named(mode, arg, value, expected):
    x, y = data()
    inputs = {"x": x, "y": y} | {arg: value}
    with pytest.raises(TypeError, match=expected):
        gradients(mode, mlp(), inputs["x"], inputs["y"])
    assert Count.calls == 0


def test_ragged_sample_weight_is_named():
    x, y = data()
    with pytest.raises(TypeError, match=r"sample_weight is a tf\.RaggedTensor"):
        peg.per_example_gradients(
            mlp(), sparse_ce, x, y, sample_weight=tf.ragged.constant([[1.0], [1.0], [1.0], [1.0, 2.0]])
        )
