"""The layer-wise Embedding rule against the one-example loop; its grouped norms; its sparse clipped sums."""

import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import (
    assert_clipped_sums_close,
    assert_close,
    clipped_against_loop,
    reference_gradients,
    reference_norms,
    rule_against_loop,
    sparse_ce,
)
from model_zoo import LAYER_B as B
from model_zoo import RULE_FAMILIES, layer_case, layer_case_params, shared_dense_and_embedding
from tolerances import rounding_rtol

rng = np.random.default_rng(7)


@pytest.mark.parametrize("name", layer_case_params(sorted(RULE_FAMILIES["embedding"])))
def test_rule_matches_loop(name):
    rule_against_loop(*layer_case(name))


@pytest.mark.parametrize("clip", [1e-3, 0.3, 1e3])
@pytest.mark.parametrize(
    "name",
    layer_case_params(["embedding_mask_zero_pooled", "embedding_repeated_ids", "embedding_long_mask_zero_pooled"]),
)
def test_clipped_gradients_match_clipping_materialized(name, clip):
    clipped_against_loop(*layer_case(name), clip, methods=["layerwise", "vectorized"])


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
    f = tf.function(
        lambda i, g: grouped_squared_norms(g, repeated_rows(i, only_repeated)),
        input_signature=[tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None, None, 3])],
    )
    for got in (grouped_squared_norms(g, repeated_rows(ids, only_repeated)), f(ids, g)):
        assert got.shape == (b,)
        assert_close(got, want, rtol=rtol, atol=atol)
    # The rows kept: those whose id occurs again in their example, or all of them.
    rows = repeated_rows(ids, only_repeated).rows.numpy()
    counts = [np.count_nonzero(ids[n] == ids[n, k]) for n in range(b) for k in range(t)]
    assert sorted(rows) == [i for i, c in enumerate(counts) if c > 1 or not only_repeated]


def test_embedding_clipped_sums_are_indexed_slices_and_every_consumer_densifies_them():
    """Shared embedding (two calls: slices concatenated), mean reduction, DP noise, accumulation."""
    model, x, y = shared_dense_and_embedding(rng)
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
    private = peg.dp.private_gradients(
        model, sparse_ce, x, y, l2_norm_clip=0.05, noise_multiplier=0.0, expected_batch_size=8, method="layerwise"
    )
    assert not any(isinstance(g, tf.IndexedSlices) for g in private)
    assert_clipped_sums_close(private, expected, factors, divisor=8)
    acc = peg.GradientAccumulator(
        model, sparse_ce, l2_norm_clip=0.05, noise_multiplier=0.0, expected_batch_size=8, method="layerwise"
    )
    acc.accumulate([t[:2] for t in x], y[:2])
    acc.accumulate([t[2:] for t in x], y[2:])
    assert_clipped_sums_close(acc.result(), expected, factors, divisor=8)


def test_the_lookup_reads_only_the_looked_up_rows():
    """The rule's lookup is a ``ResourceGather`` of the table, never a dense read of it.

    Once an optimizer has updated a table sparsely, TensorFlow keeps the
    variable in copy-on-read mode: a dense ``ReadVariableOp`` would then copy
    the whole ``[V, D]`` table at every step.
    """
    import keras

    model = keras.Sequential(
        [keras.Input((4,), dtype="int32"), keras.layers.Embedding(50, 3), keras.layers.Flatten(), keras.layers.Dense(2)]
    )
    x, y = np.zeros((2, 4), "int32"), np.zeros((2,), "int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    traced = tf.function(
        lambda x, y: peg.clipped_gradients(model, loss, x, y, l2_norm_clip=1.0, method="layerwise"), autograph=False
    )
    graph = traced.get_concrete_function(x, y).graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    assert any(n.op == "ResourceGather" for n in nodes), "no sparse read of the table"
    reads = {n.name for n in nodes if n.op == "ReadVariableOp"}
    dense_lookups = [n.name for n in nodes if n.op == "GatherV2" and n.input[0].split(":")[0] in reads]
    assert not dense_lookups, dense_lookups
