"""Taps never double-count: a layer that uses one of its own outputs inside itself, against the one-example loop.

A rule's tap that is one of the layer's outputs must receive only the loss
gradient from outside the layer (``rules.rule.separate_taps``). If it received
the gradient at the tensor itself, the layer's internal use of that output
would reach the layer-local VJP twice: once inside the recomputed layer, once
through the tap (issue 33: KerasHub T5's ``relative_attention_bias`` was off
by more than 100%). The layers below return a tensor and also consume it
(``TwoOut``), return it twice, nest it in structures, or pass their input
through; each model sums every output into its loss, and per-example
gradients, norms and clipped sums are checked against the loop. KerasHub's
``T5Backbone`` runs in a child process (``python tests/test_taps.py t5``), as
in ``tests/test_hub_engines.py``: ``tf.vectorized_map`` over KerasHub
attention can take the process down on some CPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import (
    assert_clipped_sums_close,
    assert_grads_close,
    assert_norms_close,
    reference_gradients,
    reference_norms,
    sparse_ce,
)
from per_example_grads.rules.rule import LayerRule, separate_taps

B, D = 4, 3


class TwoOut(keras.layers.Layer):
    """Issue 33's layer: returns ``z`` and also uses it for its other output."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]), initializer="random_normal")

    def call(self, x):
        z = x @ self.w
        return keras.ops.tanh(z) + z, z


class Chain(keras.layers.Layer):
    """Three outputs, each consumed by the next inside the layer, two weights."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]), initializer="random_normal")
        self.v = self.add_weight(shape=(shape[-1], shape[-1]), initializer="random_normal")

    def call(self, x):
        z1 = x @ self.w
        z2 = keras.ops.tanh(z1) @ self.v
        return z1, z2, keras.ops.sin(z2) * z1


class Nested(keras.layers.Layer):
    """A dict and a list around outputs that feed each other, and an integer output that is not tapped."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]), initializer="random_normal")

    def call(self, x):
        z = x @ self.w
        return {"z": z, "rest": (keras.ops.tanh(z) * z, [2.0 * z]), "argmax": keras.ops.argmax(z, axis=-1)}


class Twice(keras.layers.Layer):
    """Returns the same tensor twice (and once more inside another output)."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]), initializer="random_normal")

    def call(self, x):
        z = x @ self.w
        return z, keras.ops.tanh(z) + z, z


class PassThrough(keras.layers.Layer):
    """Returns its input (another layer's tapped output) unchanged beside a function of it."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="random_normal")

    def call(self, x):
        return keras.ops.tanh(x * self.w) * x, x


def _total(outputs):
    """Every float output summed into ``[B, D]``."""
    leaves = [t for t in tf.nest.flatten(outputs) if getattr(t, "dtype", None) is not None and "float" in str(t.dtype)]
    return keras.layers.Add()(leaves)


def _model(layer, before_dense=False):
    keras.utils.set_random_seed(0)
    inp = keras.Input((D,))
    h = keras.layers.Dense(D)(inp) if before_dense else inp
    out = keras.layers.Dense(2)(_total(layer(h)))
    return keras.Model(inp, out)


def _batch():
    r = np.random.default_rng(1)
    return r.normal(size=(B, D)).astype("float32"), np.array([0, 1, 1, 0], "int32")


def _check_against_loop(model, x, y, method="layerwise"):
    expected = reference_gradients(model, sparse_ce, x, y)
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method=method), expected)
    assert_norms_close(peg.per_example_norms(model, sparse_ce, x, y, method=method), expected)
    norms = reference_norms(expected)
    clip = float(np.median(norms))  # some examples clipped, some not
    got = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip, method=method)
    assert_clipped_sums_close(got, expected, clip / np.maximum(norms, clip))
    return expected


CASES = {
    "two_out": lambda: _model(TwoOut()),
    "chain": lambda: _model(Chain()),
    "nested": lambda: _model(Nested()),
    "twice": lambda: _model(Twice()),
    "pass_through": lambda: _model(PassThrough(), before_dense=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_layer_using_its_own_outputs_matches_the_loop(name):
    model = CASES[name]()
    x, y = _batch()
    _check_against_loop(model, x, y)


def test_the_issue_layer_was_wrong_without_separate_taps(monkeypatch):
    """The case can fail: with taps at the outputs themselves, the kernel's gradients are far off (0.4 relative in the issue)."""
    from per_example_grads.rules import rule as rule_module

    model = _model(TwoOut())
    x, y = _batch()
    expected = reference_gradients(model, sparse_ce, x, y)
    monkeypatch.setattr(rule_module, "separate_taps", lambda outputs, taps, rule=None: (outputs, list(taps)))
    wrong = peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise")
    kernel = np.asarray(wrong[0]) - expected[0]
    assert np.max(np.abs(kernel)) > 0.1 * np.max(np.abs(expected[0]))
    monkeypatch.undo()
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"), expected)


@pytest.mark.slow
def test_the_issue_layer_in_a_graph_and_with_auto():
    model = _model(TwoOut())
    x, y = _batch()
    expected = _check_against_loop(model, x, y, method="auto")
    graph = tf.function(lambda a, b: peg.per_example_gradients(model, sparse_ce, a, b, method="layerwise"))
    assert_grads_close(graph(x, y), expected)


class Doubled(keras.layers.Layer):
    """``y = x * w`` returned with ``y * y``: a user's closed-form rule below taps both outputs."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="random_normal")

    def call(self, x):
        y = x * self.w
        return y, y * y


class DoubledRule(LayerRule):
    """Taps ``y`` and ``s = y * y`` as returned; its closed form reads the gradient at ``y`` as the outside one only."""

    def forward(self, layer, call, args, kwargs):
        y, s = call(*args, **kwargs)
        return (y, s), (args[0], y), [y, s]

    def per_example(self, layer, saved, grads):
        x, y = saved
        g_y, g_s = grads
        # dL/dw = x * (g_y + 2 y g_s): the outside gradient at y, and s's path through y once.
        return [x * (g_y + 2.0 * y * g_s)]


def test_a_users_rule_gets_separated_taps_without_asking(monkeypatch):
    from per_example_grads.rules import rule as rule_module

    monkeypatch.setattr(rule_module, "RULES", dict(rule_module.RULES))
    peg.register_layer_rule(Doubled, DoubledRule())
    assert getattr(DoubledRule.forward, "_separates_taps", False)
    model = _model(Doubled(), before_dense=True)
    x, y = _batch()
    expected = reference_gradients(model, sparse_ce, x, y)
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"), expected)


class Shifted(keras.layers.Layer):
    """``2 x + tanh(w)``: ``w`` broadcast to the batch, as T5's relative position bias is to its scores."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="random_normal")

    def call(self, x):
        return 2.0 * x + keras.ops.tanh(self.w)


class ShiftedRule(LayerRule):
    """Taps the broadcast ``w``, computed from the variable alone and read inside the call: ``grad_n = g_n``.

    Only the tanh reads the tap: an operation none of whose inputs the tape
    watches or computed, unless the tape watches ``w``.
    """

    def forward(self, layer, call, args, kwargs):
        x = args[0]
        shift = tf.identity(tf.broadcast_to(layer.w, tf.shape(x)))
        return 2.0 * x + tf.tanh(shift), None, [shift]

    def per_example(self, layer, saved, grads):
        return [grads[0]]


def test_a_users_tap_computed_from_its_variables_alone_gets_its_gradient(monkeypatch):
    """The capturing tape watches a user's rule's variables: without, the gradient at such a tap would be lost.

    The tape watches the layers' inputs and taps, and records only what
    reads them (``engines.capture._watched_call``); ``w``'s broadcast is
    read by the tanh before it is tapped, so only watching ``w`` records that read.
    """
    from per_example_grads.engines import capture
    from per_example_grads.rules import rule as rule_module

    monkeypatch.setattr(rule_module, "RULES", dict(rule_module.RULES))
    peg.register_layer_rule(Shifted, ShiftedRule())
    model = _model(Shifted(), before_dense=True)
    x, y = _batch()
    expected = reference_gradients(model, sparse_ce, x, y)
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"), expected)
    monkeypatch.setattr(capture, "_BUILTIN_RULES", __name__)  # the rule taken for a built-in one: w not watched
    lost = peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise")
    assert not np.any(np.asarray(lost[2])) and np.any(expected[2])  # [dense kernel, dense bias, w, ...]


def test_separate_taps_values_structure_and_masks():
    z = tf.constant([[1.0, -2.0]])
    z._keras_mask = tf.constant([True])
    other = tf.constant([[3.0, 4.0]])
    ids = tf.constant([1])
    outputs = {"a": z, "b": [other, z], "ids": ids}
    new, taps = separate_taps(outputs, [z, z, other])
    assert set(new) == {"a", "b", "ids"} and isinstance(new["b"], list) and new["ids"] is ids
    # Tapped as often as returned: one fresh identity per place, each its tap; values bit for bit.
    assert taps[0] is new["a"] and taps[1] is new["b"][1] and taps[2] is new["b"][0]
    assert new["a"] is not z and new["b"][1] is not z and new["a"] is not new["b"][1]
    for t in (new["a"], new["b"][1]):
        assert np.array_equal(t, z) and t._keras_mask is z._keras_mask
    # Tapped once, returned twice: one identity for both places.
    new, taps = separate_taps((z, z), [z])
    assert new[0] is new[1] is taps[0] and new[0] is not z
    # An inner tensor (a pre-activation) stays; outputs with nothing tapped are returned as they were.
    outputs = (other,)
    new, taps = separate_taps(outputs, [z])
    assert new is outputs and taps[0] is z


def test_one_inner_tensor_tapped_twice_is_refused():
    z = tf.constant([[1.0]])
    with pytest.raises(ValueError, match="taps must be distinct"):
        separate_taps(tf.tanh(z), [z, z])


def test_the_wrapper_applies_once_per_class_and_keeps_the_docstring():
    from per_example_grads.rules.dense import DenseLoraRule, DenseRule
    from per_example_grads.rules.local import LocalRule

    for cls in (DenseRule, LocalRule):
        assert getattr(cls.forward, "_separates_taps", False)
    assert DenseLoraRule.forward is DenseRule.forward  # inherited, not wrapped again
    assert LayerRule.forward.__doc__ and "separate_taps" in LayerRule.forward.__doc__


# --------------------------------------------------------------- KerasHub T5

T5_B, T5_T, T5_V = 3, 5, 32


def _t5_child() -> None:
    """Prints one JSON line: per check, "ok" or the assertion's message."""
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=T5_V, num_layers=2, num_heads=2, hidden_dim=8, intermediate_dim=16, key_value_dim=4, dropout=0.0
    )
    names = ["encoder_token_ids", "encoder_padding_mask", "decoder_token_ids", "decoder_padding_mask"]
    inputs = {k: keras.Input((T5_T,), dtype="int32", name=k) for k in names}
    model = keras.Model(inputs, keras.layers.Dense(T5_V)(backbone(inputs)["decoder_sequence_output"]))
    r = np.random.default_rng(0)
    x = {
        "encoder_token_ids": r.integers(0, T5_V, (T5_B, T5_T)).astype("int32"),
        "encoder_padding_mask": np.ones((T5_B, T5_T), "int32"),
        "decoder_token_ids": r.integers(0, T5_V, (T5_B, T5_T)).astype("int32"),
        "decoder_padding_mask": np.ones((T5_B, T5_T), "int32"),
    }
    x["encoder_padding_mask"][0, -2:] = 0  # a padded example: the mask joins position_bias
    y = r.integers(0, T5_V, (T5_B, T5_T)).astype("int32")
    expected = reference_gradients(model, sparse_ce, x, y)
    tables = [i for i, v in enumerate(model.trainable_variables) if "self_attention/embeddings" in v.path]
    report = {
        "relative_attention_bias_tables": len(tables),
        "tables_nonzero": bool(all(np.abs(expected[i]).max() > 0 for i in tables)),
    }
    norms = reference_norms(expected)
    clip = float(np.median(norms))
    checks = {
        "per_example_gradients": lambda: assert_grads_close(
            peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"), expected
        ),
        "per_example_norms": lambda: assert_norms_close(
            peg.per_example_norms(model, sparse_ce, x, y, method="layerwise"), expected
        ),
        "clipped_gradients": lambda: assert_clipped_sums_close(
            peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip, method="layerwise"),
            expected,
            clip / np.maximum(norms, clip),
        ),
    }
    for name, check in checks.items():
        try:
            check()
            report[name] = "ok"
        except AssertionError as err:
            report[name] = str(err)[:1000]
    print(json.dumps(report), flush=True)


@pytest.mark.slow
def test_keras_hub_t5_matches_the_loop_relative_attention_bias_included():
    pytest.importorskip("keras_hub")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), TF_CPP_MIN_LOG_LEVEL="2"
    )
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "t5"],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=900,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert proc.returncode == 0 and lines, f"the child failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    report = json.loads(lines[-1])
    # The encoder's and the decoder's first self-attention own a table each.
    assert report["relative_attention_bias_tables"] == 2 and report["tables_nonzero"], report
    for name in ("per_example_gradients", "per_example_norms", "clipped_gradients"):
        assert report[name] == "ok", f"{name}: {report[name]}"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if sys.argv[1:] == ["t5"]:
        _t5_child()
