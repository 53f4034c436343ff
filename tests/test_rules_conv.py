"""The layer-wise convolution rule against the one-example loop, and its internals: patches, chunks, kept kernels."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import per_example_grads as peg
from helpers import (
    assert_clipped_sums_close,
    clipped_against_loop,
    layerwise_clipped_against_loop,
    layerwise_per_example_against_loop,
    reference_gradients,
    reference_norms,
    rule_against_loop,
    sparse_ce,
)
from model_zoo import RULE_FAMILIES, layer_case, layer_case_params


@pytest.mark.parametrize("name", layer_case_params(sorted(RULE_FAMILIES["conv"])))
def test_rule_matches_loop(name):
    rule_against_loop(*layer_case(name))


@pytest.mark.parametrize("clip", [1e-3, 0.3, 1e3])
@pytest.mark.parametrize(
    "name",
    layer_case_params(
        [
            "conv2d_strided_valid",
            "conv2d_dilated_same",
            "conv2d_few_positions_gram",
            "conv2d_same_small_input",
            "conv1d_causal_dilated",
            "conv1d_strided_same_no_bias",
            "conv3d_strided_same",
        ]
    ),
)
def test_clipped_gradients_match_clipping_materialized(name, clip):
    clipped_against_loop(*layer_case(name), clip, methods=["layerwise", "vectorized"])


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 3),
    st.integers(1, 2),
    st.sampled_from([1, 2]),
    st.sampled_from(["valid", "same"]),
    st.sampled_from([1, 2]),
    st.integers(1, 4),
    st.integers(0, 2**16),
)
def test_random_conv_and_sequence_dense(kernel, strides, dilation, padding, t, width, seed):
    dilation = 1 if strides > 1 else dilation
    strides = 1 if kernel == 1 else strides  # the loop's tape would take oneDNN's 1x1 strided kernel: see below
    r = np.random.default_rng(seed)
    model = keras.Sequential(
        [
            keras.Input((8, 2)),
            keras.layers.Conv1D(width, kernel, strides=strides, dilation_rate=dilation, padding=padding),
            keras.layers.Dense(width + 1, activation="tanh"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    x, y = r.normal(size=(3, 8, 2)).astype("float32"), r.integers(0, 3, 3)
    rule_against_loop(model, x, y, norms="global")


CONV_CLIPPED = [
    "conv2d_strided_valid",
    "conv2d_dilated_same",
    "conv2d_same_small_input",
    "conv1d_causal_dilated",
    "conv1d_strided_same_no_bias",
]


@pytest.mark.parametrize("keep, jit", [(False, True), (True, False)])
@pytest.mark.parametrize("name", CONV_CLIPPED)
def test_conv_clipped_sum_by_kernel_vjp_or_kept_kernels_with_and_without_xla(name, keep, jit, monkeypatch):
    from per_example_grads.rules import conv

    monkeypatch.setattr(conv, "KEEP_PER_EXAMPLE_KERNELS", keep)
    monkeypatch.setattr(conv, "NORMS_JIT_COMPILE", jit)
    model, x, y = layer_case(name)
    layerwise_clipped_against_loop(model, x, y)


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("name", CONV_CLIPPED)
def test_conv_norms_in_batch_chunks_equal_the_reference(name, graph, monkeypatch):
    """A chunk of one example (the smallest patch budget) changes nothing, eagerly and in a graph."""
    from per_example_grads.rules import conv

    monkeypatch.setattr(conv, "PATCH_CHUNK_ELEMENTS", 1)
    model, x, y = layer_case(name)
    layerwise_clipped_against_loop(model, x, y, tf_function={} if graph else None)


def test_conv_keeps_per_example_kernels_only_when_small():
    from per_example_grads.rules import conv

    a, g = tf.zeros([2, 9, 9, 2]), tf.zeros([2, 4, 4, 3])  # f k = 54 <= 162 + 48
    spec = conv.ConvSpec(2, (3, 3), (2, 2), (1, 1), "valid")
    assert conv.kernel_squared_norms(spec, a, g, keep=True)[1].shape == (2, 18, 3)  # [B, f, k] (offsets' products)
    assert conv.kernel_squared_norms(spec, a, g, keep=False)[1] is None
    a, g = tf.zeros([2, 3, 3, 2]), tf.zeros([2, 3, 3, 8])  # f k = 144 > 18 + 72
    assert conv.kernel_squared_norms(conv.ConvSpec(2, (3, 3), (1, 1), (1, 1), "same"), a, g, keep=True)[1] is None


@pytest.mark.parametrize(
    "spec, shape",
    [
        ((2, (3, 3), (1, 1), (1, 1), "valid"), (3, 9, 8, 1)),
        ((2, (3, 2), (2, 3), (1, 1), "valid"), (2, 11, 10, 3)),
        ((2, (3, 3), (2, 2), (1, 1), "same"), (2, 9, 8, 2)),
        ((2, (2, 3), (1, 1), (2, 2), "same"), (2, 7, 9, 2)),
        ((1, (3,), (2,), (1,), "same"), (2, 10, 3)),
        ((1, (3,), (1,), (2,), "causal"), (2, 9, 2)),
        ((1, (1,), (1,), (1,), "valid"), (2, 5, 4)),
        # Strides a kernel wide (a ViT's patch embedding): the blocks transposed, not a slice per offset.
        ((2, (4, 4), (4, 4), (1, 1), "valid"), (2, 16, 18, 3)),
        ((2, (2, 3), (2, 3), (1, 1), "same"), (2, 9, 10, 2)),
        ((1, (4,), (4,), (1,), "valid"), (2, 17, 3)),
    ],
)
def test_conv_sliced_patches_equal_extract_patches(spec, shape):
    """The strided-slice patches the norms use under XLA are extract_patches' exactly, in its feature order."""
    from per_example_grads.rules import conv

    _assert_equal_to_sliced_patches(conv.patches, spec, shape)


def _assert_equal_to_sliced_patches(patches_of, spec, shape):
    """``patches_of(ConvSpec(*spec), a)`` is ``conv.sliced_patches`` exactly (no rounding), for ``a`` of ``shape``."""
    from per_example_grads.rules import conv

    layer = conv.ConvSpec(*spec)
    a = tf.random.stateless_normal(shape, [1, 2])
    got = np.asarray(patches_of(layer, a))
    want = conv.sliced_patches(layer, tuple(shape[1:-1]), a).numpy()
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "spec, shape",
    [
        ((3, (2, 2, 2), (1, 2, 1), (1, 1, 1), "valid"), (2, 4, 5, 4, 2)),
        ((3, (3, 2, 3), (2, 1, 2), (1, 1, 1), "same"), (2, 5, 6, 4, 3)),
        ((3, (2, 2, 2), (2, 2, 2), (1, 1, 1), "valid"), (2, 4, 5, 4, 2)),
    ],
)
def test_conv3d_patches_of_unknown_sizes_equal_the_sliced_ones(spec, shape):
    """extract_volume_patches (sizes known only at run time) orders a patch's features as the kernel's rows."""
    from per_example_grads.rules import conv

    unknown = lambda layer, a: tf.function(  # noqa: E731
        lambda a: conv.patches(layer, a), input_signature=[tf.TensorSpec([None, None, None, None, shape[-1]])]
    )(a)
    _assert_equal_to_sliced_patches(unknown, spec, shape)


CONV_CLOSED_FORM = sorted(n for n in RULE_FAMILIES["conv"] if not n.endswith("_fallback"))


@pytest.mark.parametrize("name", CONV_CLOSED_FORM)
def test_closed_form_is_used_not_the_fallback(name):
    from per_example_grads.engines.capture import plan_watches
    from per_example_grads.rules import conv, conv_transpose

    model, _, _ = layer_case(name)
    watch = plan_watches(model, model.trainable_variables)[0]
    transposed = "transpose" in name
    assert watch.rule is (conv_transpose.CONV_TRANSPOSE_RULE if transposed else conv.PATCHES_RULE)
    assert watch.rule.unsupported(watch.layer) is None


def test_transposed_channels_first_is_declined():
    from per_example_grads.rules.conv_transpose import CONV_TRANSPOSE_RULE

    assert CONV_TRANSPOSE_RULE.unsupported(keras.layers.Conv2DTranspose(2, 2, data_format="channels_first")) is not None


@pytest.mark.parametrize(
    "name",
    [
        "conv1d_transpose_strided",
        "conv2d_transpose_same_output_padding",
        "conv2d_transpose_valid_output_padding",
        "conv3d_transpose_strided_same",
        "conv3d_dilated",
    ],
)
def test_clipped_sum_under_xla(name):
    model, x, y = layer_case(name)
    layerwise_clipped_against_loop(model, x, y, tf_function={"jit_compile": True})


@pytest.mark.parametrize(
    "layer, shape",
    [
        (keras.layers.Conv3D(3, 2, dilation_rate=2), (6, 5, 5, 2)),
        (keras.layers.Conv3D(4, 2, dilation_rate=(1, 2, 2), groups=2, padding="same"), (4, 5, 5, 2)),
        (keras.layers.Conv1DTranspose(3, 3, strides=2, padding="same"), (7, 2)),
        (keras.layers.Conv2DTranspose(3, 3, strides=2, output_padding=1), (4, 5, 2)),
        (keras.layers.Conv3DTranspose(2, 2, dilation_rate=2, padding="same"), (3, 3, 4, 2)),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, keras.layers.Layer) else None,
)
def test_unknown_sizes_in_a_graph(layer, shape):
    """A fully convolutional model traced for any size (``[None, None, ..., C]``) gets exact clipped sums and norms.

    A dilated Conv3D of unknown size takes its patches from a convolution with a one-hot kernel.
    """
    rank = len(shape) - 1
    pooling = {
        1: keras.layers.GlobalAveragePooling1D,
        2: keras.layers.GlobalAveragePooling2D,
        3: keras.layers.GlobalAveragePooling3D,
    }[rank]
    c = shape[-1]
    if isinstance(layer, keras.layers.Conv3D) and layer.groups > 1:
        shape = (*shape[:-1], 2 * c)
        c = 2 * c
    model = keras.Sequential([keras.Input((*[None] * rank, c)), layer, pooling(), keras.layers.Dense(3)])
    x = np.random.default_rng(0).normal(size=(3, *shape)).astype("float32")
    y = np.array([0, 1, 2], "int32")
    spec = [tf.TensorSpec((None, *[None] * rank, c), tf.float32), tf.TensorSpec((None,), tf.int32)]
    layerwise_clipped_against_loop(model, x, y, tf_function={"input_signature": spec})
    layerwise_per_example_against_loop(model, x, y, tf_function={"input_signature": spec})


@pytest.mark.parametrize("mode", ["chunks", "xla"])
@pytest.mark.parametrize(
    "name",
    [
        "conv2d_strided_valid",
        "conv2d_pointwise",
        "conv1d_causal_dilated",
        "conv3d_dilated",
        "conv2d_transpose_same_output_padding",
    ],
)
def test_per_example_kernels_in_batch_chunks_and_under_xla(name, mode, monkeypatch):
    """Materialized kernels from the patches, one example per chunk (every case has more positions than filters) or under XLA."""
    from per_example_grads.rules import conv

    if mode == "chunks":
        monkeypatch.setattr(conv, "PATCH_CHUNK_ELEMENTS", 1)
    model, x, y = layer_case(name)
    layerwise_per_example_against_loop(model, x, y, tf_function={"jit_compile": mode == "xla"})


@pytest.mark.parametrize(
    "spec, shape",
    [
        ((3, (2, 2, 2), (1, 1, 1), (2, 1, 2), "valid"), (2, 5, 4, 5, 2)),
        ((3, (3, 2, 2), (1, 1, 1), (1, 2, 1), "same"), (2, 5, 6, 4, 3)),
        ((2, (3, 3), (2, 2), (1, 1), "same"), (2, 7, 6, 2)),
    ],
)
def test_patches_by_one_hot_convolution_equal_the_sliced_ones(spec, shape):
    """The one-hot convolution copies each input value into its (offset, channel) feature: no rounding."""
    from per_example_grads.rules import conv

    _assert_equal_to_sliced_patches(conv._patches_by_convolution, spec, shape)


def _pointwise_strided_and_its_unit_stride_twin(rank, strides, padding):
    """``(model, twin)``: Input -> 1x1 Conv with ``strides`` -> Flatten -> Dense, and the same weights behind a
    strided slice of the input with a unit-stride 1x1 Conv (the same function, whose tape gradients never take
    oneDNN's 1x1 strided backward-weights kernel)."""
    shape = (7, 6, 5)[:rank] + (3,)
    conv = getattr(keras.layers, f"Conv{rank}D")
    model = keras.Sequential(
        [
            keras.Input(shape),
            conv(4, 1, strides=strides, padding=padding),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    steps = strides if isinstance(strides, tuple) else (strides,) * rank
    sliced = keras.layers.Lambda(lambda t: t[(slice(None),) + tuple(slice(None, None, s) for s in steps)])
    twin = keras.Sequential([keras.Input(shape), sliced, conv(4, 1), keras.layers.Flatten(), keras.layers.Dense(3)])
    twin.set_weights(model.get_weights())
    return model, twin, shape


@pytest.mark.parametrize(
    "rank, strides, padding", [(1, 2, "valid"), (2, 2, "same"), (2, (2, 1), "valid"), (3, 2, "same")]
)
def test_pointwise_strided_clipped_sum_avoids_the_onednn_kernel(rank, strides, padding):
    """A 1x1 kernel with strides: the clipped sum equals the loop's, taken on the unit-stride twin, and the traced
    kernel sum holds no backward-weights convolution (oneDNN issue #6035: that kernel corrupts the heap for
    c_in below its channel block on AVX-512 CPUs)."""
    model, twin, shape = _pointwise_strided_and_its_unit_stride_twin(rank, strides, padding)
    r = np.random.default_rng(rank)
    x, y = r.normal(size=(5, *shape)).astype("float32"), r.integers(0, 3, 5)
    clip = 0.3
    expected = reference_gradients(twin, sparse_ce, x, y)
    factors = clip / np.maximum(reference_norms(expected), clip)
    got = peg.clipped_gradients(model, sparse_ce, x, y, l2_norm_clip=clip, method="layerwise")
    assert_clipped_sums_close(got, expected, factors)

    from per_example_grads.rules import conv

    layer = model.layers[0]
    a = tf.constant(x)
    g = tf.constant(r.normal(size=(5, *layer.compute_output_shape((5, *shape))[1:])).astype("float32"))
    kernel_sum = tf.function(lambda a, g, w: conv.weighted_kernel_sum(conv.ConvSpec.of(layer), layer.kernel, a, g, w))
    graph = kernel_sum.get_concrete_function(a, g, tf.ones([5])).graph
    assert not [o.type for o in graph.get_operations() if "BackpropFilter" in o.type]


@pytest.mark.parametrize(
    "kernel_size, strides, padding, spatial",
    [
        ((3, 3), (1, 1), "same", (9, 8)),
        ((3, 3), (2, 2), "same", (9, 8)),
        ((3, 2), (2, 3), "valid", (11, 10)),
        ((7, 7), (2, 2), "same", (20, 20)),
        ((1, 1), (1, 1), "valid", (5, 5)),
    ],
)
def test_conv2d_kernel_vjp_is_the_tapes_bit_for_bit(kernel_size, strides, padding, spatial):
    """The clipped sum's kernel VJP of a 2-D convolution, one Conv2DBackpropFilter, is what the gradient of the layer's
    convolution on a tape gives, eagerly and in a graph (the same op and attributes: no rounding apart)."""
    from per_example_grads.rules import conv

    spec = conv.ConvSpec(2, kernel_size, strides, (1, 1), padding)
    a = tf.random.stateless_normal([3, *spatial, 4], [1, 2])
    kernel = tf.random.stateless_normal([*kernel_size, 4, 5], [3, 4])
    z = tf.nn.convolution(a, kernel, strides=list(strides), padding=padding.upper())
    g = tf.random.stateless_normal(z.shape, [5, 6])
    assert conv._filter_gradient_op(spec, kernel, a)
    direct = lambda a, g: conv._conv2d_kernel_vjp(spec, kernel.shape, a, g)  # noqa: E731
    taped = lambda a, g: conv._kernel_vjp(spec, kernel, a, g)  # noqa: E731
    for ours, reference in ((direct, taped), (tf.function(direct), tf.function(taped))):
        np.testing.assert_array_equal(ours(a, g).numpy(), reference(a, g).numpy())
