"""The layer-wise engine leaves out an example with a non-finite gradient itself, in a graph, for every rule.

In a ``tf.function`` the rules sum tensors a ``tf.cond`` chooses: as captured,
or with such an example's rows replaced (in the per-example tensors the norms
kept, by zeros; where a rule's sum needs more, its tap gradients by zeros and
its saved rows by a finite example's), instead of a second forward and
backward pass. Here
each rule family's case gets one example whose loss weight is Inf (its tap
gradients are non-finite) and, where its input is float, a NaN input entry
(its saved activations are non-finite too); the clipped sum must be the
loop's over the other examples, at the clipped-sum tolerance.
"""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_clipped_sums_close, reference_gradients, reference_norms, sparse_ce
from model_zoo import RULE_FAMILIES, layer_case
from per_example_grads.engines import layerwise
from per_example_grads.engines.base import ENGINES, FiniteSums

BAD = 1


def _rows(x, keep):
    return tf.nest.map_structure(lambda t: np.asarray(t)[keep], x)


def _poisoned(x):
    def poison(t):
        t = np.array(t)
        if np.issubdtype(t.dtype, np.floating):
            t[BAD].flat[0] = np.nan
        return t

    return tf.nest.map_structure(poison, x)


# The first case of each rule family runs in the quick suite, the others are marked slow.
CASES = [
    name if i == 0 else pytest.param(name, marks=pytest.mark.slow)
    for family in RULE_FAMILIES.values()
    for i, name in enumerate(family)
]


def _recording_flags(monkeypatch) -> list:
    """A list that gets, at each trace of the layer-wise clipped sums, whether they left out non-finite examples."""
    flags = []
    engine = ENGINES["layerwise"]
    original = engine.native_clipped_sums

    def recording(problem, batch, clip):
        out = original(problem, batch, clip)
        flags.append(isinstance(out[0], FiniteSums))
        return out

    monkeypatch.setitem(ENGINES, "layerwise", dataclasses.replace(engine, native_clipped_sums=recording))
    return flags


def _relaxed(t):
    t = np.asarray(t)
    return tf.TensorSpec([None, *t.shape[1:]], tf.as_dtype(t.dtype))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static_b", "dynamic_b"])
@pytest.mark.parametrize("name", CASES)
def test_a_non_finite_example_contributes_nothing_in_a_graph(name, dynamic, monkeypatch):
    """With ``B`` dynamic too, as in a DP step (which gathers a Poisson batch's real rows)."""
    model, x, y = layer_case(name)
    b = len(np.asarray(y))
    weights = np.ones(b, "float32")
    weights[BAD] = np.inf
    keep = np.arange(b) != BAD
    flags = _recording_flags(monkeypatch)
    clip = 0.3
    signature = [tf.nest.map_structure(_relaxed, x), _relaxed(y), _relaxed(weights)] if dynamic else None
    graph = tf.function(
        lambda a, b_, w: peg.clipped_gradients(
            model, sparse_ce, a, b_, sample_weight=w, l2_norm_clip=clip, return_norms=True, method="layerwise"
        ),
        input_signature=signature,
    )
    got, norms = graph(_poisoned(x), y, weights)
    assert not np.isfinite(norms.numpy()[BAD])
    expected = reference_gradients(model, sparse_ce, _rows(x, keep), np.asarray(y)[keep])
    factors = clip / np.maximum(reference_norms(expected), clip)
    assert_clipped_sums_close(got, expected, factors)
    assert flags and all(flags), "the engine fell back to the recomputation"


def test_what_depends_on_the_batch_is_known_inside_the_empty_batch_branch():
    """With ``B`` dynamic the pass runs in ``unless_empty``'s ``tf.cond`` branch, where the batch is captured.

    The branch sees the batch through the placeholders that capture it; a saved tensor
    computed from them must count as the batch's (a ``[T, ...]`` batch mean
    that does not lead with ``B`` then keeps the engine from cleaning), and
    one computed from a variable alone must not.
    """
    from per_example_grads._core.batch import unless_empty

    table = tf.Variable(tf.ones([3, 2]))
    seen = []

    def compute(batch):
        from_batch = tf.reduce_mean(batch["x"], axis=0)
        from_table = tf.reduce_sum(table * 2.0, axis=0)
        sources = layerwise._batch_sources(batch)  # after the pass, as the engine asks
        seen.append([layerwise._depends_on(t, sources, {}) for t in (from_batch, from_table)])
        return tf.reduce_sum(batch["x"], axis=0)

    graph = tf.function(lambda x: unless_empty({"x": x}, compute), input_signature=[tf.TensorSpec([None, 2])])
    np.testing.assert_allclose(graph(tf.ones([4, 2])).numpy(), [4.0, 4.0])
    assert seen == [[True, False]]


def _if_branches(graph_def) -> list:
    """The ``tf.cond`` branch functions of a graph's ``If``/``StatelessIf`` ops."""
    functions = {f.signature.name: f for f in graph_def.library.function}
    names = [
        n.attr[k].func.name
        for n in graph_def.node
        if n.op in ("If", "StatelessIf")
        for k in ("then_branch", "else_branch")
    ]
    return [functions[name] for name in names]


def _branch_ops(model, x) -> list:
    """The op types in the ``tf.cond`` branches of a layer-wise clipped sum's graph on ``x`` (labels 0, 1, 2, 0)."""
    y = np.array([0, 1, 2, 0])
    graph = tf.function(
        lambda a, b_: peg.clipped_gradients(model, sparse_ce, a, b_, l2_norm_clip=1.0, method="layerwise")
    ).get_concrete_function(x, y)
    branches = _if_branches(graph.graph.as_graph_def())
    assert branches, "no non-finite branch was traced"
    return [n.op for f in branches for n in f.node_def]


def _conv_then_dense():
    """A Conv2D whose norms keep its per-example kernels, then a Dense layer, whose sum reads its tensors."""
    return tf.keras.Sequential(
        [tf.keras.Input((8, 8, 2)), tf.keras.layers.Conv2D(4, 3), tf.keras.layers.Flatten(), tf.keras.layers.Dense(3)]
    )


@pytest.mark.parametrize("dynamic", [False, True], ids=["static_b", "dynamic_b"])
def test_with_no_finite_example_the_sums_are_zeros(dynamic):
    """Every example non-finite: the sums from zeroed cached rows and from donor rows are exactly 0."""
    model = _conv_then_dense()
    x = np.full((4, 8, 8, 2), np.nan, "float32")
    y = np.array([0, 1, 2, 0])
    signature = [tf.TensorSpec([None, 8, 8, 2]), tf.TensorSpec([None], tf.int64)] if dynamic else None
    graph = tf.function(
        lambda a, b_: peg.clipped_gradients(
            model, sparse_ce, a, b_, l2_norm_clip=1.0, return_norms=True, method="layerwise"
        ),
        input_signature=signature,
    )
    sums, norms = graph(x, y)
    assert not np.any(np.isfinite(norms.numpy()))
    for s in sums:
        np.testing.assert_array_equal(np.asarray(s), 0.0)


def test_the_branch_zeroes_the_kernels_the_norms_kept_and_has_no_convolution():
    """A convolution whose norms keep its per-example kernels: the non-finite branch zeroes their rows.

    Taking the kernel VJP again (the sum without the cache) would put a
    ``Conv2DBackpropFilter`` in the branch and make it read the layer's input
    and output gradient, which it then keeps alive until every norm is known.
    """
    x = np.random.default_rng(0).normal(size=(4, 8, 8, 2)).astype("float32")
    assert [op for op in _branch_ops(_conv_then_dense(), x) if op.startswith("Conv2D")] == []


def test_the_dense_sums_are_traced_once_outside_the_branches():
    """Dense layers keep no cache: the branch gives their saved rows and zeroes their tap gradients, and the rules sum once, outside it."""
    model = tf.keras.Sequential([tf.keras.Input((5,)), tf.keras.layers.Dense(4), tf.keras.layers.Dense(3)])
    x = np.random.default_rng(0).normal(size=(4, 5)).astype("float32")
    assert [op for op in _branch_ops(model, x) if op in ("MatMul", "BatchMatMulV2", "Einsum")] == []


class Scale(tf.keras.layers.Layer):
    """``y = x * w`` elementwise, for a user's rule below."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="random_normal")

    def call(self, x):
        return x * self.w


class CachingScaleRule(peg.LayerRule):
    """A user's rule whose norms leave its per-example gradients in the cache: not the package's, so not zeroed."""

    def forward(self, layer, call, args, kwargs):
        out = call(*args, **kwargs)
        return out, args[0], [out]

    def per_example(self, layer, saved, grads):
        return [saved * grads[0]]

    def squared_norms(self, layer, saved, grads, cache=None):
        (per_example,) = self.per_example(layer, saved, grads)
        if cache is not None:
            cache["mine"] = per_example
        return [tf.reduce_sum(tf.square(per_example), axis=1)]

    def weighted_sum(self, layer, saved, grads, weights, cache=None):
        per_example = (cache or {}).get("mine")
        if per_example is None:
            (per_example,) = self.per_example(layer, saved, grads)
        return [tf.linalg.matvec(per_example, weights, transpose_a=True)]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static_b", "dynamic_b"])
def test_a_users_own_cache_is_summed_as_it_is_or_without_it(dynamic, monkeypatch):
    """A rule's own cache is summed when every norm is finite, and without it (from the cleaned tensors) when not."""
    from per_example_grads.rules import rule as rule_module

    monkeypatch.setattr(rule_module, "RULES", dict(rule_module.RULES))
    peg.register_layer_rule(Scale, CachingScaleRule())
    model = tf.keras.Sequential([tf.keras.Input((5,)), Scale(), tf.keras.layers.Dense(3)])
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(6, 5)).astype("float32"), np.array([0, 1, 2, 0, 1, 2])
    weights = np.ones(6, "float32")
    weights[BAD] = np.inf
    keep = np.arange(6) != BAD
    flags = _recording_flags(monkeypatch)
    signature = [_relaxed(x), _relaxed(y), _relaxed(weights)] if dynamic else None
    graph = tf.function(
        lambda a, b_, w: peg.clipped_gradients(
            model, sparse_ce, a, b_, sample_weight=w, l2_norm_clip=0.3, return_norms=True, method="layerwise"
        ),
        input_signature=signature,
    )
    got, norms = graph(_poisoned(x), y, weights)
    assert not np.isfinite(norms.numpy()[BAD])
    expected = reference_gradients(model, sparse_ce, x[keep], y[keep])
    assert_clipped_sums_close(got, expected, 0.3 / np.maximum(reference_norms(expected), 0.3))
    assert flags and all(flags)
    # All finite: the sums from the cache are the loop's too.
    got = graph(x, y, np.ones(6, "float32"))[0]
    expected = reference_gradients(model, sparse_ce, x, y)
    assert_clipped_sums_close(got, expected, 0.3 / np.maximum(reference_norms(expected), 0.3))
