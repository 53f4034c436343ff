"""Every engine against the independent one-example-at-a-time loop."""

import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_grads_close, reference_gradients
from model_zoo import ZOO, zoo_params
from per_example_grads.engines import ENGINES
from tolerances import GRADIENT_RTOL, weighted_sum_rtol

METHODS = [*sorted(ENGINES), "auto"]  # every registered engine, and auto's choice


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", zoo_params(sorted(ZOO)))
def test_engine_matches_reference_loop(name, method):
    case = ZOO[name]()
    refused = case.refused.get(method)
    if refused is not None:
        with pytest.raises(refused, match=method):
            peg.per_example_gradients(case.model, case.loss_fn, case.x, case.y, method=method, variables=case.variables)
        return
    expected = reference_gradients(case.model, case.loss_fn, case.x, case.y, variables=case.variables)
    actual = peg.per_example_gradients(
        case.model, case.loss_fn, case.x, case.y, method=method, variables=case.variables
    )
    assert_grads_close(actual, expected)
    # Sanity of the reference itself: some gradient is non-zero.
    assert any(np.abs(e).max() > 0 for e in expected)


@pytest.mark.parametrize("method", METHODS)
def test_sample_weights(method):
    case = ZOO["mlp"]()
    sw = np.array([0.5, 2.0, 0.0, 1.0, 3.0], "float32")
    expected = reference_gradients(case.model, case.loss_fn, case.x, case.y, sample_weight=sw)
    actual = peg.per_example_gradients(case.model, case.loss_fn, case.x, case.y, sample_weight=sw, method=method)
    assert_grads_close(actual, expected)
    assert np.all(np.asarray(actual[0][2]) == 0)  # weight 0 -> zero gradient


def test_unreached_variables_get_zeros_not_none():
    case = ZOO["multi_output_unreached_head"]()
    grads = peg.per_example_gradients(case.model, case.loss_fn, case.x, case.y)
    head = [i for i, v in enumerate(case.model.trainable_variables) if "unused_head" in v.path]
    assert head, "test model lost its unused head"
    for i in head:
        assert grads[i] is not None and np.all(np.asarray(grads[i]) == 0)


def test_sum_over_examples_is_gradient_of_summed_loss():
    case = ZOO["cnn2d"]()
    grads = peg.per_example_gradients(case.model, case.loss_fn, case.x, case.y)
    with tf.GradientTape() as tape:
        total = tf.reduce_sum(case.loss_fn(case.y, case.model(case.x)))
    batch_grads = tape.gradient(total, case.model.trainable_variables)
    # A sum over B examples of gradients that agree to GRADIENT_RTOL, relative to the sum of their magnitudes.
    rtol = weighted_sum_rtol(len(case.y), GRADIENT_RTOL)
    scale = max(float(np.max(np.sum(np.abs(g), axis=0))) for g in grads)
    for s, g in zip(peg.sum_examples(grads), batch_grads):
        np.testing.assert_allclose(s, g, rtol=rtol, atol=rtol * scale)
