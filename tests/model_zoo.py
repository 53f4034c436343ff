"""Small models covering the layer families the engines must handle.

Each builder returns a ``Case``: the model, a batch, the loss, and which
engines are expected to refuse the model (by design) rather than compute.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import keras
import numpy as np

from helpers import sparse_ce

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
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    )
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
    # MultiHeadAttention is on the vectorization deny list: refused, never run.
    return Case(
        keras.Model(inp, out),
        rng.integers(0, 30, (B, t)).astype("int32"),
        _labels(),
        refused={"vectorized": ValueError},
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


ZOO = {
    f.__name__: f
    for f in [
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
