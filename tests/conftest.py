"""Shared test helpers: an independent per-example reference and a model zoo."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

# Two logical CPU devices for the MirroredStrategy tests (tests/test_distribute_mirrored.py).
# Must happen before TensorFlow initializes its devices; every other test runs on /cpu:0.
try:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
except RuntimeError:  # devices already initialized by whoever imported TensorFlow first
    pass

# float32 agreement with the one-example-at-a-time loop: rtol 1e-5, with an
# absolute floor of 1e-6 times the largest reference entry (over all
# variables) for entries that are zero up to rounding, such as attention key
# biases, whose exact gradient is 0.
RTOL = 1e-5
ATOL_SCALE = 1e-6


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
            [np.zeros(v.shape, v.dtype) if g is None else np.asarray(tf.convert_to_tensor(g)) for g, v in zip(grads, variables)]
        )
    return [np.stack([p[k] for p in per_example]) for k in range(len(variables))]


def assert_grads_close(actual, expected, rtol=RTOL):
    assert len(actual) == len(expected)
    scale = max([float(np.max(np.abs(e))) for e in expected if e.size] + [1e-30])
    for k, (a, e) in enumerate(zip(actual, expected)):
        a = np.asarray(a)
        assert a.shape == e.shape, f"variable {k}: shape {a.shape} != {e.shape}"
        atol = ATOL_SCALE * scale
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=f"variable {k}")


def sparse_ce(y_true, y_pred):
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
