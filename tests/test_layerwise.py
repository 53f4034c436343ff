"""The layer-wise engine: every rule, the fallback, ghost norms and clipped sums
against the one-example-at-a-time loop."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import per_example_grads as peg
from helpers import (
    assert_clipped_sums_close,
    assert_close,
    assert_grads_close,
    assert_norms_close,
    gradient_scale,
    reference_gradients,
    reference_norms,
    sparse_ce,
)
from tolerances import (
    EPS32,
    EPS64,
    GRADIENT_RTOL,
    MIXED_BFLOAT16_RTOL,
    MIXED_FLOAT16_RTOL,
    norm_rtol,
    rounding_rtol,
    weighted_sum_rtol,
)

B = 4
rng = np.random.default_rng(7)


def _seq(model_layers, x_shape, dtype="float32", n_classes=3):
    model = keras.Sequential([keras.Input(x_shape[1:], dtype=dtype)] + model_layers + [keras.layers.Flatten(), keras.layers.Dense(n_classes)])
    if dtype == "int32":
        x = rng.integers(0, 12, x_shape).astype("int32")
    else:
        x = rng.normal(size=x_shape).astype("float32")
    return model, x, rng.integers(0, n_classes, x_shape[0]).astype("int32")


def _custom_with_inner_dense():
    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.inner = keras.layers.Dense(4, activation="relu")

        def call(self, x):
            return self.inner(x) * 2.0 + 1.0

    return _seq([Block()], (B, 5))


class Scale(keras.layers.Layer):
    """A custom layer with its own weight: no rule, so the layer-local fallback."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="random_normal", name="w")

    def call(self, x):
        return x * self.w + tf.sin(x * self.w)


def _mha():
    inp = keras.Input((5, 8))
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inp, inp)
    out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inp, out), rng.normal(size=(B, 5, 8)).astype("float32"), rng.integers(0, 3, B).astype("int32")


CASES = {
    "dense_rank2": lambda: _seq([keras.layers.Dense(5, activation="tanh")], (B, 6)),
    "dense_sequence_gram": lambda: _seq([keras.layers.Dense(16, activation="relu")], (B, 3, 16)),
    "dense_sequence_materialized": lambda: _seq([keras.layers.Dense(2)], (B, 9, 2)),
    "dense_rank4_no_bias": lambda: _seq([keras.layers.Dense(3, use_bias=False)], (B, 2, 3, 4)),
    "einsum_dense_bias_axes": lambda: _seq([keras.layers.EinsumDense("abc,cde->abde", (3, 2, 4), bias_axes="de", activation="relu")], (B, 3, 5)),
    "einsum_dense_ellipsis": lambda: _seq([keras.layers.EinsumDense("...b,bc->...c", 4, bias_axes="c")], (B, 2, 5)),
    "einsum_dense_not_dense_like": lambda: _seq([keras.layers.EinsumDense("abc,bd->adc", (4, 3))], (B, 3, 3)),
    "conv1d_causal_dilated": lambda: _seq([keras.layers.Conv1D(4, 3, padding="causal", dilation_rate=2, activation="relu")], (B, 10, 3)),
    "conv1d_strided_groups": lambda: _seq([keras.layers.Conv1D(4, 3, strides=2, groups=2, padding="same")], (B, 10, 4)),
    "conv2d_strided_valid": lambda: _seq([keras.layers.Conv2D(3, 3, strides=2, activation="tanh")], (B, 9, 9, 2)),
    "conv2d_dilated_same": lambda: _seq([keras.layers.Conv2D(3, 2, dilation_rate=2, padding="same")], (B, 7, 7, 2)),
    "conv2d_few_positions_gram": lambda: _seq([keras.layers.Conv2D(16, 3, strides=2, activation="relu")], (B, 5, 5, 8)),
    "conv2d_same_small_input": lambda: _seq([keras.layers.Conv2D(8, 3, padding="same")], (B, 3, 3, 2)),
    "conv1d_strided_same_no_bias": lambda: _seq([keras.layers.Conv1D(5, 4, strides=3, padding="same", use_bias=False)], (B, 11, 2)),
    "conv3d": lambda: _seq([keras.layers.Conv3D(2, 2, strides=(1, 2, 1))], (B, 4, 5, 4, 2)),
    "depthwise_conv2d": lambda: _seq([keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same")], (B, 6, 6, 2)),
    "separable_conv2d": lambda: _seq([keras.layers.SeparableConv2D(3, 3, activation="relu")], (B, 6, 6, 2)),
    "embedding_mask_zero_pooled": lambda: _seq([keras.layers.Embedding(12, 4, mask_zero=True), keras.layers.GlobalAveragePooling1D()], (B, 6), dtype="int32"),
    "embedding_long_sequence": lambda: _seq([keras.layers.Embedding(12, 3)], (B, 8), dtype="int32"),
    # 24 ids out of 12: every example has repeated ids.
    "embedding_repeated_ids": lambda: _seq([keras.layers.Embedding(12, 3)], (B, 24), dtype="int32"),
    "embedding_long_mask_zero_pooled": lambda: _seq([keras.layers.Embedding(12, 4, mask_zero=True), keras.layers.GlobalAveragePooling1D()], (B, 20), dtype="int32"),
    "layer_norm": lambda: _seq([keras.layers.Dense(6), keras.layers.LayerNormalization()], (B, 5)),
    "layer_norm_sequence": lambda: _seq([keras.layers.Dense(6), keras.layers.LayerNormalization(epsilon=0.3)], (B, 4, 5)),
    "layer_norm_two_axes_rank4": lambda: _seq([keras.layers.LayerNormalization(axis=[1, 3])], (B, 3, 2, 4)),
    "layer_norm_middle_axis_no_center": lambda: _seq([keras.layers.LayerNormalization(axis=1, center=False)], (B, 4, 3)),
    "layer_norm_rms_scaling": lambda: _seq([keras.layers.Dense(6), keras.layers.LayerNormalization(rms_scaling=True)], (B, 3, 5)),
    "layer_norm_no_scale": lambda: _seq([keras.layers.LayerNormalization(scale=False)], (B, 3, 5)),
    "group_norm": lambda: _seq([keras.layers.Conv1D(4, 2), keras.layers.GroupNormalization(groups=2)], (B, 6, 3)),
    "batch_norm_inference": lambda: _seq([keras.layers.Dense(6), keras.layers.BatchNormalization()], (B, 5)),
    "prelu": lambda: _seq([keras.layers.Dense(6), keras.layers.PReLU()], (B, 5)),
    "lstm_fallback": lambda: _seq([keras.layers.LSTM(4, return_sequences=True)], (B, 5, 3)),
    "custom_layer_fallback": lambda: _seq([Scale()], (B, 5)),
    "dense_inside_custom_call": _custom_with_inner_dense,
    "multi_head_attention": _mha,
    "dense_lora_fallback": lambda: _lora_model(),
}


def _lora_model():
    model, x, y = _seq([keras.layers.Dense(5, activation="tanh", name="adapted")], (B, 6))
    model.get_layer("adapted").enable_lora(rank=2)
    return model, x, y


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_matches_loop(name):
    model, x, y = CASES[name]()
    expected = reference_gradients(model, sparse_ce, x, y)
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"), expected)
    norms = peg.per_example_norms(model, sparse_ce, x, y, method="layerwise", by_variable=True)
    assert_norms_close(norms, expected, by_variable=True)


def _shared_model():
    inp = keras.Input((6,))
    shared = keras.layers.Dense(6, activation="tanh")
    emb_in = keras.Input((5,), dtype="int32")
    emb = keras.layers.Embedding(10, 6)
    h = shared(shared(inp)) + keras.layers.GlobalAveragePooling1D()(emb(emb_in) + emb(emb_in[:, ::-1]))
    model = keras.Model([inp, emb_in], keras.layers.Dense(3)(h))
    x = [rng.normal(size=(B, 6)).astype("float32"), rng.integers(0, 10, (B, 5)).astype("int32")]
    return model, x, rng.integers(0, 3, B).astype("int32")


def test_shared_layers_sum_contributions_and_norms_have_cross_terms():
    model, x, y = _shared_model()
    expected = reference_gradients(model, sparse_ce, x, y)
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"), expected)
    assert_norms_close(peg.per_example_norms(model, sparse_ce, x, y, method="layerwise"), expected)


@pytest.mark.parametrize("clip", [1e-3, 0.3, 1e3])
@pytest.mark.parametrize("name", [
    "dense_sequence_gram", "conv2d_strided_valid", "conv2d_dilated_same", "conv2d_few_positions_gram", "conv2d_same_small_input",
    "conv1d_causal_dilated", "conv1d_strided_same_no_bias", "embedding_mask_zero_pooled",
    "embedding_repeated_ids", "embedding_long_mask_zero_pooled", "layer_norm_sequence",
    "layer_norm_two_axes_rank4", "layer_norm_middle_axis_no_center", "layer_norm_rms_scaling", "multi_head_attention",
    "lstm_fallback",
])
def test_clipped_gradients_match_clipping_materialized(name, clip):
    model, x, y = CASES[name]()
    expected = reference_gradients(model, sparse_ce, x, y)
    norms = reference_norms(expected)
    factors = clip / np.maximum(norms, clip)
    for method in ["layerwise", "vectorized" if name != "multi_head_attention" else "loop"]:
        got, got_norms = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip, return_norms=True, method=method)
        assert_norms_close(got_norms, expected)
        for g, v in zip(got, model.trainable_variables):
            # The layer-wise engine returns an embedding table's sum as IndexedSlices, like tape.gradient.
            assert isinstance(g, tf.IndexedSlices) == (method == "layerwise" and "embedding" in v.path)
        assert_clipped_sums_close(got, expected, factors)
    # Every clipped example's norm is at most C, up to numpy's two float64 roundings in C / n * n.
    assert np.all(norms * factors <= clip * (1 + rounding_rtol(2, EPS64)))


def test_clipped_mean_and_sample_weights():
    model, x, y = CASES["dense_rank2"]()
    sw = np.array([1.0, 0.0, 2.0, 0.5], "float32")
    expected = reference_gradients(model, sparse_ce, x, y, sample_weight=sw)
    factors = 0.1 / np.maximum(reference_norms(expected), 0.1)
    got = peg.clipped_gradients(model, sparse_ce, x, y, sample_weight=sw, l2_norm_clip=0.1, reduction="mean")
    assert_clipped_sums_close(got, expected, factors, divisor=B)


def test_per_layer_clipping():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, name="hidden"), keras.layers.Dense(3, name="head")])
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
            return [peg.layerwise.sum_to_shape(grads[0], layer.b.shape)]

    peg.register_layer_rule(Shift, ShiftRule())
    model, x, y = _seq([Shift(), keras.layers.Dense(4, activation="tanh")], (B, 2, 5))
    from per_example_grads.layerwise.capture import plan_units

    assert any(isinstance(u.rule, ShiftRule) for u in plan_units(model, model.trainable_variables))
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"), reference_gradients(model, sparse_ce, x, y))
    with pytest.raises(TypeError, match="LayerRule"):
        peg.register_layer_rule(Shift, object())


def test_layerwise_in_tf_function_unknown_batch_and_empty_batch():
    model, x, y = CASES["conv1d_causal_dilated"]()
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
    model, x, y = CASES["dense_rank2"]()
    from per_example_grads.engines import selection

    assert selection.AUTO_ORDER[0] == "layerwise"
    graph = tf.function(lambda x, y: peg.per_example_norms(model, sparse_ce, x, y)).get_concrete_function(
        tf.TensorSpec([None, 6]), tf.TensorSpec([None], tf.int32)
    ).graph
    # Ghost norms: no op output has the shape of per-example kernels [B, 6, 5].
    shapes = [tuple(o.shape.as_list()) for op in graph.get_operations() for o in op.outputs if o.shape.rank == 3]
    assert (None, 6, 5) not in shapes


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_matches_float32(policy):
    def build():
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.LayerNormalization(),
                                 keras.layers.Dense(3, dtype="float32")])

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


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 3), st.integers(1, 2), st.sampled_from([1, 2]), st.sampled_from(["valid", "same"]),
    st.sampled_from([1, 2]), st.integers(1, 4), st.integers(0, 2**16),
)
def test_random_conv_and_sequence_dense(kernel, strides, dilation, padding, t, width, seed):
    dilation = 1 if strides > 1 else dilation
    r = np.random.default_rng(seed)
    model = keras.Sequential([
        keras.Input((8, 2)),
        keras.layers.Conv1D(width, kernel, strides=strides, dilation_rate=dilation, padding=padding),
        keras.layers.Dense(width + 1, activation="tanh"),
        keras.layers.Flatten(), keras.layers.Dense(3),
    ])
    x, y = r.normal(size=(3, 8, 2)).astype("float32"), r.integers(0, 3, 3)
    expected = reference_gradients(model, sparse_ce, x, y)
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"), expected)
    assert_norms_close(peg.per_example_norms(model, sparse_ce, x, y, method="layerwise"), expected)


def test_frozen_layers_explicitly_requested():
    """Frozen Dense and Conv2D weights asked for by ``variables=`` get exact gradients."""
    conv = keras.layers.Conv2D(3, 3, name="frozen_conv")
    dense = keras.layers.Dense(4, name="frozen_dense")
    model = keras.Sequential([keras.Input((6, 6, 2)), conv, keras.layers.Flatten(), dense, keras.layers.Dense(3)])
    conv.trainable = False
    dense.trainable = False
    x, y = rng.normal(size=(B, 6, 6, 2)).astype("float32"), rng.integers(0, 3, B)
    variables = [conv.kernel, conv.bias, dense.kernel] + model.trainable_variables
    expected = reference_gradients(model, sparse_ce, x, y, variables=variables)
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise", variables=variables), expected)
    norms = peg.per_example_norms(model, sparse_ce, x, y, method="layerwise", variables=variables, by_variable=True)
    assert_norms_close(norms, expected, by_variable=True)


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
    f = tf.function(lambda x, y: peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"),
                    input_signature=[tf.TensorSpec([None, 6], tf.int32), tf.TensorSpec([None], tf.int32)])
    with pytest.raises(peg.EngineError, match="not the batch"):
        f(x, y)
    with pytest.warns(peg.EngineFallbackWarning, match="not the batch"):
        grads = peg.per_example_gradients(model, sparse_ce, x, y)
    assert_grads_close(grads, reference_gradients(model, sparse_ce, x, y))


@pytest.mark.parametrize("only_repeated", [True, False])
@pytest.mark.parametrize("b", [0, 1, 5])
@pytest.mark.parametrize("vocabulary,t", [(7, 30), (500, 30), (500, 1), (3, 2)])
def test_embedding_grouped_squared_norms_against_dense_tables(b, vocabulary, t, only_repeated):
    """Few ids (every row repeats, groups of many) and many (most ids once; a planted triple)."""
    from per_example_grads.per_example_slices import grouped_squared_norms, repeated_rows

    r = np.random.default_rng(b)
    ids = r.integers(0, vocabulary, (b, t)).astype("int32")
    if b > 1 and t >= 4:
        ids[0, :3] = ids[0, 3]  # a group of four in the large vocabulary too
        ids[1] = ids[0]  # the same ids in another example are another group
    g = r.normal(size=(b, t, 3)).astype("float32")
    tables = np.zeros((b, vocabulary, 3), "float32")
    magnitudes = np.zeros((b, vocabulary, 3))  # sum of |rows| per id: the terms of each table entry
    for n in range(b):
        np.add.at(tables[n], ids[n], g[n])
        np.add.at(magnitudes[n], ids[n], np.abs(g[n]))
    want = np.sum(tables**2, axis=(1, 2))
    # Each table entry S, a sum of at most t rows, is within rounding_rtol(t) of its terms' magnitude M on
    # either side, so S^2 within 2 |S| M rounding_rtol(t); then a sum of at most 3 t non-zero squares.
    atol = 2 * rounding_rtol(t) * np.sum(np.abs(tables) * magnitudes, axis=(1, 2))
    rtol = rounding_rtol(3 * t)
    f = tf.function(lambda i, g: grouped_squared_norms(g, repeated_rows(i, only_repeated)),
                    input_signature=[tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None, None, 3])])
    for got in (grouped_squared_norms(g, repeated_rows(ids, only_repeated)), f(ids, g)):
        assert got.shape == (b,)
        assert_close(got, want, rtol=rtol, atol=atol)
    # The rows kept: those whose id occurs again in their example, or all of them.
    rows = repeated_rows(ids, only_repeated).rows.numpy()
    counts = [np.count_nonzero(ids[n] == ids[n, k]) for n in range(b) for k in range(t)]
    assert sorted(rows) == [i for i, c in enumerate(counts) if c > 1 or not only_repeated]


def test_rules_know_when_xla_compiles_them():
    """The rules' XLA switches read a private TensorFlow check: fail loudly if it stops working."""
    from per_example_grads.xla_context import in_xla_context

    seen = []
    probe = lambda x: (seen.append(in_xla_context()), x)[1]  # noqa: E731
    tf.function(probe, jit_compile=True)(tf.constant(1.0))
    tf.function(probe)(tf.constant(1.0))
    assert seen == [True, False] and not in_xla_context()


@pytest.mark.parametrize("name", [
    "embedding_repeated_ids", "embedding_mask_zero_pooled", "dense_sequence_gram", "conv2d_strided_valid",
    "layer_norm_sequence", "multi_head_attention", "lstm_fallback", "custom_layer_fallback",
])
def test_norms_and_clipped_sums_under_xla_match_the_materialized_reference(name):
    """``tf.function(jit_compile=True)`` (what Keras' jit_compile does, the default on GPUs) changes nothing."""
    model, x, y = CASES[name]()
    expected = reference_gradients(model, sparse_ce, x, y)
    factors = 0.3 / np.maximum(reference_norms(expected), 0.3)
    norms_xla = tf.function(lambda x, y: peg.per_example_norms(model, sparse_ce, x, y, method="layerwise"), jit_compile=True)
    clipped_xla = tf.function(
        lambda x, y: peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.3, method="layerwise"), jit_compile=True)
    assert_norms_close(norms_xla(x, y), expected)
    assert_clipped_sums_close(clipped_xla(x, y), expected, factors)


def test_layer_norm_uses_its_closed_form_unless_over_the_batch_axis():
    from per_example_grads.layers.normalization import LayerNormRule
    from per_example_grads.layerwise.capture import plan_units

    model, _, _ = CASES["layer_norm_two_axes_rank4"]()
    assert [type(u.rule) for u in plan_units(model, model.trainable_variables)][0] is LayerNormRule
    over_batch = keras.layers.LayerNormalization(axis=[0, 1])
    assert LayerNormRule().unsupported(over_batch) is not None


@pytest.mark.parametrize("name,layer_class,keeps", [
    ("layer_norm_sequence", keras.layers.LayerNormalization, True),  # [B, 6] x 2 vs [B, 4, 6] x 2
    ("custom_layer_fallback", Scale, True),  # [B, 5] vs [B, 5] + [B, 5]
    ("lstm_fallback", keras.layers.LSTM, False),  # [B, 3, 16] kernel alone vs [B, 5, 3] + [B, 5, 4]
])
def test_materialized_norms_are_kept_for_the_clipped_sum_only_when_no_larger(name, layer_class, keeps):
    from per_example_grads.layerwise import engine
    from per_example_grads.problem import make_problem
    from per_example_grads.batch import make_batch

    model, x, y = CASES[name]()
    problem = make_problem(model, sparse_ce, None, False, False)
    captured = engine.capture(problem, make_batch(model, x, y, None))
    record, g = next((r, g) for r, g in zip(captured.records, captured.grads) if isinstance(r.unit.layer, layer_class))
    rule, layer = record.unit.rule, record.unit.layer
    norms, kept = rule.squared_norms_keeping(layer, record.saved, g)
    assert (kept is not None) == keeps
    # Two computations of one layer's per-example gradients from the same captured a and g: a layer's path is
    # part of a model's, so its entries agree to GRADIENT_RTOL at most; a squared norm doubles a norm's error.
    per_example = [np.asarray(t, np.float64) for t in rule.per_example(layer, record.saved, g)]
    scale = gradient_scale(per_example)
    for got, want, t in zip(norms, rule.squared_norms(layer, record.saved, g), per_example):
        p = int(np.prod(t.shape[1:]))
        np.testing.assert_allclose(got, want, rtol=2 * norm_rtol(p), atol=2 * GRADIENT_RTOL * scale**2 * p)
    if keeps:
        w = np.linspace(0.1, 1.0, B)
        sums = zip(rule.weighted_sum_kept(layer, record.saved, g, tf.constant(w, tf.float32), kept),
                   rule.weighted_sum(layer, record.saved, g, tf.constant(w, tf.float32)), per_example)
        for got, want, t in sums:
            rtol = weighted_sum_rtol(B, GRADIENT_RTOL)
            np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.max(np.tensordot(w, np.abs(t), axes=1)))


def test_embedding_clipped_sums_are_indexed_slices_and_every_consumer_densifies_them():
    """Shared embedding (two calls: slices concatenated), mean reduction, DP noise, accumulation."""
    model, x, y = _shared_model()
    variables = model.trainable_variables
    emb_index = next(i for i, v in enumerate(variables) if "embedding" in v.path)
    expected = reference_gradients(model, sparse_ce, x, y)
    factors = 0.05 / np.maximum(reference_norms(expected), 0.05)
    for reduction, divisor in (("sum", 1), ("mean", B)):
        got = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.05, reduction=reduction, method="layerwise")
        assert isinstance(got[emb_index], tf.IndexedSlices)
        assert got[emb_index].values.shape[0] == 2 * B * 5  # two calls, no dense [V, D] table
        assert_clipped_sums_close(got, expected, factors, divisor=divisor)
    # Zero noise: private_gradients is the clipped sum over the expected batch size, dense.
    private = peg.dp.private_gradients(model, sparse_ce, x, y, l2_norm_clip=0.05, noise_multiplier=0.0,
                                       expected_batch_size=8, method="layerwise")
    assert not any(isinstance(g, tf.IndexedSlices) for g in private)
    assert_clipped_sums_close(private, expected, factors, divisor=8)
    acc = peg.GradientAccumulator(model, sparse_ce, l2_norm_clip=0.05, noise_multiplier=0.0, expected_batch_size=8, method="layerwise")
    acc.accumulate([t[:2] for t in x], y[:2])
    acc.accumulate([t[2:] for t in x], y[2:])
    assert_clipped_sums_close(acc.result(), expected, factors, divisor=8)


CONV_CLIPPED = ["conv2d_strided_valid", "conv2d_dilated_same", "conv2d_same_small_input", "conv1d_causal_dilated", "conv1d_strided_same_no_bias"]


@pytest.mark.parametrize("keep, jit", [(False, True), (True, False)])
@pytest.mark.parametrize("name", CONV_CLIPPED)
def test_conv_clipped_sum_by_kernel_vjp_or_kept_kernels_with_and_without_xla(name, keep, jit, monkeypatch):
    from per_example_grads.layers import conv

    monkeypatch.setattr(conv, "KEEP_PER_EXAMPLE_KERNELS", keep)
    monkeypatch.setattr(conv, "NORMS_JIT_COMPILE", jit)
    model, x, y = CASES[name]()
    expected = reference_gradients(model, sparse_ce, x, y)
    factors = 0.3 / np.maximum(reference_norms(expected), 0.3)
    got, got_norms = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.3, return_norms=True, method="layerwise")
    assert_norms_close(got_norms, expected)
    assert_clipped_sums_close(got, expected, factors)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("name", CONV_CLIPPED)
def test_conv_norms_in_batch_chunks_equal_the_reference(name, graph, monkeypatch):
    """A chunk of one example (the smallest patch budget) changes nothing, eagerly and in a graph."""
    from per_example_grads.layers import conv

    monkeypatch.setattr(conv, "PATCH_CHUNK_ELEMENTS", 1)
    model, x, y = CASES[name]()
    expected = reference_gradients(model, sparse_ce, x, y)
    factors = 0.3 / np.maximum(reference_norms(expected), 0.3)
    clipped = lambda x, y: peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=0.3, return_norms=True, method="layerwise")  # noqa: E731
    got, got_norms = (tf.function(clipped) if graph else clipped)(x, y)
    assert_norms_close(got_norms, expected)
    assert_clipped_sums_close(got, expected, factors)


def test_conv_keeps_per_example_kernels_only_when_small():
    from per_example_grads.layers import conv

    a, g = tf.zeros([2, 9, 9, 2]), tf.zeros([2, 4, 4, 3])  # f k = 54 <= 162 + 48
    spec = conv.ConvSpec(2, (3, 3), (2, 2), (1, 1), "valid")
    assert conv.kernel_squared_norms(spec, a, g, keep=True)[1].shape == (2, 3, 18)  # [B, k, f]: the smaller axis first
    assert conv.kernel_squared_norms(spec, a, g, keep=False)[1] is None
    a, g = tf.zeros([2, 3, 3, 2]), tf.zeros([2, 3, 3, 8])  # f k = 144 > 18 + 72
    assert conv.kernel_squared_norms(conv.ConvSpec(2, (3, 3), (1, 1), (1, 1), "same"), a, g, keep=True)[1] is None


@pytest.mark.parametrize("physical", [None, 3])
def test_dp_model_with_embedding_takes_sparse_clipped_sums_in_and_out_of_chunks(physical):
    """Noiseless DPModel step on an embedding model, whole batch or in chunks: SGD(1) moves by the clipped mean."""
    keras.utils.set_random_seed(5)
    net = keras.Sequential([keras.Input((20,), dtype="int32"), keras.layers.Embedding(12, 4),
                            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    x, y = rng.integers(0, 12, (8, 20)).astype("int32"), rng.integers(0, 3, 8).astype("int32")
    expected = reference_gradients(net, sparse_ce, x, y)
    factors = 0.1 / np.maximum(reference_norms(expected), 0.1)
    dp = peg.keras.DPModel(net, l2_norm_clip=0.1, noise_multiplier=0.0, expected_batch_size=8.0,
                           physical_batch_size=physical, method="layerwise")
    dp.compile(optimizer=keras.optimizers.SGD(1.0), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [v.numpy().copy() for v in net.trainable_variables]
    dp.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    # The step b - lr g rounds relative to the weights, not to g, and numpy's b - v once more: EPS32 |b|.
    moved = [b - v.numpy() for b, v in zip(before, net.trainable_variables)]
    assert_clipped_sums_close(moved, expected, factors, divisor=8, extra_atol=[EPS32 * np.abs(b) for b in before])


@pytest.mark.parametrize("spec, shape", [
    ((2, (3, 3), (1, 1), (1, 1), "valid"), (3, 9, 8, 1)),
    ((2, (3, 2), (2, 3), (1, 1), "valid"), (2, 11, 10, 3)),
    ((2, (3, 3), (2, 2), (1, 1), "same"), (2, 9, 8, 2)),
    ((2, (2, 3), (1, 1), (2, 2), "same"), (2, 7, 9, 2)),
    ((1, (3,), (2,), (1,), "same"), (2, 10, 3)),
    ((1, (3,), (1,), (2,), "causal"), (2, 9, 2)),
    ((1, (1,), (1,), (1,), "valid"), (2, 5, 4)),
])
def test_conv_sliced_patches_equal_extract_patches(spec, shape):
    """The strided-slice patches the norms use under XLA are extract_patches' exactly, in its feature order."""
    from per_example_grads.layers import conv

    layer = conv.ConvSpec(*spec)
    a = tf.random.stateless_normal(shape, [1, 2])
    want = conv.patches(layer, a).numpy()
    got = conv.sliced_patches(layer, tuple(shape[1:-1]), a).numpy()
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
