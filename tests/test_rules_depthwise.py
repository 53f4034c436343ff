"""The depthwise and separable convolution rules against the one-example loop, eagerly and under XLA."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import per_example_grads as peg
from helpers import (
    clipped_against_loop,
    layerwise_clipped_against_loop,
    layerwise_per_example_against_loop,
    rule_against_loop,
    sparse_ce,
)
from model_zoo import RULE_FAMILIES, layer_case, layer_case_params

CLOSED_FORM = sorted(n for n in RULE_FAMILIES["depthwise"] if not n.endswith("_fallback"))


@pytest.mark.parametrize("name", layer_case_params(sorted(RULE_FAMILIES["depthwise"])))
def test_rule_matches_loop(name):
    rule_against_loop(*layer_case(name))


@pytest.mark.parametrize("clip", [1e-3, 0.3, 1e3])
@pytest.mark.parametrize(
    "name",
    layer_case_params(
        [
            "depthwise_conv2d_strided_valid",
            "depthwise_conv2d_dilated_same_m3",
            "depthwise_conv1d_strided_dilated_no_bias",
            "separable_conv2d_strided_same_m2_no_bias",
            "separable_conv1d_same",
            "conv2d_groups_strided_same",
            "conv2d_groups_dilated_large_kernel_vjp",
            "conv1d_groups_causal",
        ]
    ),
)
def test_clipped_gradients_match_clipping_materialized(name, clip):
    clipped_against_loop(*layer_case(name), clip, methods=["layerwise", "vectorized"])


@pytest.mark.parametrize("name", CLOSED_FORM)
def test_closed_form_is_used_not_the_fallback(name):
    from per_example_grads.engines.capture import plan_watches
    from per_example_grads.rules import depthwise_conv as dc

    model, _, _ = layer_case(name)
    watch = plan_watches(model, model.trainable_variables)[0]
    if isinstance(
        watch.layer, (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
    ):  # a grouped convolution
        assert watch.layer.groups > 1 and watch.rule is dc.GROUPED_RULE
    else:
        assert type(watch.rule) in (dc.DepthwiseConvRule, dc.SeparableConvRule)


def test_channels_first_is_declined():
    from per_example_grads.rules.depthwise_conv import DEPTHWISE_RULE, SEPARABLE_RULE

    assert DEPTHWISE_RULE.unsupported(keras.layers.DepthwiseConv2D(2, data_format="channels_first")) is not None
    assert SEPARABLE_RULE.unsupported(keras.layers.SeparableConv1D(2, 2, data_format="channels_first")) is not None


# A dilated grouped convolution does not compile under XLA inside the layer-wise engine's graph: Keras runs
# it as an XLA-compiled function, and the backward graph TensorFlow builds for that call (the engine's tape
# watches the kernel) has a space-to-batch gradient whose sizes XLA cannot fold. The fallback failed too.
XLA_CASES = [n for n in CLOSED_FORM if n not in ("conv2d_groups_dilated_large_kernel_vjp", "conv3d_groups_dilated")]


@pytest.mark.parametrize("name", XLA_CASES)
def test_clipped_sum_under_xla(name):
    """Under ``jit_compile=True`` the kernels come from the patches, not the grouped convolution."""
    model, x, y = layer_case(name)
    layerwise_clipped_against_loop(model, x, y, tf_function={"jit_compile": True})


@pytest.mark.parametrize(
    "name", ["depthwise_conv2d_dilated_same_m3", "separable_conv2d", "depthwise_conv2d_same_input_smaller_than_kernel"]
)
def test_depthwise_kernels_by_patches_equal_by_groups(name):
    """The two formulations of the per-example kernels agree, on the layer's own a and g."""
    from per_example_grads.rules import depthwise_conv as dc

    model, _, _ = layer_case(name)
    layer = model.layers[0]
    spec = dc._spec(layer)
    c = model.inputs[0].shape[-1]
    m = layer.depth_multiplier
    shape = (3, *model.inputs[0].shape[1:])
    a = tf.random.stateless_normal(shape, [1, 2])
    out_shape = keras.layers.DepthwiseConv2D(
        spec.kernel_size,
        strides=spec.strides,
        padding=spec.padding,
        dilation_rate=spec.dilation_rate,
        depth_multiplier=m,
    ).compute_output_shape(shape)
    g = tf.random.stateless_normal(out_shape, [3, 4])
    by_groups = dc._kernels_by_groups(spec, a, g, m).numpy()
    by_patches = dc._kernels_by_patches(spec, a, g, m).numpy()
    assert by_groups.shape == (3, *spec.kernel_size, c, m)
    t = int(np.prod(out_shape[1:-1]))
    scale = float(np.max(np.abs(a))) * float(np.max(np.abs(g)))
    from tolerances import rounding_rtol

    np.testing.assert_allclose(
        by_groups, by_patches, rtol=0, atol=rounding_rtol(t) * t * scale
    )  # each entry: a sum of t products of at most scale


@pytest.mark.parametrize(
    "name, path",
    [
        ("separable_conv2d_strided_same_m2_no_bias", "_kernels_by_groups"),
        ("depthwise_conv2d", "_kernels_by_groups"),
        ("depthwise_conv2d_same_input_smaller_than_kernel", "_kernels_by_shifts"),
        ("depthwise_conv2d_strided_valid", "_kernels_by_shifts"),
    ],
)
def test_dynamic_batch_in_a_graph(name, path, monkeypatch):
    """An unknown batch size (a ``tf.function`` with a ``None`` batch, as a DP step's realized rows) keeps the paths of static image sizes.

    The groups trick for 3x3 kernels on inputs at least as large as the
    kernel, the per-offset products otherwise; sums, norms and per-example
    gradients against the loop.
    """
    from per_example_grads.rules import depthwise_conv as dc

    taken = []
    original = getattr(dc, path)
    monkeypatch.setattr(dc, path, lambda *args: taken.append(path) or original(*args))
    model, x, y = layer_case(name)
    spec = [tf.TensorSpec((None, *x.shape[1:]), tf.float32), tf.TensorSpec((None,), tf.int32)]
    layerwise_clipped_against_loop(model, x, y, tf_function={"input_signature": spec})
    layerwise_per_example_against_loop(model, x, y, tf_function={"input_signature": spec})
    assert taken


@pytest.mark.parametrize(
    "layer",
    [
        keras.layers.DepthwiseConv2D(3),
        keras.layers.SeparableConv2D(4, 3, padding="same"),
        keras.layers.Conv2D(4, 3, groups=2),
    ],
    ids=lambda l: type(l).__name__,
)
def test_unknown_image_size_in_a_graph(layer):
    """A fully convolutional model traced for any image size (``[None, None, None, C]``) gets exact clipped sums and norms."""
    model = keras.Sequential(
        [keras.Input((None, None, 4)), layer, keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)]
    )
    x = np.random.default_rng(0).normal(size=(3, 7, 7, 4)).astype("float32")
    y = np.array([0, 1, 2], "int32")
    spec = [tf.TensorSpec((None, None, None, 4), tf.float32), tf.TensorSpec((None,), tf.int32)]
    layerwise_clipped_against_loop(model, x, y, tf_function={"input_signature": spec})


@pytest.mark.parametrize(
    "name, kept", [("conv2d_groups_strided_same", True), ("conv2d_groups_dilated_large_kernel_vjp", False)]
)
def test_grouped_conv_keeps_kernels_only_when_small(name, kept):
    """Small per-example kernels serve the clipped sum from the cache; large ones leave it to the kernel VJP."""
    from per_example_grads.rules import depthwise_conv as dc

    model, x, _ = layer_case(name)
    layer = model.layers[0]
    z = layer(x)
    cache = {}
    dc.GROUPED_RULE.squared_norms(layer, tf.constant(x), [tf.ones_like(z)], cache)
    assert ("kept" in cache) == kept


@pytest.mark.parametrize("name", ["depthwise_conv2d", "separable_conv2d_strided_same_m2_no_bias"])
def test_a_batch_of_no_rows_through_the_groups_trick(name):
    """A Poisson step that drew no example runs the model on no rows: zero sums and no norms, not an error."""
    model, x, y = layer_case(name)
    spec = [tf.TensorSpec((None, *x.shape[1:]), tf.float32), tf.TensorSpec((None,), tf.int32)]
    clipped = tf.function(
        lambda x, y: peg.clipped_gradients(
            model, sparse_ce, x, y, l2_norm_clip=1.0, return_norms=True, method="layerwise"
        ),
        input_signature=spec,
    )
    sums, norms = clipped(x[:0], y[:0])
    assert norms.shape == (0,)
    for s, v in zip(sums, model.trainable_variables):
        assert s.shape == v.shape
        np.testing.assert_array_equal(tf.convert_to_tensor(s).numpy(), 0.0)
