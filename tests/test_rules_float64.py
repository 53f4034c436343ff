"""Float64 models stay float64 through the newer closed forms, exact to float64 rounding.

Each case is one layer (in float64) between a float64 input and a float64
Dense head; per-example gradients, norms and clipped sums of the layer-wise
engine must be float64 and agree with the one-example loop to
``rounding_rtol(n, EPS64)`` for the n terms their sums run over (a float32
step anywhere would miss it by about 1e9 EPS64).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_close, reference_gradients, sparse_ce
from tolerances import EPS64, rounding_rtol

F64 = dict(dtype="float64")


def _lora_dense():
    layer = keras.layers.Dense(5, **F64)
    layer.build((None, 6))
    layer.enable_lora(2)
    layer.lora_kernel_b.assign(np.random.default_rng(3).normal(size=layer.lora_kernel_b.shape))
    return layer


CASES = {  # name -> (layer factory, input shape without the batch axis)
    "depthwise_conv2d": (lambda: keras.layers.DepthwiseConv2D(3, depth_multiplier=2, **F64), (6, 6, 3)),
    "separable_conv2d": (lambda: keras.layers.SeparableConv2D(4, 3, padding="same", **F64), (6, 6, 3)),
    "grouped_conv2d": (lambda: keras.layers.Conv2D(4, 3, groups=2, **F64), (6, 6, 4)),
    "group_norm": (lambda: keras.layers.GroupNormalization(groups=2, **F64), (5, 4)),
    "batch_norm_inference": (lambda: keras.layers.BatchNormalization(**F64), (5, 4)),
    "lora_dense": (_lora_dense, (6,)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_closed_forms_stay_float64_and_exact(name):
    make, shape = CASES[name]
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input(shape, dtype="float64"), make(), keras.layers.Flatten(**F64), keras.layers.Dense(3, **F64)]
    )
    x = np.random.default_rng(1).normal(size=(4, *shape))
    y = np.array([0, 1, 2, 1])
    reference = reference_gradients(model, sparse_ce, x, y)
    flat = np.concatenate([r.reshape(4, -1) for r in reference], axis=1)
    rtol = rounding_rtol(flat.shape[1] + 256, EPS64)  # the norms' sums plus the model's gradient path
    grads = peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise")
    # Every gradient in its variable's dtype: float64, except LoRA's factors, which Keras
    # creates in float32 even in a float64 layer.
    assert [g.dtype for g in grads] == [v.dtype for v in model.trainable_variables]
    assert sum(g.dtype == tf.float64 for g in grads) >= 3
    for g, r in zip(grads, reference):
        tol = rtol if g.dtype == tf.float64 else rounding_rtol(flat.shape[1] + 256)
        assert_close(g, r, rtol=tol, atol=tol * np.abs(flat).max())
    norms = peg.per_example_norms(model, sparse_ce, x, y, method="layerwise")
    assert norms.dtype == tf.float64
    # Float32 LoRA factors enter the norm, hence every clip factor: float32 precision from here on.
    if any(g.dtype != tf.float64 for g in grads):
        rtol = rounding_rtol(flat.shape[1] + 256)
    assert_close(norms, np.linalg.norm(flat, axis=1), rtol=rtol)
    clip = 0.5 * np.median(np.linalg.norm(flat, axis=1))
    sums = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip, method="layerwise")
    factors = clip / np.maximum(np.linalg.norm(flat, axis=1), clip)
    for s, r in zip(sums, reference):
        assert_close(tf.convert_to_tensor(s), np.tensordot(factors, r, axes=1), rtol=rtol, atol=rtol * clip * 4)
