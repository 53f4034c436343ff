"""Shared test helpers: an independent per-example reference and the assertions against it.

Tests import them with ``from helpers import ...`` (``tests/`` is on
``sys.path`` under pytest); ``conftest.py`` holds only fixtures and the
process set-up that must happen before TensorFlow starts.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from tolerances import (
    EPS32,
    EPS64,
    GRADIENT_RTOL,
    clipped_sum_rtol,
    norm_rtol,
    rounding_rtol,
)  # every tolerance: tests/tolerances.py


def reference_gradients(model, loss_fn, x, y, sample_weight=None, variables=None, training=False):
    """One ``tape.gradient`` per example, in eager Python: ``[B, *var.shape]`` numpy arrays.

    Independent of the library: it slices examples itself, calls the raw loss
    function, averages trailing axes and applies the sample weight by hand.
    """
    variables = list(model.trainable_variables if variables is None else variables)
    n = tf.nest.flatten(x)[0].shape[0]
    per_example = []
    for i in range(n):
        xi = tf.nest.map_structure(lambda t: t[i : i + 1], x)
        yi = None if y is None else tf.nest.map_structure(lambda t: t[i : i + 1], y)
        with tf.GradientTape(persistent=True) as tape:
            for v in variables:
                if not v.trainable:
                    tape.watch(v.value)
            loss = loss_fn(yi, model(xi, training=training))
            loss = tf.reduce_mean(tf.reshape(loss, [-1]))
            if sample_weight is not None:
                loss = loss * float(sample_weight[i])
        grads = tape.gradient(loss, variables)
        per_example.append(
            [
                np.zeros(v.shape, v.dtype) if g is None else np.asarray(tf.convert_to_tensor(g))
                for g, v in zip(grads, variables)
            ]
        )
    return [np.stack([p[k] for p in per_example]) for k in range(len(variables))]


def assert_close(actual, desired, *, rtol=0.0, atol=0.0, err_msg=""):
    """``|actual - desired| <= atol + rtol |desired|`` entry by entry, where ``rtol`` and ``atol`` may be arrays.

    (``np.testing.assert_allclose`` takes only numbers: a bound per entry, as
    tests/tolerances.py derives them, needs this.) NaNs must match.
    """
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    assert actual.shape == desired.shape, f"{err_msg}: shape {actual.shape} != {desired.shape}"
    bound = np.broadcast_to(
        np.asarray(atol, np.float64) + np.asarray(rtol, np.float64) * np.abs(desired), desired.shape
    )
    diff = np.abs(actual - desired)
    bad = ~((diff <= bound) | (np.isnan(actual) & np.isnan(desired)))
    if np.any(bad):
        worst = np.unravel_index(np.argmax(np.where(bad, diff / np.maximum(bound, 1e-300), 0)), bad.shape)
        raise AssertionError(
            f"{err_msg}: {int(bad.sum())} of {bad.size} entries differ by more than their tolerance; worst at "
            f"{tuple(int(i) for i in worst)}: actual {actual[worst]!r}, desired {desired[worst]!r}, "
            f"difference {diff[worst]:.3g} > tolerance {bound[worst]:.3g}"
        )


def gradient_scale(expected) -> float:
    """The largest reference entry over all variables: the magnitude of the terms.

    An entry that is 0 in exact arithmetic (an attention key bias's gradient)
    or cancels to near 0 is made of terms of about this size, so its rounding
    error is relative to this, not to itself (see tests/tolerances.py).
    """
    return max([float(np.max(np.abs(e))) for e in expected if np.size(e)] + [1e-30])


def assert_grads_close(actual, expected, rtol=GRADIENT_RTOL):
    """Per-example gradients against the reference: ``rtol``, and ``rtol`` times ``gradient_scale`` absolutely."""
    assert len(actual) == len(expected)
    atol = rtol * gradient_scale(expected)
    for k, (a, e) in enumerate(zip(actual, expected)):
        a = np.asarray(a)
        assert a.shape == e.shape, f"variable {k}: shape {a.shape} != {e.shape}"
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"variable {k}")


def reference_norms(expected, by_variable=False):
    """``[B]`` float64 norms of the reference per-example gradients (a list of ``[B]`` with ``by_variable``)."""
    b = len(expected[0])
    flats = [np.reshape(e, (b, -1)).astype(np.float64) for e in expected]
    if by_variable:
        return [np.linalg.norm(f, axis=1) for f in flats]
    return np.linalg.norm(np.concatenate(flats, axis=1), axis=1)


def assert_norms_close(actual, expected, by_variable=False, scale=None):
    """Per-example norms (global, or a list per variable) against the reference's: ``norm_rtol`` of their size.

    Absolutely, ``GRADIENT_RTOL * scale * sqrt(p)``: the norm of ``p`` entries
    each off by ``GRADIENT_RTOL * scale`` (``scale`` defaults to ``gradient_scale(expected)``).
    """
    scale = gradient_scale(expected) if scale is None else scale
    groups = [[e] for e in expected] if by_variable else [expected]
    actual = list(actual) if by_variable else [actual]
    assert len(actual) == len(groups)
    for k, (a, group) in enumerate(zip(actual, groups)):
        p = sum(int(np.prod(np.shape(e)[1:])) for e in group)
        np.testing.assert_allclose(
            a, reference_norms(group), rtol=norm_rtol(p), atol=GRADIENT_RTOL * scale * np.sqrt(p), err_msg=f"norms {k}"
        )


def assert_clipped_sums_close(actual, expected, factors, divisor=1, rtol=None, extra_atol=None):
    """``sum_i factors[i] expected[k][i] / divisor`` per variable: ``clipped_sum_rtol`` of the clip group's size.

    ``expected`` is the clip group (all variables for one global clip norm).
    Absolutely, ``rtol`` times the largest ``sum_i |factors[i] expected[k][i]| / divisor``: the sum's terms,
    plus ``extra_atol[k]`` (a further rounding the caller accounts for). ``tf.IndexedSlices`` sums are made dense first.
    """
    b = len(expected[0])
    p = sum(int(np.prod(np.shape(e)[1:])) for e in expected)
    if rtol is None:
        rtol = clipped_sum_rtol(p, b) + (EPS32 if divisor != 1 else 0.0)  # the division rounds once on each side
    factors = np.asarray(factors, np.float64)
    scale = max(float(np.max(np.tensordot(np.abs(factors), np.abs(e), axes=1))) for e in expected) / divisor
    assert len(actual) == len(expected)
    for k, (a, e) in enumerate(zip(actual, expected)):
        want = np.tensordot(factors, e, axes=1) / divisor
        atol = rtol * scale + (0.0 if extra_atol is None else extra_atol[k])
        assert_close(tf.convert_to_tensor(a), want, rtol=rtol, atol=atol, err_msg=f"variable {k}")


def mlp(d_in=6, hidden=8, n_classes=3):
    """A ``d_in -> hidden (tanh) -> n_classes`` Dense network: the DP tests' small model."""
    return keras.Sequential(
        [keras.Input((d_in,)), keras.layers.Dense(hidden, activation="tanh"), keras.layers.Dense(n_classes)]
    )


def hand_dp_step(model, x, y, clip, sample_weight=None):
    """The reference per-example gradients, and each example's clip factor ``min(1, clip / norm)``."""
    ref = reference_gradients(model, sparse_ce, x, y, sample_weight=sample_weight)
    return ref, np.minimum(1.0, clip / reference_norms(ref))


def digits_split(n_train=600, seed=0):
    """``(x, y, x_test, y_test)``: ``n_train`` shuffled shipped digits to train on, the last 300 to test on."""
    from per_example_grads.data import load_digits

    x, y = load_digits()
    idx = np.random.default_rng(seed).permutation(len(x))
    return x[idx[:n_train]], y[idx[:n_train]], x[idx[-300:]], y[idx[-300:]]


def sparse_ce(y_true, y_pred):
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def rule_against_loop(model, x, y, *, norms="by_variable", method="layerwise", variables=None, loss_fn=sparse_ce):
    """An engine (the layer-wise one: its rules) against the one-example loop; returns the loop's gradients.

    Checks ``per_example_gradients`` with ``assert_grads_close`` and, unless
    ``norms`` is None, ``per_example_norms`` with ``assert_norms_close``:
    one per variable (``norms="by_variable"``) or one global norm (``"global"``).
    """
    if norms not in ("by_variable", "global", None):
        raise ValueError(f"norms must be 'by_variable', 'global' or None; got {norms!r}")
    expected = reference_gradients(model, loss_fn, x, y, variables=variables)
    assert_grads_close(peg.per_example_gradients(model, loss_fn, x, y, method=method, variables=variables), expected)
    if norms is not None:
        by_variable = norms == "by_variable"
        got = peg.per_example_norms(model, loss_fn, x, y, method=method, variables=variables, by_variable=by_variable)
        assert_norms_close(got, expected, by_variable=by_variable)
    return expected


def clipped_against_loop(model, x, y, clip, methods=("layerwise",)):
    """``clipped_gradients`` with its norms, for each of ``methods``, against the loop's clipped sum.

    Embedding tables' sums must be ``tf.IndexedSlices`` exactly when the
    layer-wise engine computes them. Returns the loop's gradients.
    """
    expected = reference_gradients(model, sparse_ce, x, y)
    norms = reference_norms(expected)
    factors = clip / np.maximum(norms, clip)
    for method in methods:
        got, got_norms = peg.clipped_gradients(
            model, sparse_ce, x, y, l2_norm_clip=clip, return_norms=True, method=method
        )
        assert_norms_close(got_norms, expected)
        for g, v in zip(got, model.trainable_variables):
            # The layer-wise engine returns an embedding table's sum as IndexedSlices, like tape.gradient.
            assert isinstance(g, tf.IndexedSlices) == (method == "layerwise" and "embedding" in v.path)
        assert_clipped_sums_close(got, expected, factors)
    # Every clipped example's norm is at most C, up to numpy's two float64 roundings in C / n * n.
    assert np.all(norms * factors <= clip * (1 + rounding_rtol(2, EPS64)))
    return expected


def layerwise_clipped_against_loop(model, x, y, tf_function=None, clip=0.3):
    """The layer-wise engine's clipped sums and norms against the loop's, at clip ``clip``.

    ``tf_function``: None runs eagerly; a dict runs it in ``tf.function(**tf_function)``
    (``{}``, ``{"jit_compile": True}``, ``{"input_signature": [...]}``).
    """
    clipped = lambda x, y: peg.clipped_gradients(
        model, sparse_ce, x, y, l2_norm_clip=clip, return_norms=True, method="layerwise"
    )  # noqa: E731
    fn = clipped if tf_function is None else tf.function(clipped, **tf_function)
    expected = reference_gradients(model, sparse_ce, x, y)
    factors = clip / np.maximum(reference_norms(expected), clip)
    got, got_norms = fn(x, y)
    assert_norms_close(got_norms, expected)
    assert_clipped_sums_close(got, expected, factors)


def layerwise_per_example_against_loop(model, x, y, tf_function=None):
    """The layer-wise engine's materialized per-example gradients against the loop's.

    ``tf_function`` as for ``layerwise_clipped_against_loop``.
    """
    grads = lambda x, y: peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise")  # noqa: E731
    fn = grads if tf_function is None else tf.function(grads, **tf_function)
    assert_grads_close(fn(x, y), reference_gradients(model, sparse_ce, x, y))


class CrashAtStep(keras.callbacks.Callback):
    """Raises ``RuntimeError("killed")`` after the batch at which a DPModel's ledger reaches ``step`` steps."""

    def __init__(self, step: int):
        super().__init__()
        self._step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.dp_steps.numpy()) == self._step:
            raise RuntimeError("killed")


_MIRRORED = []


def mirrored_strategy():
    """One strategy for the whole process: strategies created one after another
    in a process share collective instance keys, and a second one's first
    all-reduce can meet the first one's (TF 2.21 aborts all collectives then)."""
    devices = tf.config.list_logical_devices("CPU")
    if len(devices) < 2:
        reason = "needs two logical CPU devices (configured in tests/conftest.py before TensorFlow starts)"
        if os.environ.get("CI") == "true":  # in CI a skip would hide every test here
            pytest.fail(f"{reason}; found {len(devices)}: something initialized TensorFlow first", pytrace=False)
        pytest.skip(reason)
    if not _MIRRORED:
        _MIRRORED.append(tf.distribute.MirroredStrategy([d.name for d in devices[:2]]))
    return _MIRRORED[0]


def run_here(script: str, *args: str) -> str:
    """The stdout of ``script`` (dedented) run as ``run_in_new_process`` runs it, but in this process: for the
    first of two runs where only the second must start afresh (saves a Python start, TensorFlow's import)."""
    import contextlib
    import io
    import sys
    import textwrap

    out, argv = io.StringIO(), sys.argv
    sys.argv = ["-c", *args]
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(textwrap.dedent(script), "<run_here>", "exec"), {"__name__": "__main__"})
    finally:
        sys.argv = argv
    return out.getvalue()


def run_in_new_process(script: str, *args: str) -> str:
    """The stdout of ``script`` (dedented) run by a fresh Python with ``args``; its stderr's tail if it fails."""
    import subprocess
    import sys
    import textwrap

    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
