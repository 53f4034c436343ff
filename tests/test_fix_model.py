"""peg.dp.fix_model: BatchNormalization replaced (or frozen) so that examples do not mix, weights kept."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import assert_grads_close, reference_gradients, sparse_ce
from per_example_grads.dp import validation
from tolerances import ELEMENTWISE_RTOL


def _bn_model():
    inp = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(8, 3, name="conv")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    inner = keras.Sequential([keras.Input((4, 4, 8)), keras.layers.BatchNormalization(name="inner_bn"),
                              keras.layers.Flatten()], name="inner")
    out = keras.layers.Dense(3, name="head")(inner(keras.layers.ReLU()(h)))
    model = keras.Model(inp, out)
    rng = np.random.default_rng(0)
    for layer in (model.get_layer("bn"), inner.get_layer("inner_bn")):  # weights that are not the initial ones
        layer.set_weights([rng.normal(size=w.shape).astype("float32") if i < 2 else rng.uniform(0.5, 2, w.shape).astype("float32")
                           for i, w in enumerate(layer.get_weights())])
    return model, rng.normal(size=(4, 6, 6, 3)).astype("float32"), np.array([0, 1, 2, 1], "int32")


def test_group_norm_replaces_every_batch_norm_and_keeps_the_weights_it_can():
    model, x, y = _bn_model()
    fixed, changes = peg.dp.fix_model(model, groups=4, return_changes=True)
    layers = list(fixed._flatten_layers(include_self=False))
    assert not any(isinstance(l, keras.layers.BatchNormalization) for l in layers)
    norms = {l.name: l for l in layers if isinstance(l, keras.layers.GroupNormalization)}
    assert set(norms) == {"bn", "inner_bn"} and all(n.groups == 4 for n in norms.values())
    assert len(changes) == 2 and all("GroupNormalization(groups=4" in c for c in changes)
    old_bn = model.get_layer("bn")
    np.testing.assert_array_equal(norms["bn"].gamma.numpy(), old_bn.gamma.numpy())
    np.testing.assert_array_equal(norms["bn"].beta.numpy(), old_bn.beta.numpy())
    for name in ("conv", "head"):
        for a, b in zip(fixed.get_layer(name).get_weights(), model.get_layer(name).get_weights()):
            np.testing.assert_array_equal(a, b)
    assert validation.validate(fixed).errors == [] and validation.validate(model).errors != []
    # The original is untouched, and the fixed model isolates examples: the library's
    # per-example gradients in training mode equal the one-example loop's.
    assert any(isinstance(l, keras.layers.BatchNormalization) for l in model._flatten_layers())
    got = peg.per_example_gradients(fixed, sparse_ce, x, y, training=True)
    assert_grads_close(got, reference_gradients(fixed, sparse_ce, x, y, training=True))


def test_groups_divide_the_channels():
    model = keras.Sequential([keras.Input((4, 6)), keras.layers.BatchNormalization(), keras.layers.Flatten(), keras.layers.Dense(2)])
    fixed = peg.dp.fix_model(model)  # 6 channels, at most 32 groups: the largest divisor of 6 up to 32
    assert fixed.layers[0].groups == 6


def test_freeze_keeps_every_weight_and_runs_inference_mode():
    model, x, y = _bn_model()
    fixed, changes = peg.dp.fix_model(model, batch_norm="freeze", return_changes=True)
    assert len(changes) == 2 and all("frozen" in c for c in changes)
    for a, b in zip(fixed.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert validation.validate(fixed).errors == []
    # training=True now runs the original's inference-mode ops: equal up to the rounding of a few
    # elementwise operations, should a kernel round differently (relative to the outputs' scale).
    expected = model(x, training=False).numpy()
    np.testing.assert_allclose(fixed(x, training=True), expected, rtol=ELEMENTWISE_RTOL, atol=ELEMENTWISE_RTOL * np.abs(expected).max())
    assert all(not v.path.endswith(("gamma", "beta")) for v in fixed.trainable_variables)


def test_refusals_name_the_argument():
    model, _, _ = _bn_model()
    with pytest.raises(ValueError, match="batch_norm must be one of"):
        peg.dp.fix_model(model, batch_norm="layer_norm")
    with pytest.raises(ValueError, match="groups must be a positive int"):
        peg.dp.fix_model(model, groups=0)

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.bn = keras.layers.BatchNormalization()

        def call(self, x):
            return self.bn(x)

    with pytest.raises(ValueError, match="subclassed"):
        peg.dp.fix_model(Sub())
