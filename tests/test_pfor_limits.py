"""The rank check that keeps tf.vectorized_map away from ops its CPU kernels cannot take (per_example_grads._core.pfor_limits).

oneDNN's Softmax takes rank <= 5; pfor adds one axis, so a rank-5 softmax in
the one-example graph must never be vectorized (it raises here, and crashed
the process on other CPUs), while a rank-4 one may be.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_grads_close, reference_gradients, sparse_ce
from per_example_grads._core import pfor_limits

B = 3


def _softmax_model(shape):
    """``Input(shape)`` -> Dense(4) -> softmax over the last axis -> Flatten -> Dense(2); scores of rank ``len(shape) + 1``."""
    inp = keras.Input(shape)
    h = keras.layers.Softmax(axis=-1)(keras.layers.Dense(4)(inp))
    return keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(h)))


def _data(shape):
    r = np.random.default_rng(0)
    return r.normal(size=(B, *shape)).astype("float32"), np.array([0, 1, 1])


def test_rank5_softmax_refuses_vectorized_with_the_reason():
    keras.utils.set_random_seed(0)
    shape = (2, 2, 2, 3)  # softmax input [B, 2, 2, 2, 4]: rank 5, rank 6 under pfor
    model, (x, y) = _softmax_model(shape), _data(shape)
    with pytest.raises(peg.EngineError, match="method='vectorized' cannot run.*Softmax on rank 5"):
        peg.per_example_gradients(model, sparse_ce, x, y, method="vectorized")
    with pytest.raises(peg.EngineError, match="Softmax on rank 5"):
        peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=1.0, method="vectorized")
    # jacobian vectorizes only the backward pass, which has no Softmax op: it runs, exactly.
    expected = reference_gradients(model, sparse_ce, x, y)
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method="jacobian"), expected)


def test_rank4_softmax_is_vectorized():
    keras.utils.set_random_seed(0)
    shape = (2, 2, 3)  # softmax input of rank 4: rank 5 under pfor, within the limit
    model, (x, y) = _softmax_model(shape), _data(shape)
    expected = reference_gradients(model, sparse_ce, x, y)
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method="vectorized"), expected)


def test_hazards_are_found_inside_control_flow():
    def fn(x):
        return tf.cond(tf.reduce_sum(x) > 0, lambda: tf.nn.softmax(x), lambda: x)

    assert len(pfor_limits.vectorization_hazards(fn, tf.TensorSpec([2, 2, 2, 2, 2]))) == 1
    assert pfor_limits.vectorization_hazards(fn, tf.TensorSpec([2, 2, 2, 2])) == []


@tf.custom_gradient
def _identity_with_softmax_gradient(x):
    """The identity, whose backward pass (wrongly, on purpose) runs a Softmax on the incoming gradient."""
    return tf.identity(x), lambda g: tf.nn.softmax(g)


def test_jacobian_refuses_a_softmax_in_the_backward_pass():
    keras.utils.set_random_seed(0)
    shape = (2, 2, 2, 3)  # batched [B, 2, 2, 2, 4]: rank 5 in the backward pass, rank 6 under jacobian's pfor
    inp = keras.Input(shape)
    h = keras.layers.Lambda(_identity_with_softmax_gradient)(keras.layers.Dense(4)(inp))
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    x, y = _data(shape)
    with pytest.raises(peg.EngineError, match="method='jacobian' cannot run.*backward pass.*Softmax on rank 5"):
        peg.per_example_gradients(model, sparse_ce, x, y, method="jacobian")


class ScoresLayer(keras.layers.Layer):
    """A layer with its own weight and rank-5 attention-like scores: the layer-local fallback's case."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], input_shape[-1]), initializer="glorot_uniform")

    def call(self, x):  # x: [B, 2, 2, T, D]
        scores = tf.nn.softmax(tf.einsum("bghtd,de,bghse->bghts", x, self.w, x))
        return tf.einsum("bghts,bghsd->bghtd", scores, x)


def test_layer_local_fallback_loops_instead_of_vectorizing(monkeypatch):
    keras.utils.set_random_seed(0)
    shape = (2, 2, 3, 4)
    inp = keras.Input(shape)
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(ScoresLayer()(inp))))
    x, y = _data(shape)
    expected = reference_gradients(model, sparse_ce, x, y)

    calls = []

    def refuse(*args, **kwargs):  # local.py would catch an exception and loop anyway: count the calls
        calls.append(1)
        raise AssertionError("tf.vectorized_map was called on a layer with a rank-5 softmax")

    monkeypatch.setattr(tf, "vectorized_map", refuse)
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise"), expected)
    assert not calls


@pytest.mark.parametrize(
    "a, b, hazard",
    [
        # Measured on TF 2.21 + oneDNN: [5, 1, 6, 8] @ [8, 8] and @ [1, 8, 8] corrupt the heap; the others run.
        ([1, 6, 8], [8, 8], True),  # one example's EinsumDense: [B, 1, 6, 8] @ [8, 8] under pfor
        ([1, 6, 8], [1, 8, 8], True),
        ([2, 6, 8], [8, 8], False),  # no unit batch axis
        ([1, 6, 8], [1, 8, 8 + 1], True),
        ([2, 2, 6, 8], [2, 2, 8, 8], False),
        ([2, 1, 6, 8], [2, 1, 8, 8], True),  # a unit axis: pfor may batch only one operand
        ([None, 6, 8], [8, 8], True),  # a batch axis that may be 1
        ([6, 8], [8, 8], False),  # a plain matmul
    ],
)
def test_broadcast_matmul_hazard(a, b, hazard):
    assert pfor_limits.broadcast_matmul_hazard(tf.TensorShape(a), tf.TensorShape(b)) == hazard


def test_einsum_dense_on_sequences_refuses_vectorized():
    keras.utils.set_random_seed(0)
    inp = keras.Input((4, 3))
    h = keras.layers.EinsumDense("btd,de->bte", output_shape=(4, 5))(inp)
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    x, y = _data((4, 3))
    with pytest.raises(peg.EngineError, match="BatchMatMulV2 broadcasting"):
        peg.per_example_gradients(model, sparse_ce, x, y, method="vectorized")
    expected = reference_gradients(model, sparse_ce, x, y)  # auto: layerwise, exact
    assert_grads_close(peg.per_example_gradients(model, sparse_ce, x, y), expected)
