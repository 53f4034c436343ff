"""Small models covering the layer families the engines must handle.

``ZOO``: whole models for every engine, the shared zoo's among them
(``per_example_grads.apps.zoo``: what the benchmarks and demos run). Each builder returns a ``Case``: the
model, a batch, the loss, and which engines are expected to refuse the model
(by design) rather than compute.

``LAYER_CASES``: one layer (or a few) per case, grouped by the layer-wise rule
family that handles them (``RULE_FAMILIES``), for the rule tests
(tests/test_rules_*.py, tests/test_layerwise_*.py). ``layer_case(name)``
returns ``(model, x, y)`` with ``LAYER_B`` examples, its data drawn from a
generator seeded by the name, so a case's data does not depend on which
tests ran before it.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable

import keras
import numpy as np
import pytest
import tensorflow as tf

from helpers import sparse_ce
from per_example_grads.apps import zoo
from per_example_grads.errors import EngineError

B = 5
rng = np.random.default_rng(0)


@dataclasses.dataclass
class Case:
    model: Any
    x: Any
    y: Any
    loss_fn: Callable = sparse_ce
    refused: dict = dataclasses.field(default_factory=dict)  # method -> exception type
    variables: Any = None


def _labels(n_classes=3):
    return rng.integers(0, n_classes, B).astype("int32")


def mlp():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    return Case(model, rng.normal(size=(B, 6)).astype("float32"), _labels())


def cnn1d():
    model = keras.Sequential(
        [
            keras.Input((12, 2)),
            keras.layers.Conv1D(4, 3, strides=2, padding="same", activation="relu"),
            keras.layers.Conv1D(3, 2, dilation_rate=2, padding="causal"),
            keras.layers.MaxPooling1D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    return Case(model, rng.normal(size=(B, 12, 2)).astype("float32"), _labels())


def cnn2d():
    model = keras.Sequential(
        [
            keras.Input((9, 9, 2)),
            keras.layers.Conv2D(4, 3, strides=2, padding="valid", activation="relu"),
            keras.layers.Conv2D(3, 2, dilation_rate=2, padding="same"),
            keras.layers.AveragePooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )
    return Case(model, rng.normal(size=(B, 9, 9, 2)).astype("float32"), _labels())


def embedding_mask_zero_pooled():
    model = keras.Sequential(
        [
            keras.Input((7,), dtype="int32"),
            keras.layers.Embedding(20, 4, mask_zero=True),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )
    x = rng.integers(1, 20, (B, 7)).astype("int32")
    x[:, 4:] = 0  # padding
    x[0, 1:] = 0
    return Case(model, x, _labels())


def embedding_mask_zero_lstm():
    model = keras.Sequential(
        [
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(15, 4, mask_zero=True),
            keras.layers.LSTM(5),
            keras.layers.Dense(3),
        ]
    )
    x = rng.integers(1, 15, (B, 6)).astype("int32")
    x[1, 3:] = 0
    x[2, 1:] = 0
    # tf.vectorized_map cannot convert the masked RNN's while loop (TypeError
    # on a variant tensor): an explicit request fails with a clear EngineError.
    from per_example_grads import EngineError

    return Case(model, x, _labels(), refused={"vectorized": EngineError})


def lstm():
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4), keras.layers.Dense(3)])
    return Case(model, rng.normal(size=(B, 5, 3)).astype("float32"), _labels())


def gru():
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.GRU(4), keras.layers.Dense(3)])
    return Case(model, rng.normal(size=(B, 5, 3)).astype("float32"), _labels())


def transformer_block():
    t, d = 6, 8
    inp = keras.Input((t,), dtype="int32")
    h = keras.layers.Embedding(30, d)(inp)
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(h, h)
    h = keras.layers.LayerNormalization()(h + a)
    f = keras.layers.Dense(16, activation="relu")(h)
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(d)(f))
    out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    # MultiHeadAttention's projections (EinsumDense) become [B, 1, T, D] @ [D, E] batch matmuls
    # under pfor, which corrupt oneDNN's heap: refused by _core/pfor_limits.py, never run.
    return Case(
        keras.Model(inp, out),
        rng.integers(0, 30, (B, t)).astype("int32"),
        _labels(),
        refused={"vectorized": EngineError},
    )


def shared_layer():
    inp = keras.Input((4,))
    shared = keras.layers.Dense(4, activation="tanh")
    out = keras.layers.Dense(3)(shared(shared(inp)))
    return Case(keras.Model(inp, out), rng.normal(size=(B, 4)).astype("float32"), _labels())


def multi_input():
    a, b = keras.Input((3,), name="a"), keras.Input((2, 2), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(4)(a), keras.layers.Flatten()(b)])
    out = keras.layers.Dense(3)(h)
    x = {"a": rng.normal(size=(B, 3)).astype("float32"), "b": rng.normal(size=(B, 2, 2)).astype("float32")}
    return Case(keras.Model({"a": a, "b": b}, out), x, _labels())


def multi_output_unreached_head():
    """The loss uses only the first output: the second head's variables get zeros."""
    inp = keras.Input((4,))
    h = keras.layers.Dense(5, activation="relu")(inp)
    out1, out2 = keras.layers.Dense(3)(h), keras.layers.Dense(2, name="unused_head")(h)
    return Case(
        keras.Model(inp, [out1, out2]),
        rng.normal(size=(B, 4)).astype("float32"),
        _labels(),
        loss_fn=lambda y, preds: sparse_ce(y, preds[0]),
    )


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.blocks = [keras.layers.Dense(6, activation="relu"), keras.layers.Dense(3)]
        self.scale = self.add_weight(shape=(3,), initializer="ones", name="scale")
        self.unused = self.add_weight(shape=(2,), initializer="ones", name="unused")

    def call(self, x, training=False):
        for block in self.blocks:
            x = block(x)
        return x * self.scale


def subclassed():
    model = Subclassed()
    x = rng.normal(size=(B, 4)).astype("float32")
    model(x[:1])
    # The model's own weights live outside any layer, so the layer-wise engine
    # refuses it (auto then uses the next engine).
    return Case(model, x, _labels(), refused={"layerwise": ValueError})


def nested():
    inner = keras.Sequential([keras.layers.Dense(5, activation="relu"), keras.layers.Dense(4)])
    inp = keras.Input((3,))
    out = keras.layers.Dense(3)(inner(inp))
    return Case(keras.Model(inp, out), rng.normal(size=(B, 3)).astype("float32"), _labels())


def frozen_layer_and_nontrainable_variable():
    """A frozen layer is left out by default; asked for by ``variables=`` it gets gradients."""
    frozen = keras.layers.Dense(5, activation="tanh")
    frozen.trainable = False
    model = keras.Sequential([keras.Input((4,)), frozen, keras.layers.Dense(3)])
    case = Case(model, rng.normal(size=(B, 4)).astype("float32"), _labels())
    case.variables = [frozen.kernel] + model.trainable_variables
    return case


def dropout_inference():
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dropout(0.5), keras.layers.Dense(3)]
    )
    return Case(model, rng.normal(size=(B, 6)).astype("float32"), _labels())


def regression_sequence_loss():
    """A ``[B, T, 1]`` loss reduced per example by the library (mean over T)."""
    model = keras.Sequential([keras.Input((4, 2)), keras.layers.Dense(1)])
    return Case(
        model,
        rng.normal(size=(B, 4, 2)).astype("float32"),
        rng.normal(size=(B, 4, 1)).astype("float32"),
        loss_fn=lambda y, p: keras.ops.square(y - p),
    )


def _shared_zoo(name, refused=None):
    """The model ``name`` of ``per_example_grads.apps.zoo`` (what the benchmarks and demos run)."""

    def case():
        model, x, y = zoo.build(name, B)
        return Case(model, x, y, refused=dict(refused or {}))

    case.__name__ = f"zoo_{name}"
    return case


ZOO = {
    f.__name__: f
    for f in [
        _shared_zoo("mlp"),
        _shared_zoo("cnn"),
        # MultiHeadAttention: refused by vectorized (see transformer_block).
        _shared_zoo("transformer", refused={"vectorized": EngineError}),
        _shared_zoo("embedding_bag"),
        _shared_zoo("digits_mlp"),
        mlp,
        cnn1d,
        cnn2d,
        embedding_mask_zero_pooled,
        embedding_mask_zero_lstm,
        lstm,
        gru,
        transformer_block,
        shared_layer,
        multi_input,
        multi_output_unreached_head,
        subclassed,
        nested,
        frozen_layer_and_nontrainable_variable,
        dropout_inference,
        regression_sequence_loss,
    ]
}


# Layer-wise rule cases -----------------------------------------------------

LAYER_B = 4


def sequential_case(r, model_layers, x_shape, dtype="float32", n_classes=3):
    """``model_layers`` between an input of ``x_shape[1:]`` and Flatten, Dense(n_classes); a batch from ``r``."""
    model = keras.Sequential(
        [keras.Input(x_shape[1:], dtype=dtype)] + model_layers + [keras.layers.Flatten(), keras.layers.Dense(n_classes)]
    )
    if dtype == "int32":
        x = r.integers(0, 12, x_shape).astype("int32")
    else:
        x = r.normal(size=x_shape).astype("float32")
    return model, x, r.integers(0, n_classes, x_shape[0]).astype("int32")


def _custom_with_inner_dense(r):
    class Block(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.inner = keras.layers.Dense(4, activation="relu")

        def call(self, x):
            return self.inner(x) * 2.0 + 1.0

    return sequential_case(r, [Block()], (LAYER_B, 5))


class Scale(keras.layers.Layer):
    """A custom layer with its own weight: no rule, so the layer-local fallback."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="random_normal", name="w")

    def call(self, x):
        return x * self.w + tf.sin(x * self.w)


def _mha(r):
    inp = keras.Input((5, 8))
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(inp, inp)
    out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    return (
        keras.Model(inp, out),
        r.normal(size=(LAYER_B, 5, 8)).astype("float32"),
        r.integers(0, 3, LAYER_B).astype("int32"),
    )


def randomize_lora(model, r):
    """Random LoRA ``B`` factors (``lora_kernel_b``, ``lora_embeddings_b``): they start at zero, which makes ``A``'s gradient zero."""
    for v in model.weights:
        if v.name.startswith("lora_") and v.name.endswith("_b"):
            v.assign(r.normal(size=v.shape).astype(v.dtype))
    return model


def _lora_case(r, layer, x_shape, dtype="float32", **lora):
    """``layer`` with LoRA enabled (rank 2 unless ``lora`` says), B random, between input and head."""
    model, x, y = sequential_case(r, [layer], x_shape, dtype=dtype)
    layer.enable_lora(**{"rank": 2, **lora})
    return randomize_lora(model, r), x, y


def _frozen_bias_lora(r):
    layer = keras.layers.Dense(4, activation="relu")
    model, x, y = _lora_case(r, layer, (LAYER_B, 3, 5))
    layer.bias.trainable = False  # LoRA only: the rule's variables follow the layer's trainable ones
    return model, x, y


def _mha_lora(r):
    model, x, y = _mha(r)
    attention = next(l for l in model.layers if isinstance(l, keras.layers.MultiHeadAttention))
    for dense in (attention.query_dense, attention.value_dense):
        dense.enable_lora(rank=2)
    return randomize_lora(model, r), x, y


def _reversible_lm(r, tie_weights=True, dtype="float32", two_lookups=False, pooled=False, **options):
    """A ReversibleEmbedding used as lookup (once or twice) and as the output projection; ids repeat."""
    vocabulary, t, d = 11, 6, 4
    emb = keras.layers.ReversibleEmbedding(vocabulary, d, tie_weights=tie_weights, dtype=dtype, **options)
    inp = keras.Input((t,), dtype="int32")
    h = emb(inp)
    if two_lookups:
        h = h + emb(inp[:, ::-1])
    h = keras.layers.Dense(d, activation="tanh", dtype=dtype)(h)
    if pooled:
        h = keras.layers.GlobalAveragePooling1D(dtype=dtype)(h)
    model = keras.Model(inp, emb(h, reverse=True))
    x = r.integers(0, vocabulary, (LAYER_B, t)).astype("int32")
    x[0, :3] = x[0, 3]  # a repeated id
    y = r.integers(0, vocabulary, (LAYER_B,) if pooled else (LAYER_B, t)).astype("int32")
    return model, x, y


def _with_random_statistics(r, case):
    """``case`` with every BatchNormalization's moving mean, variance, gamma and beta drawn from ``r`` (not 0 and 1)."""
    model = case[0]
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            for v in layer.weights:
                if "variance" in v.path or "gamma" in v.path:
                    v.assign(r.uniform(0.5, 2.0, v.shape).astype("float32"))
                else:
                    v.assign(r.normal(size=v.shape).astype("float32"))
    return case


def _layer_scale_case(r, x_shape):
    from keras.src.applications.convnext import LayerScale

    scale = LayerScale(0.5, x_shape[-1])
    case = sequential_case(r, [keras.layers.Dense(x_shape[-1]), scale], x_shape)
    scale.gamma.assign(r.normal(size=x_shape[-1]).astype("float32"))
    return case


_B = LAYER_B
RULE_FAMILIES = {
    "dense": {  # Dense and EinsumDense rules (MultiHeadAttention is EinsumDense layers)
        "dense_rank2": lambda r: sequential_case(r, [keras.layers.Dense(5, activation="tanh")], (_B, 6)),
        "dense_sequence_gram": lambda r: sequential_case(r, [keras.layers.Dense(16, activation="relu")], (_B, 3, 16)),
        "dense_sequence_materialized": lambda r: sequential_case(r, [keras.layers.Dense(2)], (_B, 9, 2)),
        "dense_rank4_no_bias": lambda r: sequential_case(r, [keras.layers.Dense(3, use_bias=False)], (_B, 2, 3, 4)),
        "einsum_dense_bias_axes": lambda r: sequential_case(
            r, [keras.layers.EinsumDense("abc,cde->abde", (3, 2, 4), bias_axes="de", activation="relu")], (_B, 3, 5)
        ),
        "einsum_dense_ellipsis": lambda r: sequential_case(
            r, [keras.layers.EinsumDense("...b,bc->...c", 4, bias_axes="c")], (_B, 2, 5)
        ),
        "einsum_dense_not_dense_like": lambda r: sequential_case(
            r, [keras.layers.EinsumDense("abc,bd->adc", (4, 3))], (_B, 3, 3)
        ),
        "dense_inside_custom_call": _custom_with_inner_dense,
        "multi_head_attention": _mha,
    },
    "conv": {
        "conv1d_causal_dilated": lambda r: sequential_case(
            r, [keras.layers.Conv1D(4, 3, padding="causal", dilation_rate=2, activation="relu")], (_B, 10, 3)
        ),
        "conv2d_strided_valid": lambda r: sequential_case(
            r, [keras.layers.Conv2D(3, 3, strides=2, activation="tanh")], (_B, 9, 9, 2)
        ),
        "conv2d_pointwise": lambda r: sequential_case(r, [keras.layers.Conv2D(5, 1, activation="relu")], (_B, 4, 3, 6)),
        "conv2d_dilated_same": lambda r: sequential_case(
            r, [keras.layers.Conv2D(3, 2, dilation_rate=2, padding="same")], (_B, 7, 7, 2)
        ),
        "conv2d_few_positions_gram": lambda r: sequential_case(
            r, [keras.layers.Conv2D(16, 3, strides=2, activation="relu")], (_B, 5, 5, 8)
        ),
        "conv2d_same_small_input": lambda r: sequential_case(
            r, [keras.layers.Conv2D(8, 3, padding="same")], (_B, 3, 3, 2)
        ),
        "conv1d_strided_same_no_bias": lambda r: sequential_case(
            r, [keras.layers.Conv1D(5, 4, strides=3, padding="same", use_bias=False)], (_B, 11, 2)
        ),
        "conv3d": lambda r: sequential_case(r, [keras.layers.Conv3D(2, 2, strides=(1, 2, 1))], (_B, 4, 5, 4, 2)),
        "conv3d_strided_same": lambda r: sequential_case(
            r, [keras.layers.Conv3D(3, 3, strides=2, padding="same", activation="tanh")], (_B, 5, 6, 4, 2)
        ),
        "conv3d_few_positions_gram": lambda r: sequential_case(
            r, [keras.layers.Conv3D(16, 2, strides=2)], (_B, 4, 4, 4, 4)
        ),
        "conv3d_dilated": lambda r: sequential_case(
            r, [keras.layers.Conv3D(2, 2, dilation_rate=2, use_bias=False)], (_B, 5, 5, 5, 1)
        ),
        # Transposed convolutions: conv.py's forms with the input and output gradient swapped (conv_transpose.py).
        "conv1d_transpose_strided": lambda r: sequential_case(
            r, [keras.layers.Conv1DTranspose(3, 3, strides=2, activation="tanh")], (_B, 6, 2)
        ),
        "conv1d_transpose_dilated_same": lambda r: sequential_case(
            r, [keras.layers.Conv1DTranspose(2, 3, dilation_rate=2, padding="same")], (_B, 7, 3)
        ),
        "conv2d_transpose_same_output_padding": lambda r: sequential_case(
            r,
            [keras.layers.Conv2DTranspose(3, 3, strides=2, padding="same", output_padding=1, activation="relu")],
            (_B, 4, 5, 2),
        ),
        "conv2d_transpose_valid_output_padding": lambda r: sequential_case(
            r,
            [keras.layers.Conv2DTranspose(2, (2, 3), strides=(3, 2), output_padding=(2, 1), use_bias=False)],
            (_B, 3, 4, 3),
        ),
        "conv2d_transpose_gram": lambda r: sequential_case(
            r, [keras.layers.Conv2DTranspose(8, 2, strides=2)], (_B, 2, 2, 16)
        ),
        "conv3d_transpose_strided_same": lambda r: sequential_case(
            r, [keras.layers.Conv3DTranspose(2, 3, strides=2, padding="same")], (_B, 3, 2, 3, 2)
        ),
        "conv3d_transpose_dilated": lambda r: sequential_case(
            r, [keras.layers.Conv3DTranspose(2, 2, dilation_rate=2)], (_B, 3, 3, 2, 2)
        ),
        "conv2d_transpose_channels_first_fallback": lambda r: sequential_case(
            r, [keras.layers.Conv2DTranspose(2, 2, data_format="channels_first")], (_B, 2, 4, 4)
        ),
    },
    "depthwise": {  # DepthwiseConv1D/2D, SeparableConv1D/2D and grouped Conv1D/2D/3D closed forms (channels_first: the fallback)
        "conv1d_strided_groups": lambda r: sequential_case(
            r, [keras.layers.Conv1D(4, 3, strides=2, groups=2, padding="same")], (_B, 10, 4)
        ),
        "depthwise_conv2d": lambda r: sequential_case(
            r, [keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same")], (_B, 6, 6, 2)
        ),
        "depthwise_conv2d_strided_valid": lambda r: sequential_case(
            r, [keras.layers.DepthwiseConv2D((3, 2), strides=(2, 1), activation="relu")], (_B, 9, 7, 3)
        ),
        "depthwise_conv2d_strided_same_no_bias": lambda r: sequential_case(
            r, [keras.layers.DepthwiseConv2D(3, strides=2, padding="same", use_bias=False)], (_B, 8, 7, 4)
        ),
        "depthwise_conv2d_dilated_same_m3": lambda r: sequential_case(
            r, [keras.layers.DepthwiseConv2D(2, dilation_rate=2, depth_multiplier=3, padding="same")], (_B, 7, 6, 2)
        ),
        "depthwise_conv2d_strided_dilated": lambda r: sequential_case(
            r, [keras.layers.DepthwiseConv2D(2, strides=2, dilation_rate=2, padding="same")], (_B, 9, 9, 2)
        ),
        "depthwise_conv2d_few_positions": lambda r: sequential_case(
            r, [keras.layers.DepthwiseConv2D(3)], (_B, 3, 4, 5)
        ),
        "depthwise_conv2d_same_input_smaller_than_kernel": lambda r: sequential_case(
            r, [keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same")], (_B, 2, 1, 3)
        ),
        "depthwise_conv2d_channels_first_fallback": lambda r: sequential_case(
            r, [keras.layers.DepthwiseConv2D(2, data_format="channels_first")], (_B, 2, 5, 5)
        ),
        "depthwise_conv1d_same": lambda r: sequential_case(
            r, [keras.layers.DepthwiseConv1D(3, depth_multiplier=2, padding="same", activation="tanh")], (_B, 9, 3)
        ),
        "depthwise_conv1d_strided_dilated_no_bias": lambda r: sequential_case(
            r, [keras.layers.DepthwiseConv1D(3, strides=2, dilation_rate=2, use_bias=False)], (_B, 13, 2)
        ),
        "separable_conv2d": lambda r: sequential_case(
            r, [keras.layers.SeparableConv2D(3, 3, activation="relu")], (_B, 6, 6, 2)
        ),
        "separable_conv2d_strided_same_m2_no_bias": lambda r: sequential_case(
            r,
            [keras.layers.SeparableConv2D(4, 3, strides=2, depth_multiplier=2, padding="same", use_bias=False)],
            (_B, 7, 8, 3),
        ),
        "separable_conv2d_dilated_gram": lambda r: sequential_case(
            r, [keras.layers.SeparableConv2D(12, 2, dilation_rate=2, depth_multiplier=4)], (_B, 5, 5, 3)
        ),
        "conv2d_groups_strided_same": lambda r: sequential_case(
            r, [keras.layers.Conv2D(6, 3, strides=2, groups=3, padding="same", activation="relu")], (_B, 7, 6, 6)
        ),
        "conv2d_groups_dilated_large_kernel_vjp": lambda r: sequential_case(
            r, [keras.layers.Conv2D(8, 2, dilation_rate=2, groups=2, use_bias=False)], (_B, 3, 3, 4)
        ),
        "conv1d_groups_causal": lambda r: sequential_case(
            r, [keras.layers.Conv1D(4, 3, groups=2, padding="causal")], (_B, 8, 4)
        ),
        "conv3d_groups_strided_same": lambda r: sequential_case(
            r,
            [keras.layers.Conv3D(4, 2, strides=(2, 1, 1), groups=2, padding="same", activation="relu")],
            (_B, 4, 3, 3, 4),
        ),
        "conv3d_groups_dilated": lambda r: sequential_case(
            r, [keras.layers.Conv3D(6, 2, dilation_rate=2, groups=3, use_bias=False)], (_B, 4, 4, 3, 3)
        ),
        "separable_conv1d_same": lambda r: sequential_case(
            r, [keras.layers.SeparableConv1D(3, 4, padding="same", activation="tanh")], (_B, 10, 2)
        ),
    },
    "embedding": {
        "embedding_mask_zero_pooled": lambda r: sequential_case(
            r,
            [keras.layers.Embedding(12, 4, mask_zero=True), keras.layers.GlobalAveragePooling1D()],
            (_B, 6),
            dtype="int32",
        ),
        "embedding_long_sequence": lambda r: sequential_case(
            r, [keras.layers.Embedding(12, 3)], (_B, 8), dtype="int32"
        ),
        # 24 ids out of 12: every example has repeated ids.
        "embedding_repeated_ids": lambda r: sequential_case(
            r, [keras.layers.Embedding(12, 3)], (_B, 24), dtype="int32"
        ),
        "embedding_long_mask_zero_pooled": lambda r: sequential_case(
            r,
            [keras.layers.Embedding(12, 4, mask_zero=True), keras.layers.GlobalAveragePooling1D()],
            (_B, 20),
            dtype="int32",
        ),
    },
    "normalization": {
        "layer_norm": lambda r: sequential_case(r, [keras.layers.Dense(6), keras.layers.LayerNormalization()], (_B, 5)),
        "layer_norm_sequence": lambda r: sequential_case(
            r, [keras.layers.Dense(6), keras.layers.LayerNormalization(epsilon=0.3)], (_B, 4, 5)
        ),
        "layer_norm_two_axes_rank4": lambda r: sequential_case(
            r, [keras.layers.LayerNormalization(axis=[1, 3])], (_B, 3, 2, 4)
        ),
        "layer_norm_middle_axis_no_center": lambda r: sequential_case(
            r, [keras.layers.LayerNormalization(axis=1, center=False)], (_B, 4, 3)
        ),
        "layer_norm_rms_scaling": lambda r: sequential_case(
            r, [keras.layers.Dense(6), keras.layers.LayerNormalization(rms_scaling=True)], (_B, 3, 5)
        ),
        "layer_norm_no_scale": lambda r: sequential_case(r, [keras.layers.LayerNormalization(scale=False)], (_B, 3, 5)),
        "group_norm": lambda r: sequential_case(
            r, [keras.layers.Conv1D(4, 2), keras.layers.GroupNormalization(groups=2)], (_B, 6, 3)
        ),
        "group_norm_rank4_eps": lambda r: sequential_case(
            r, [keras.layers.Conv2D(6, 2), keras.layers.GroupNormalization(groups=3, epsilon=0.1)], (_B, 4, 5, 2)
        ),
        "group_norm_axis1_no_center": lambda r: sequential_case(
            r, [keras.layers.GroupNormalization(groups=2, axis=1, center=False)], (_B, 4, 3)
        ),
        "group_norm_one_group_no_scale": lambda r: sequential_case(
            r, [keras.layers.Dense(4), keras.layers.GroupNormalization(groups=1, scale=False)], (_B, 3, 4)
        ),
        "batch_norm_inference": lambda r: sequential_case(
            r, [keras.layers.Dense(6), keras.layers.BatchNormalization()], (_B, 5)
        ),
        "batch_norm_inference_conv_stats": lambda r: _with_random_statistics(
            r,
            sequential_case(
                r, [keras.layers.Conv2D(3, 2), keras.layers.BatchNormalization(epsilon=0.1)], (_B, 5, 4, 2)
            ),
        ),
        "batch_norm_inference_axis1_no_center": lambda r: _with_random_statistics(
            r, sequential_case(r, [keras.layers.BatchNormalization(axis=1, center=False)], (_B, 3, 4))
        ),
        "batch_norm_inference_no_scale": lambda r: _with_random_statistics(
            r, sequential_case(r, [keras.layers.BatchNormalization(scale=False)], (_B, 3, 4))
        ),
    },
    "scale": {  # keras.applications.convnext.LayerScale
        "layer_scale_sequence": lambda r: _layer_scale_case(r, (_B, 3, 5)),
        "layer_scale_rank4": lambda r: _layer_scale_case(r, (_B, 2, 3, 4)),
    },
    "local": {  # the layer-local fallback (PReLU is registered to it)
        "prelu": lambda r: sequential_case(r, [keras.layers.Dense(6), keras.layers.PReLU()], (_B, 5)),
        "lstm_fallback": lambda r: sequential_case(r, [keras.layers.LSTM(4, return_sequences=True)], (_B, 5, 3)),
        "custom_layer_fallback": lambda r: sequential_case(r, [Scale()], (_B, 5)),
        "embedding_lora_fallback": lambda r: _lora_case(r, keras.layers.Embedding(12, 3), (_B, 5), dtype="int32"),
        "einsum_dense_lora_contracted_last_axis_fallback": lambda r: _lora_case(
            r, keras.layers.EinsumDense("abc,dc->abd", (3, 4)), (_B, 3, 4)
        ),
    },
    "lora": {  # LoRA-enabled Dense and EinsumDense (rules/lora.py)
        "dense_lora": lambda r: _lora_case(r, keras.layers.Dense(5, activation="tanh"), (_B, 6)),
        "dense_lora_sequence_alpha": lambda r: _lora_case(r, keras.layers.Dense(7), (_B, 3, 6), rank=3, lora_alpha=5),
        "dense_lora_frozen_bias": _frozen_bias_lora,
        "einsum_dense_lora_bias_axes": lambda r: _lora_case(
            r, keras.layers.EinsumDense("abc,cde->abde", (3, 2, 4), bias_axes="de"), (_B, 3, 5)
        ),
        "einsum_dense_lora_ellipsis": lambda r: _lora_case(
            r, keras.layers.EinsumDense("...b,bc->...c", 4, bias_axes="c"), (_B, 2, 5)
        ),
        "multi_head_attention_lora": _mha_lora,
    },
    "reversible_embedding": {  # keras(_hub) ReversibleEmbedding: lookup and tied projection (rules/reversible_embedding.py)
        "reversible_tied": lambda r: _reversible_lm(r),
        "reversible_untied": lambda r: _reversible_lm(r, tie_weights=False),
        "reversible_two_lookups": lambda r: _reversible_lm(r, two_lookups=True),
        "reversible_pooled_soft_cap": lambda r: _reversible_lm(
            r, pooled=True, logit_soft_cap=2.0, reverse_dtype="float32"
        ),
        "reversible_float64": lambda r: _reversible_lm(r, dtype="float64"),
    },
}
LAYER_CASES = {name: build for family in RULE_FAMILIES.values() for name, build in family.items()}
assert len(LAYER_CASES) == sum(len(f) for f in RULE_FAMILIES.values()), "a layer case name is in two families"

# Cases whose tests take seconds (recurrent layers, which vectorize slowly): marked slow by *_params.
SLOW_ZOO = {"lstm", "gru", "embedding_mask_zero_lstm", "zoo_mlp", "zoo_transformer", "zoo_embedding_bag"}
SLOW_LAYER_CASES = {"lstm_fallback"}


def _params(names, slow):
    return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in names]


def zoo_params(names):
    """``names`` of ``ZOO`` cases for ``pytest.mark.parametrize``, those in ``SLOW_ZOO`` marked slow."""
    return _params(names, SLOW_ZOO)


def layer_case(name: str):
    """``(model, x, y)`` for ``LAYER_CASES[name]``, its data from a generator seeded by ``name``."""
    return LAYER_CASES[name](np.random.default_rng(zlib.crc32(name.encode())))


def layer_case_params(names):
    """``names`` of ``LAYER_CASES`` for ``pytest.mark.parametrize``, those in ``SLOW_LAYER_CASES`` marked slow."""
    return _params(names, SLOW_LAYER_CASES)


def shared_dense_and_embedding(r):
    """A Dense layer called twice in a row, an Embedding called on the ids and on them reversed."""
    inp = keras.Input((6,))
    shared = keras.layers.Dense(6, activation="tanh")
    emb_in = keras.Input((5,), dtype="int32")
    emb = keras.layers.Embedding(10, 6)
    h = shared(shared(inp)) + keras.layers.GlobalAveragePooling1D()(emb(emb_in) + emb(emb_in[:, ::-1]))
    model = keras.Model([inp, emb_in], keras.layers.Dense(3)(h))
    x = [r.normal(size=(LAYER_B, 6)).astype("float32"), r.integers(0, 10, (LAYER_B, 5)).astype("int32")]
    return model, x, r.integers(0, 3, LAYER_B).astype("int32")
