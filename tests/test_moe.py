"""Mixture-of-experts blocks in the layer-wise engine, and layers called off the batch inside a layer that is not.

In process (fast): a layer that runs Dense layers on its input flattened to
``[B*T, D]`` rows is taken over by that layer, as one layer-local watch, and
matches the one-example loop; what may not stand in (the model itself, a
layer whose inner watch is also called outside it, a layer with dropout in
training) does not; the experts' per-expert norm part against numpy, both of
its forms and its float64 recomputation.

In a child process (slow): tiny KerasHub Mixtral, Qwen-MoE and Qwen3-MoE
causal LMs built from their classes (``python tests/test_moe.py FAMILY...``),
because ``tf.vectorized_map`` over KerasHub attention has crashed the process
on some CPUs (``tests/test_hub_engines.py``): the MoE rule covers each block
(no stand-in), leaves the model's outputs bit for bit as they are, and its
per-example gradients (layerwise and auto), norms and clipped sums match the
loop; Mixtral's also in a graph of unknown batch size, and with the rule
removed, through the stand-in. One child runs all three (each check prints
``CHECK family name`` first, so a crash names it); each family is one test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
from tolerances import clipped_sum_rtol, rounding_rtol

B, T = 4, 5


class Rows(keras.layers.Layer):
    """Two Dense layers on ``x`` flattened to ``[B*T, D]`` rows, reshaped back: its sublayers never see the batch."""

    def __init__(self, shared=None, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        self.inner = shared if shared is not None else keras.layers.Dense(6, activation="tanh")
        self.out = keras.layers.Dense(4)
        self.drop = keras.layers.Dropout(dropout) if dropout else None

    def build(self, shape):
        if not self.inner.built:
            self.inner.build((None, shape[-1]))
        self.out.build((None, self.inner.units))

    def call(self, x, training=None):
        b, t, d = keras.ops.shape(x)
        h = self.inner(keras.ops.reshape(x, (-1, d)))
        if self.drop is not None:
            h = self.drop(h, training=training)
        return keras.ops.reshape(self.out(h), (b, t, 4))


def _rows_model(**rows):
    keras.utils.set_random_seed(0)
    inp = keras.Input((T, 3))
    h = Rows(name="rows", **rows)(keras.layers.Dense(3, name="before")(inp))
    out = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(inp, out)


def _data(rng):
    return rng.normal(size=(B, T, 3)).astype("float32"), rng.integers(0, 3, B)


def _captured_watches(model, x, y, training=False):
    from per_example_grads._core.problem import make_problem
    from per_example_grads.engines import layerwise

    problem = make_problem(model, sparse_ce, None, training, False)
    captured = layerwise.capture(problem, {"x": tf.constant(x), "y": tf.constant(y)})
    return {r.watch.layer.name: type(r.watch.rule).__name__ for r in captured.records}


@pytest.mark.slow
def test_a_layer_whose_sublayers_see_flattened_rows_stands_in_for_them():
    model, rng = _rows_model(), np.random.default_rng(0)
    x, y = _data(rng)
    # The Dense layers inside `rows` see [B*T, .]: `rows` itself is one layer-local watch.
    assert _captured_watches(model, x, y) == {"before": "DenseRule", "rows": "LocalRule", "head": "DenseRule"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", peg.EngineFallbackWarning)  # auto keeps to the layer-wise engine
        expected = rule_against_loop(model, x, y, method="layerwise")
        norms = reference_norms(expected)
        clip = float(np.median(norms))
        got, got_norms = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip, return_norms=True)  # auto
    assert_norms_close(got_norms, expected)
    assert_clipped_sums_close(got, expected, clip / np.maximum(norms, clip))


def test_no_stand_in_for_a_layer_whose_inner_unit_is_also_called_outside_it():
    keras.utils.set_random_seed(0)
    shared = keras.layers.Dense(6, activation="tanh", name="shared")
    inp = keras.Input((T, 3))
    h = Rows(shared=shared, name="rows")(inp)  # `shared` on [B*T, 3] rows inside `rows`...
    out = keras.layers.Dense(3, name="head")(keras.layers.GlobalAveragePooling1D()(h + shared(inp)[..., :4]))
    model = keras.Model(inp, out)  # ...and on the batch outside it
    x, y = _data(np.random.default_rng(1))
    with pytest.raises(peg.EngineError, match="not the batch|also called outside"):
        peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise")
    with pytest.warns(peg.EngineFallbackWarning, match="layerwise"):
        got = peg.per_example_gradients(model, sparse_ce, x, y)
    assert_grads_close(got, reference_gradients(model, sparse_ce, x, y))


def test_what_may_not_stand_in():
    from per_example_grads.engines.capture import containers_of, plan_watches

    model = _rows_model(dropout=0.5)
    watches = plan_watches(model, model.trainable_variables)
    names = lambda layers: [l.name for l in layers]  # noqa: E731
    assert names(containers_of(model, watches)) == ["rows"]
    # In training, a per-example recomputation of `rows` would draw other dropout masks.
    assert containers_of(model, watches, training=True) == []
    x, y = _data(np.random.default_rng(2))
    with pytest.raises(peg.EngineError, match="not the batch"):
        peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise", training=True)
    # The model itself never stands in (that would be a whole-model engine): refused, as before.
    keras.utils.set_random_seed(0)

    class Flat(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return keras.ops.mean(keras.ops.reshape(self.dense(keras.ops.reshape(x, (-1, 3))), (-1, T, 3)), axis=1)

    sub = Flat()
    sub(x)
    with pytest.raises(peg.EngineError, match="no layer enclosing it below the model"):
        peg.per_example_gradients(sub, sparse_ce, x, y, method="layerwise")


@pytest.mark.parametrize("gram", [True, False], ids=["gram", "built"])
def test_per_expert_kernel_norms_against_numpy(gram):
    from per_example_grads._core.example_ops import widened
    from per_example_grads.rules.moe import _per_expert_kernel_part

    rng = np.random.default_rng(3)
    e, b, t = 3, 4, (2 if gram else 6)
    i, j = 5, 4  # t (i + j) < i j for t = 2, not for t = 6
    h, g = rng.normal(size=(e, b, t, i)), rng.normal(size=(e, b, t, j))
    h[:, 1] *= 1e19  # example 1's squares overflow float32: recomputed in float64
    want = np.einsum("ebti,ebtj->beij", h, g)
    want = (want**2).sum(axis=(1, 2, 3))
    (got,) = widened([_per_expert_kernel_part(tf.constant(h, tf.float32), tf.constant(g, tf.float32))])
    assert got.dtype == tf.float64 and np.all(np.isfinite(got))
    # Both forms are sums of the terms of the Gram form, whose magnitudes add up to `scale`: the inputs'
    # float32 roundings (2 per product), dot products of max(i, j) terms, then e t^2 products summed
    # (Gram) or t-term kernel entries squared and e i j of them summed (built).
    scale = np.einsum("ebti,ebsi,ebtj,ebsj->b", np.abs(h), np.abs(h), np.abs(g), np.abs(g))
    steps = 4 + (max(i, j) + e * t * t if gram else t + e * i * j)
    assert_close(got, want, atol=2 * rounding_rtol(steps) * scale)


# ------------------------------------------------------------- KerasHub MoE models, in child processes

FAMILIES = ["mixtral", "qwen_moe", "qwen3_moe"]
HUB_B, VOCAB = 3, 48


def _hub_model(family: str):
    import keras_hub

    keras.utils.set_random_seed(0)
    if family == "mixtral":  # Gram forms for every expert kernel at T = 4
        backbone = keras_hub.models.MixtralBackbone(
            vocabulary_size=VOCAB,
            num_layers=1,
            num_query_heads=2,
            num_key_value_heads=1,
            hidden_dim=8,
            intermediate_dim=16,
            num_experts=4,
            top_k=2,
        )
        return keras_hub.models.MixtralCausalLM(backbone=backbone, preprocessor=None), 4
    if family == "qwen_moe":  # a shared expert and its gate; top-k weights not renormalized
        backbone = keras_hub.models.QwenMoeBackbone(
            vocabulary_size=VOCAB,
            num_layers=1,
            num_query_heads=2,
            num_key_value_heads=1,
            hidden_dim=8,
            intermediate_dim=16,
            moe_intermediate_dim=8,
            shared_expert_intermediate_dim=12,
            num_experts=4,
            top_k=2,
        )
        return keras_hub.models.QwenMoeCausalLM(backbone=backbone, preprocessor=None), 4
    # T = 12: the expert kernels' norms built, not in the Gram form; top-k weights renormalized
    backbone = keras_hub.models.Qwen3MoeBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
        moe_intermediate_dim=8,
        num_experts=3,
        top_k=2,
        head_dim=4,
        norm_top_k_prob=True,
    )
    return keras_hub.models.Qwen3MoeCausalLM(backbone=backbone, preprocessor=None), 12


def _child(families: list[str]) -> None:
    """Every check on each family's model; prints ``CHECK family name`` before and one JSON line after each."""
    for family in families:
        _child_checks(family)


def _child_checks(family: str) -> None:
    from per_example_grads._core.problem import make_problem
    from per_example_grads.engines import layerwise
    from per_example_grads.engines.capture import capturing
    from per_example_grads.rules import moe
    from per_example_grads.rules.rule import RULES

    model, t = _hub_model(family)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (HUB_B, t)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    y = rng.integers(0, VOCAB, (HUB_B, t)).astype("int32")
    # Weights set the examples' norms apart, so that the clip factors differ (1, 1 and about 0.4).
    sw = np.array([1.0, 0.3, 2.5], "float32")
    expected = reference_gradients(model, sparse_ce, x, y, sample_weight=sw)
    names = [v.path for v in model.trainable_variables]
    norms = reference_norms(expected)
    clip = float(np.median(norms))
    factors = clip / np.maximum(norms, clip)
    kw = dict(sample_weight=sw)

    # One variable at a time, each at its own scale: the experts' gradients are a thousandth of the
    # output layer's, and a tolerance scaled by the largest gradient would hide their errors.
    def each(check, got):
        assert len(got) == len(expected)
        for g, e, n in zip(got, expected, names):
            try:
                check([g], [e])
            except AssertionError as err:
                raise AssertionError(f"{n}: {err}") from None

    grads_close = lambda got: each(assert_grads_close, got)  # noqa: E731
    norms_close = lambda got: each(lambda g, e: assert_norms_close(g, e, by_variable=True), got)  # noqa: E731

    def clipped_close(got, got_norms):
        assert_norms_close(got_norms, expected)
        p = sum(int(np.prod(e.shape[1:])) for e in expected)  # one clip group: every variable
        rtol = clipped_sum_rtol(p, HUB_B)
        for g, e, n in zip(got, expected, names):
            scale = float(np.max(np.tensordot(factors, np.abs(e), axes=1)))
            assert_close(
                tf.convert_to_tensor(g), np.tensordot(factors, e, axes=1), rtol=rtol, atol=rtol * scale, err_msg=n
            )

    def plan_and_outputs():
        problem = make_problem(model, sparse_ce, None, False, False)
        watches = layerwise.watches_of(problem)
        blocks = [u for u in watches if isinstance(u.rule, moe.MoEBlockRule)]
        assert blocks, "no MoE block took the MoE rule"
        captured = layerwise.capture(problem, {"x": tf.nest.map_structure(tf.constant, x), "y": tf.constant(y)})
        assert all(any(r.watch is u for u in watches) for r in captured.records), "a layer stood in for a watch"
        plain = tf.nest.flatten(model(x))
        with capturing(watches):
            watched = tf.nest.flatten(model(x))
        assert all(np.array_equal(a, b) for a, b in zip(plain, watched)), "capturing changed the model's outputs"

    def gradients(method):
        def check():
            with warnings.catch_warnings():
                warnings.simplefilter("error", peg.EngineFallbackWarning)
                grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method=method, **kw))

        return check

    def norms_by_variable():
        norms_close(peg.per_example_norms(model, sparse_ce, x, y, method="layerwise", by_variable=True, **kw))

    def clipped():
        with warnings.catch_warnings():
            warnings.simplefilter("error", peg.EngineFallbackWarning)  # auto
            clipped_close(*peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip, return_norms=True, **kw))

    def clipped_in_graph():
        spec = [
            {k: tf.TensorSpec([None, t], tf.int32) for k in x},
            tf.TensorSpec([None, t], tf.int32),
            tf.TensorSpec([None], tf.float32),
        ]
        fn = tf.function(
            lambda x, y, sw: peg.clipped_gradients(
                model, sparse_ce, x, y, sample_weight=sw, l2_norm_clip=clip, return_norms=True, method="layerwise"
            ),
            input_signature=spec,
        )
        clipped_close(*fn(x, y, sw))

    def stand_in():
        removed = {n: RULES.pop(n) for n in moe.MOE_BLOCKS}
        try:
            grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise", **kw))
        finally:
            RULES.update(removed)

    checks = {
        "plan_and_outputs": plan_and_outputs,
        "layerwise": gradients("layerwise"),
        "auto": gradients("auto"),
        "norms": norms_by_variable,
        "clipped": clipped,
    }
    if family == "mixtral":  # tracing the whole engine costs seconds: once, and the stand-in once
        checks.update(clipped_in_graph=clipped_in_graph, stand_in=stand_in)
    for name, check in checks.items():
        print(f"CHECK {family} {name}", flush=True)
        try:
            check()
        except AssertionError as err:
            status, message = "mismatch", str(err)
        except Exception as err:  # noqa: BLE001 - reported, and fails the test
            status, message = "error", f"{type(err).__name__}: {err}"
        else:
            status, message = "ok", ""
        print(json.dumps({"family": family, "check": name, "status": status, "message": message[:1500]}), flush=True)


@pytest.fixture(scope="module")
def hub_child():
    """One child for all families (TensorFlow's import is most of a child's time): its stdout lines, return code, stderr."""
    pytest.importorskip("keras_hub")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), TF_CPP_MIN_LOG_LEVEL="2"
    )
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *FAMILIES],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=600,
    )
    return proc.stdout.splitlines(), proc.returncode, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_models_match_the_loop_in_closed_form(family, hub_child):
    lines, returncode, stderr = hub_child
    results = [r for r in (json.loads(l) for l in lines if l.startswith("{")) if r["family"] == family]
    started = [l.split()[2] for l in lines if l.startswith(f"CHECK {family} ")]
    if len(results) != len(started) or not results:
        last = [l for l in lines if l.startswith("CHECK ")][-1:] or ["(before any check)"]
        pytest.fail(f"the child died (return code {returncode}) at {last[0]}:\n{stderr[-3000:]}")
    bad = [f"{r['check']}: {r['status']}: {r['message']}" for r in results if r["status"] != "ok"]
    assert not bad, "\n".join(bad)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _child(sys.argv[1:])
