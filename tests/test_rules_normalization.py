"""Layer-wise rules for normalization layers (LayerNormalization's closed form; GroupNormalization and
BatchNormalization in inference) against the one-example loop."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import (
    assert_clipped_sums_close,
    assert_grads_close,
    assert_norms_close,
    clipped_against_loop,
    layerwise_clipped_against_loop,
    reference_gradients,
    reference_norms,
    rule_against_loop,
    sparse_ce,
)
from model_zoo import RULE_FAMILIES, _with_random_statistics, layer_case, layer_case_params, sequential_case


@pytest.mark.parametrize("name", layer_case_params(sorted(RULE_FAMILIES["normalization"])))
def test_rule_matches_loop(name):
    rule_against_loop(*layer_case(name))


@pytest.mark.parametrize("clip", [1e-3, 0.3, 1e3])
@pytest.mark.parametrize(
    "name",
    layer_case_params(
        [
            "layer_norm_sequence",
            "layer_norm_two_axes_rank4",
            "layer_norm_middle_axis_no_center",
            "layer_norm_rms_scaling",
        ]
    ),
)
def test_clipped_gradients_match_clipping_materialized(name, clip):
    clipped_against_loop(*layer_case(name), clip, methods=["layerwise", "vectorized"])


def test_layer_norm_uses_its_closed_form_unless_over_the_batch_axis():
    from per_example_grads.engines.capture import plan_watches
    from per_example_grads.rules.normalization import LayerNormRule

    model, _, _ = layer_case("layer_norm_two_axes_rank4")
    assert [type(u.rule) for u in plan_watches(model, model.trainable_variables)][0] is LayerNormRule
    over_batch = keras.layers.LayerNormalization(axis=[0, 1])
    assert LayerNormRule().unsupported(over_batch) is not None


@pytest.mark.parametrize("clip", [1e-3, 0.3])
@pytest.mark.parametrize(
    "name",
    [
        "batch_norm_inference_conv_stats",
        "batch_norm_inference_axis1_no_center",
        "batch_norm_inference_no_scale",
        "group_norm",
        "group_norm_rank4_eps",
        "group_norm_axis1_no_center",
    ],
)
def test_batch_and_group_norm_clipped_gradients(name, clip):
    clipped_against_loop(*layer_case(name), clip, methods=["layerwise", "vectorized"])


@pytest.mark.parametrize("name", ["batch_norm_inference", "batch_norm_inference_conv_stats"])
def test_batch_norm_inference_uses_its_closed_form(name):
    from per_example_grads.engines.capture import capturing, plan_watches
    from per_example_grads.rules.normalization import BatchNormRule

    model, x, _ = layer_case(name)
    watches = plan_watches(model, model.trainable_variables)
    bn = [u for u in watches if isinstance(u.layer, keras.layers.BatchNormalization)]
    assert [type(u.rule) for u in bn] == [BatchNormRule]
    with capturing(bn) as records:
        model(x, training=False)
    assert records[0].saved[2] is None  # (xh, axes, None): the closed form, not the layer-local VJP


def _frozen_bn_model():
    r = np.random.default_rng(7)
    model, x, y = _with_random_statistics(
        r, sequential_case(r, [keras.layers.Conv2D(3, 2), keras.layers.BatchNormalization()], (4, 5, 4, 2))
    )
    return model, x, y


def test_frozen_batch_norm_in_training_mode_is_the_inference_closed_form():
    """``trainable=False`` BatchNormalization runs on moving statistics even with training=True; its own
    weights are then not trainable, and the Conv2D before it gets gradients through the closed form's tap."""
    model, x, y = _frozen_bn_model()
    model.layers[1].trainable = False
    model.layers[1].gamma.trainable = True  # keep gamma requested while the layer stays frozen
    variables = [model.layers[0].kernel, model.layers[1].gamma]
    expected = reference_gradients(model, sparse_ce, x, y, variables=variables, training=True)
    got = peg.per_example_gradients(model, sparse_ce, x, y, method="layerwise", variables=variables, training=True)
    assert_grads_close(got, expected)
    factors = 0.3 / np.maximum(reference_norms(expected), 0.3)
    clipped, norms = peg.clipped_gradients(
        model,
        sparse_ce,
        x,
        y,
        l2_norm_clip=0.3,
        return_norms=True,
        method="layerwise",
        variables=variables,
        training=True,
    )
    assert_norms_close(norms, expected)
    assert_clipped_sums_close(clipped, expected, factors)


def test_batch_norm_in_training_mode_keeps_the_layer_local_rule():
    """A trainable BatchNormalization called with training=True (allowed only with allow_batch_coupling=True)
    goes to the layer-local VJP, as before this rule; so does a training flag that is a tensor."""
    from per_example_grads.engines.capture import capturing, plan_watches

    model, x, _ = _frozen_bn_model()
    bn = [
        u
        for u in plan_watches(model, model.trainable_variables)
        if isinstance(u.layer, keras.layers.BatchNormalization)
    ]
    for training in (True, tf.constant(False)):
        with capturing(bn) as records:
            model.layers[0](x)  # build nothing new: only the BN call is captured
            model.layers[1](model.layers[0](x), training=training)
        assert records[0].saved[0] is None and records[0].saved[2] is not None


@pytest.mark.parametrize(
    "name", ["group_norm", "group_norm_rank4_eps", "group_norm_axis1_no_center", "group_norm_one_group_no_scale"]
)
def test_group_norm_uses_its_closed_form(name):
    from per_example_grads.engines.capture import plan_watches
    from per_example_grads.rules.normalization import GroupNormRule

    model, _, _ = layer_case(name)
    watches = plan_watches(model, model.trainable_variables)
    assert [type(u.rule) for u in watches if isinstance(u.layer, keras.layers.GroupNormalization)] == [GroupNormRule]


@pytest.mark.parametrize("name", ["batch_norm_inference_conv_stats", "group_norm_rank4_eps"])
def test_normalization_clipped_sum_under_xla(name):
    model, x, y = layer_case(name)
    layerwise_clipped_against_loop(model, x, y, tf_function={"jit_compile": True})


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
@pytest.mark.parametrize(
    "shape, settings",
    [
        ((3, 5, 6, 8), dict(groups=4)),
        ((3, 6, 7), dict(groups=2, axis=1)),
        ((2, 4, 4, 4, 6), dict(groups=3, center=False, epsilon=1e-2)),
        ((3, 5, 6), dict(groups=6, scale=False)),
    ],
    ids=str,
)
def test_group_norm_output_is_the_layers_own_bit_for_bit(shape, settings, policy):
    """The rule builds ``y`` from its one set of moments by the layer's formula and ops: the values of ``layer(x)``.

    Eager against eager and graph against graph (the same ops, so the same
    kernels and graph rewrites on any CPU): bit for bit.
    """
    from per_example_grads.rules.normalization import GroupNormRule

    layer = keras.layers.GroupNormalization(dtype=policy, **settings)
    layer.build(shape)
    for v in layer.weights:
        v.assign(tf.random.stateless_normal(v.shape, [len(v.name), 1]))
    x = tf.cast(tf.random.stateless_normal(shape, [5, 6]) * 3 + 1, layer.compute_dtype)
    forward = lambda x: GroupNormRule().forward(layer, layer.call, (x,), {})[0]  # noqa: E731
    spec = [tf.TensorSpec([None, *shape[1:]], x.dtype)]
    for ours, keras_own in (
        (forward, layer),
        (tf.function(forward, input_signature=spec), tf.function(layer, input_signature=spec)),
    ):
        got, expected = ours(x), keras_own(x)
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got.numpy(), expected.numpy())


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "float64"])
@pytest.mark.parametrize(
    "layer_class, settings, shape",
    [
        (keras.layers.LayerNormalization, {}, (3, 5, 8)),
        (keras.layers.LayerNormalization, dict(axis=[1, 2], center=False, epsilon=1e-2), (3, 5, 8)),
        (keras.layers.LayerNormalization, dict(axis=1), (3, 6, 7)),
        (keras.layers.LayerNormalization, dict(scale=False), (3, 5, 8)),
        (keras.layers.LayerNormalization, dict(axis=[1, 2], rms_scaling=True), (3, 5, 8)),
        (keras.layers.RMSNormalization, {}, (3, 5, 8)),
        (keras.layers.RMSNormalization, dict(axis=[1, 2], epsilon=1e-3), (3, 5, 8)),
    ],
    ids=str,
)
def test_layer_and_rms_norm_outputs_are_the_layers_own_bit_for_bit(layer_class, settings, shape, policy):
    """``y`` is ``layer(x)`` bit for bit, eagerly and in a graph (LayerNormalization's rule by Keras's formula and
    ops from its one set of moments, the others by the layer's call).

    (Before, LayerNormalization's rule built ``xh * gamma + beta``, which
    differs from Keras's ``x * (inv gamma) + (beta - mean inv gamma)`` by
    rounding.)
    """
    from per_example_grads.engines.capture import Watch, capturing
    from per_example_grads.rules.rule import rule_for

    layer = layer_class(dtype=policy, **settings)
    layer.build(shape)
    for v in layer.weights:
        v.assign(tf.random.stateless_normal(v.shape, [len(v.name), 1]))
    rule = rule_for(layer)
    x = tf.cast(tf.random.stateless_normal(shape, [5, 6]) * 3 + 1, layer.compute_dtype)

    def forward(x):  # the rule in the layer's place, as the engine runs it (inside Layer.__call__: autocast)
        with capturing([Watch(layer, rule)]):
            return layer(x)

    spec = [tf.TensorSpec([None, *shape[1:]], x.dtype)]
    for ours, keras_own in (
        (forward, layer),
        (tf.function(forward, input_signature=spec), tf.function(layer, input_signature=spec)),
    ):
        got, expected = ours(x), keras_own(x)
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got.numpy(), expected.numpy())


def _rms_model(r, norm, x_shape):
    model, x, y = sequential_case(r, [keras.layers.Dense(x_shape[-1]), norm], x_shape)
    norm.scale.assign(r.normal(size=norm.scale.shape).astype("float32"))
    return model, x, y


@pytest.mark.parametrize(
    "settings, x_shape",
    [
        ({}, (4, 5, 6)),
        (dict(axis=[1, 2], epsilon=1e-2), (4, 5, 6)),
        (dict(axis=-1), (4, 3, 2, 6)),
        ({}, (4, 6)),
    ],
    ids=str,
)
def test_keras_rms_normalization_matches_the_loop(settings, x_shape):
    from per_example_grads.engines.capture import plan_watches
    from per_example_grads.rules.normalization import KerasRMSNormRule

    r = np.random.default_rng(11)
    norm = keras.layers.RMSNormalization(**settings)
    model, x, y = _rms_model(r, norm, x_shape)
    assert [type(u.rule) for u in plan_watches(model, model.trainable_variables) if u.layer is norm] == [
        KerasRMSNormRule
    ]
    expected = rule_against_loop(model, x, y)
    assert np.abs(expected[2]).max() > 0
    norms = reference_norms(expected)
    clip = float(np.median(norms))
    got, got_norms = peg.clipped_gradients(
        model, sparse_ce, x, y, l2_norm_clip=clip, return_norms=True, method="layerwise"
    )
    assert_norms_close(got_norms, expected)
    assert_clipped_sums_close(got, expected, clip / np.maximum(norms, clip))


def test_keras_rms_normalization_over_the_batch_axis_is_declined():
    from per_example_grads.rules.normalization import KerasRMSNormRule

    norm = keras.layers.RMSNormalization(axis=[0, 1])
    assert "batch axis" in KerasRMSNormRule().unsupported(norm)
