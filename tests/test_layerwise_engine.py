"""The layer-wise engine as a whole against the one-example loop: shared layers, sample weights, per-layer
clipping, user rules, graphs with unknown and empty batches, auto's choice, mixed precision, frozen layers
and layers it must refuse."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import (
    assert_clipped_sums_close,
    assert_grads_close,
    assert_norms_close,
    clipped_against_loop,
    gradient_scale,
    reference_gradients,
    reference_norms,
    rule_against_loop,
    sparse_ce,
)
from model_zoo import LAYER_B as B
from model_zoo import layer_case, sequential_case, shared_dense_and_embedding
from tolerances import MIXED_BFLOAT16_RTOL, MIXED_FLOAT16_RTOL

rng = np.random.default_rng(7)


def test_shared_layers_sum_contributions_and_norms_have_cross_terms():
    rule_against_loop(*shared_dense_and_embedding(rng), norms="global")


def test_clipped_mean_and_sample_weights():
    model, x, y = layer_case("dense_rank2")
    sw = np.array([1.0, 0.0, 2.0, 0.5], "float32")
    expected = reference_gradients(model, sparse_ce, x, y, sample_weight=sw)
    factors = 0.1 / np.maximum(reference_norms(expected), 0.1)
    got = peg.clipped_gradients(model, sparse_ce, x, y, sample_weight=sw, l2_norm_clip=0.1, reduction="mean")
    assert_clipped_sums_close(got, expected, factors, divisor=B)


def test_per_layer_clipping():
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, name="hidden"), keras.layers.Dense(3, name="head")]
    )
    x, y = rng.normal(size=(B, 5)).astype("float32"), rng.integers(0, 3, B)
    expected = reference_gradients(model, sparse_ce, x, y)
    clips = {"hidden": 0.05, "head": 0.2}
    got, norms = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clips, return_norms=True)
    for name, idx in [("hidden", [0, 1]), ("head", [2, 3])]:
        group = [expected[i] for i in idx]
        assert_norms_close(norms[name], group, scale=gradient_scale(expected))
        n = reference_norms(group)
        assert_clipped_sums_close([got[i] for i in idx], group, clips[name] / np.maximum(n, clips[name]))
    # One clip norm per variable, the generic path, agrees with per-variable maths.
    per_var = [0.1, 0.01, 0.1, 0.01]
    got = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=per_var, method="vectorized")
    for g, e, c in zip(got, expected, per_var):
        n = reference_norms([e])
        assert_clipped_sums_close([g], [e], c / np.maximum(n, c))
    with pytest.raises(ValueError, match="no entry for variable"):
        peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip={"hidden": 1.0})
    with pytest.raises(ValueError, match=r"l2_norm_clip\['head'\] must be a finite number > 0"):
        peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip={"hidden": 1.0, "head": -1})


def test_register_layer_rule_extension_point():
    class Shift(keras.layers.Layer):
        def build(self, shape):
            self.b = self.add_weight(shape=(shape[-1],), initializer="random_normal", name="b")

        def call(self, x):
            return x + self.b

    class ShiftRule(peg.LayerRule):
        def variables(self, layer):
            return [layer.b]

        def forward(self, layer, call, args, kwargs):
            out = args[0] + layer.b
            return out, None, [out]

        def per_example(self, layer, saved, grads):
            return [peg.rules.sum_to_shape(grads[0], layer.b.shape)]

    peg.register_layer_rule(Shift, ShiftRule())
    model, x, y = sequential_case(rng, [Shift(), keras.layers.Dense(4, activation="tanh")], (B, 2, 5))
    from per_example_grads.engines.capture import plan_watches

    assert any(isinstance(u.rule, ShiftRule) for u in plan_watches(model, model.trainable_variables))
    rule_against_loop(model, x, y, norms=None)
    with pytest.raises(TypeError, match="LayerRule"):
        peg.register_layer_rule(Shift, object())


@pytest.mark.slow
def test_layerwise_in_tf_function_unknown_batch_and_empty_batch():
    model, x, y = layer_case("conv1d_causal_dilated")
    f = tf.function(
        lambda x, y: peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.5, return_norms=True),
        input_signature=[tf.TensorSpec([None, 10, 3]), tf.TensorSpec([None], tf.int32)],
    )
    for n in (4, 1, 0):
        sums, norms = f(x[:n], y[:n])
        assert norms.shape == (n,)
        if n == 0:
            assert all(np.all(np.asarray(s) == 0) for s in sums)
    expected = reference_gradients(model, sparse_ce, x, y)
    grads = tf.function(lambda x, y: peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"))(x, y)
    assert_grads_close(grads, expected)


def test_auto_prefers_layerwise_and_no_batch_sized_tensors_for_norms():
    model, x, y = layer_case("dense_rank2")
    from per_example_grads.engines import selection

    assert selection.AUTO_ORDER[0] == "layerwise"
    graph = (
        tf.function(lambda x, y: peg.per_example_norms(model, sparse_ce, x, y))
        .get_concrete_function(tf.TensorSpec([None, 6]), tf.TensorSpec([None], tf.int32))
        .graph
    )
    # Ghost norms: no op output has the shape of per-example kernels [B, 6, 5].
    shapes = [tuple(o.shape.as_list()) for op in graph.get_operations() for o in op.outputs if o.shape.rank == 3]
    assert (None, 6, 5) not in shapes


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_matches_float32(policy):
    def build():
        return keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.LayerNormalization(),
                keras.layers.Dense(3, dtype="float32"),
            ]
        )

    model32 = build()
    x, y = rng.normal(size=(B, 6)).astype("float32"), rng.integers(0, 3, B)
    keras.mixed_precision.set_global_policy(policy)
    try:
        mixed = build()
        mixed.set_weights(model32.get_weights())
        grads = peg.per_example_gradients(mixed, sparse_ce, x, y, method="layerwise")
        norms = peg.per_example_norms(mixed, sparse_ce, x, y)
        clipped = peg.clipped_gradients(mixed, sparse_ce, x, y, l2_norm_clip=0.1)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert norms.dtype == tf.float32 and all(g.dtype == tf.float32 for g in grads)
    expected = reference_gradients(model32, sparse_ce, x, y)
    tol = MIXED_FLOAT16_RTOL if policy == "mixed_float16" else MIXED_BFLOAT16_RTOL  # half precision, not float32
    scale = max(np.abs(e).max() for e in expected)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g, e, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(norms, np.sqrt(sum(np.sum(e.reshape(B, -1) ** 2, axis=1) for e in expected)), rtol=tol)
    ref_clipped = peg.clipped_gradients(model32, sparse_ce, x, y, l2_norm_clip=0.1)
    for c, r in zip(clipped, ref_clipped):
        np.testing.assert_allclose(c, r, rtol=tol, atol=tol * 0.1)


def test_frozen_layers_explicitly_requested():
    """Frozen Dense and Conv2D weights asked for by ``variables=`` get exact gradients."""
    conv = keras.layers.Conv2D(3, 3, name="frozen_conv")
    dense = keras.layers.Dense(4, name="frozen_dense")
    model = keras.Sequential([keras.Input((6, 6, 2)), conv, keras.layers.Flatten(), dense, keras.layers.Dense(3)])
    conv.trainable = False
    dense.trainable = False
    x, y = rng.normal(size=(B, 6, 6, 2)).astype("float32"), rng.integers(0, 3, B)
    variables = [conv.kernel, conv.bias, dense.kernel] + model.trainable_variables
    rule_against_loop(model, x, y, variables=variables)


class WithPositions(keras.Model):
    """Adds a learned positional embedding looked up on ``arange(T)[None]``: not batch-shaped."""

    def __init__(self):
        super().__init__()
        self.tokens = keras.layers.Embedding(12, 4)
        self.positions = keras.layers.Embedding(6, 4)
        self.head = keras.layers.Dense(3)

    def call(self, x):
        h = self.tokens(x) + self.positions(keras.ops.arange(6)[None])
        return self.head(keras.ops.mean(h, axis=1))


def test_layer_called_on_non_batch_tensor_is_refused_and_auto_falls_back():
    model = WithPositions()
    x, y = rng.integers(0, 12, (B, 6)).astype("int32"), rng.integers(0, 3, B)
    model(x)
    with pytest.raises(peg.EngineError, match="not the batch"):
        peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise")
    f = tf.function(
        lambda x, y: peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"),
        input_signature=[tf.TensorSpec([None, 6], tf.int32), tf.TensorSpec([None], tf.int32)],
    )
    with pytest.raises(peg.EngineError, match="not the batch"):
        f(x, y)
    with pytest.warns(peg.EngineFallbackWarning, match="not the batch"):
        grads = peg.per_example_gradients(model, sparse_ce, x, y)
    assert_grads_close(grads, reference_gradients(model, sparse_ce, x, y))


class OnRows(keras.Model):
    """A Dense on ``[B, 4, 5]``, then one on its ``[4 B, 5]`` rows: off the batch, known only at run time."""

    def __init__(self):
        super().__init__()
        self.first = keras.layers.Dense(5, name="on_examples")
        self.rows = keras.layers.Dense(2, name="on_rows")

    def call(self, x):
        h = self.rows(tf.reshape(self.first(x), [-1, 5]))
        return tf.reshape(h, [tf.shape(x)[0], 8])


def test_a_layer_called_off_the_batch_at_run_time_is_named_by_the_assertion():
    """``B`` dynamic: the taps' leading sizes (ranks 3 and 2) are checked at run time, and the message names the layer."""
    model = OnRows()
    x, y = rng.normal(size=(B, 4, 3)).astype("float32"), rng.integers(0, 8, B).astype("int32")
    model(x)
    f = tf.function(
        lambda x, y: peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=1.0, method="layerwise"),
        input_signature=[tf.TensorSpec([None, 4, 3]), tf.TensorSpec([None], tf.int32)],
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"cannot use layer\] \[on_rows\]"):
        f(x, y)


class _Scale(keras.layers.Layer):
    """``tanh(x * w)``: no rule, so the layer-local fallback (whose forward runs the layer's own call)."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=input_shape[-1:], initializer="random_normal")

    def call(self, x):
        return keras.ops.tanh(x * self.w)


def test_a_layer_tracked_by_two_parents_is_counted_once_in_clipped_sums():
    """As KerasHub's CausalLM: the head calls the backbone's own layer again, so the outer model tracks it directly too.

    Planned as two watches, each call was recorded twice, and the clipped sum counted it twice.
    """
    keras.utils.set_random_seed(0)
    inp = keras.Input((5,))
    shared = _Scale(name="shared")
    backbone = keras.Model(inp, shared(inp), name="backbone")
    outer_in = keras.Input((5,))
    model = keras.Model(outer_in, keras.layers.Dense(3)(shared(backbone(outer_in))))
    x = np.random.default_rng(0).normal(size=(B, 5)).astype("float32")
    clipped_against_loop(model, x, np.arange(B) % 3, clip=0.5)


def test_norms_run_in_a_window_of_units_and_fallback_units_one_at_a_time():
    """The control dependencies of ``per_variable_squared_norms``, read from the traced graph.

    Last layer first, a watch's norms wait for those of the watch
    ``CHAIN_WINDOW`` places before it, not for the one just before; a watch
    whose norms build per-example gradients (``_Scale``: the layer-local
    fallback) also waits for the previous such watch.
    """
    from per_example_grads.engines import layerwise
    from per_example_grads.rules.dense import DenseRule
    from per_example_grads.rules.rule import LayerRule

    kinds = "dssdddsd"  # d: Dense (closed form), s: _Scale (fallback)
    layers = [keras.layers.Dense(4, name=f"d{i}") if k == "d" else _Scale(name=f"s{i}") for i, k in enumerate(kinds)]
    model = keras.Sequential([keras.Input((4,)), *layers])
    created: dict[str, set] = {}  # layer name -> the ops its norms created

    def named(squared_norms):
        def wrapper(self, layer, *args, **kwargs):
            graph = tf.compat.v1.get_default_graph()
            start = len(graph.get_operations())
            out = squared_norms(self, layer, *args, **kwargs)
            created[layer.name] = set(graph.get_operations()[start:])
            return out

        return wrapper

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DenseRule, "squared_norms", named(DenseRule.squared_norms))
        mp.setattr(LayerRule, "squared_norms", named(LayerRule.squared_norms))
        x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
        tf.function(lambda x, y: peg.per_example_norms(model, sparse_ce, x, y, method="layerwise"))(
            x, np.array([0, 1, 2], "int32")
        )

    def waits(later: str, earlier: str) -> bool:
        return any(c in created[earlier] for op in created[later] for c in op.control_inputs)

    order = [l.name for l in reversed(layers)]
    assert sorted(created) == sorted(order)
    window = layerwise.CHAIN_WINDOW
    assert window > 1
    fallbacks = [n for n in order if n.startswith("s")]
    for i, name in enumerate(order):
        assert waits(name, order[i - window]) == (i >= window), name
        if i and name.startswith("d"):
            assert not waits(name, order[i - 1]), name
    for later, earlier in zip(fallbacks[1:], fallbacks):
        assert waits(later, earlier), (later, earlier)


def test_a_fallback_layer_with_dropout_inside_is_not_covered_in_training_mode():
    """The layer-local fallback recomputes a layer per example: its Dropout would draw another mask than the forward pass."""

    class Block(keras.layers.Layer):
        def __init__(self, rate):
            super().__init__()
            self.drop = keras.layers.Dropout(rate, name="drop")

        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], 3))

        def call(self, x, training=None):
            return tf.tanh(self.drop(x, training=training) @ self.w)

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = np.ones((8, 4), "float32"), np.arange(8) % 3
    model = keras.Sequential([keras.Input((4,)), Block(0.5)])
    with pytest.raises(peg.EngineError, match=r"'drop' \(Dropout\) inside it draws random values in training mode"):
        peg.per_example_gradients(model, loss, x, y, method="layerwise", training=True)
    with pytest.warns(peg.EngineFallbackWarning, match="used the 'vectorized' engine"):
        peg.per_example_gradients(model, loss, x, y, training=True)
    peg.per_example_gradients(model, loss, x, y, method="layerwise", training=False)  # no mask drawn
    still = keras.Sequential([keras.Input((4,)), Block(0.0)])  # a rate of 0 draws nothing
    peg.per_example_gradients(still, loss, x, y, method="layerwise", training=True)
